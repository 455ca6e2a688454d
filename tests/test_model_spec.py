"""ModelSpec: exact counts against the models transformers builds, presets against published
parameter counts, loading, bad input, and the FLOP / activation formulas."""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils.flop_counter import FlopCounterMode
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
    Qwen3Config,
    Qwen3MoeConfig,
)

from slidedp.spec.errors import SpecError
from slidedp.spec.model import ModelSpec, load_model, model_presets, parse_hf_config

FAMILIES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe")
CONFIG_CLASSES = {
    "qwen3": Qwen3Config,
    "qwen2": Qwen2Config,
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen3_moe": Qwen3MoeConfig,
}


def meta_model(cfg):
    with warnings.catch_warnings(), torch.device("meta"):
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_config(cfg)


def numel(module) -> int:
    return sum(p.numel() for p in module.parameters())


def saved_json(cfg) -> dict:
    """What save_pretrained writes to config.json (keys equal to the class defaults dropped)."""
    return json.loads(cfg.to_json_string(use_diff=True))


# ---- (a) exact counts against transformers ---------------------------------------------------


@st.composite
def small_configs(draw, family: str):
    heads = draw(st.integers(1, 8))
    kv = draw(st.sampled_from([d for d in range(1, heads + 1) if heads % d == 0]))
    head_dim = draw(st.sampled_from([2, 4, 8, 16]))
    layers = draw(st.integers(1, 4))
    kw = dict(
        vocab_size=draw(st.integers(8, 300)),
        intermediate_size=draw(st.integers(4, 96)),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=draw(st.booleans()),
    )
    if family == "qwen2":  # qwen2 derives head_dim = hidden // heads
        kw["hidden_size"] = heads * head_dim
    else:
        # transformers validates hidden % heads == 0; head_dim stays independent of it
        kw["hidden_size"] = heads * draw(st.integers(1, 12))
        kw["head_dim"] = head_dim
    if family == "mistral":
        kw["sliding_window"] = draw(st.sampled_from([None, 16, 4096]))
    if family == "qwen3_moe":
        n_exp = draw(st.integers(1, 8))
        kw.update(
            num_experts=n_exp,
            num_experts_per_tok=draw(st.integers(1, n_exp)),
            moe_intermediate_size=draw(st.integers(2, 32)),
            decoder_sparse_step=draw(st.integers(1, 2)),
            mlp_only_layers=draw(st.lists(st.integers(0, layers - 1), unique=True, max_size=2)),
        )
    return CONFIG_CLASSES[family](**kw)


@pytest.mark.parametrize("family", FAMILIES)
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_counts_match_transformers(family, data):
    cfg = data.draw(small_configs(family))
    spec = parse_hf_config(saved_json(cfg), "<drawn>")
    model = meta_model(cfg)
    assert spec.family == family

    embed = model.model.embed_tokens.weight
    assert spec.embed_params() == embed.numel()
    assert spec.final_norm_params() == numel(model.model.norm)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is embed
        assert spec.head_params() == 0
    else:
        assert spec.head_params() == model.lm_head.weight.numel()

    per_layer = [numel(layer) for layer in model.model.layers]
    assert spec.layer_params(0) == per_layer[0]
    assert [spec.layer_params(i) for i in range(spec.n_layers)] == per_layer
    units = spec.unit_params()
    assert len(units) == spec.n_layers + 2
    assert units[0] == embed.numel()
    assert units[1:-1] == per_layer
    assert units[-1] == spec.final_norm_params() + spec.head_params()
    assert spec.total_params() == numel(model) == sum(units)

    # the typical layer is the more common kind
    assert spec.layer_params() in per_layer
    assert per_layer.count(spec.layer_params()) * 2 >= len(per_layer)

    for i, layer in enumerate(model.model.layers):
        experts = getattr(layer.mlp, "experts", None)
        if experts is None:
            assert spec.layer_active_params(i) == per_layer[i]
        else:
            expert_params = numel(experts)
            assert expert_params % cfg.num_experts == 0
            touched = per_layer[i] - expert_params
            touched += cfg.num_experts_per_tok * expert_params // cfg.num_experts
            assert spec.layer_active_params(i) == touched


@pytest.mark.parametrize("family", FAMILIES)
def test_absent_keys_default_as_transformers(family):
    """head_dim, num_key_value_heads and tie_word_embeddings absent: same model as transformers."""
    d = dict(
        model_type=family,
        vocab_size=50,
        hidden_size=64,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=32,
    )
    if family == "qwen3_moe":
        d.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
    spec = parse_hf_config(d, "<minimal>")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(**d)
    model = meta_model(cfg)
    attn = model.model.layers[0].self_attn
    assert spec.head_dim == attn.head_dim
    assert spec.n_kv_heads == attn.k_proj.out_features // attn.head_dim
    assert spec.tie_embeddings is (model.lm_head.weight is model.model.embed_tokens.weight)
    assert spec.total_params() == numel(model)
    assert spec.layer_params() == numel(model.model.layers[0])


def test_qwen2_bias_only_on_qkv():
    spec = parse_hf_config(
        dict(model_type="qwen2", vocab_size=10, hidden_size=16, intermediate_size=8,
             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
             attention_bias=False),
        "<qwen2>",
    )  # fmt: skip
    assert spec.qkv_bias and not spec.qk_norm
    without = dataclasses.replace(spec, qkv_bias=False)
    assert spec.layer_params() - without.layer_params() == 16 + 2 * 8  # q + 2 k biases


# ---- (b) presets against published counts ----------------------------------------------------

# (published parameter count, relative tolerance). Qwen3-1.7B: the Hub's 2.03B counts the
# checkpoint, which stores the tied lm_head as a copy; the unique count is 1.72B (model card:
# 1.7B, 1.4B non-embedding). Qwen3-30B-A3B: 3.3B active is published to two digits.
PUBLISHED = {
    "qwen3-0.6b": 0.596e9,
    "qwen3-1.7b": 1.72e9,
    "qwen3-4b": 4.02e9,
    "qwen3-8b": 8.19e9,
    "qwen3-14b": 14.77e9,
    "qwen3-32b": 32.76e9,
    "qwen2.5-72b": 72.7e9,
    "llama-3.1-8b": 8.03e9,
    "mistral-small-24b": 23.57e9,
    "qwen3-30b-a3b": 30.5e9,
}
TIED = {"qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "tiny-qwen3"}


def test_preset_list():
    assert set(model_presets()) == set(PUBLISHED) | {"tiny-qwen3"}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_total_matches_published(name):
    spec = load_model(name)
    assert spec.name == name and spec.source == name
    assert spec.total_params() == pytest.approx(PUBLISHED[name], rel=0.01)
    assert spec.tie_embeddings is (name in TIED)
    assert spec.config is not None and spec.config["model_type"] == spec.family


def test_qwen3_1_7b_checkpoint_count():
    spec = load_model("qwen3-1.7b")
    stored = spec.total_params() + spec.vocab_size * spec.hidden  # lm_head stored as a copy
    assert stored == pytest.approx(2.03e9, rel=0.01)


def test_qwen3_30b_a3b_is_all_moe():
    spec = load_model("qwen3-30b-a3b")
    assert (spec.n_experts, spec.experts_per_token, spec.moe_ffn, spec.ffn) == (128, 8, 768, 0)
    assert spec.dense_layers == ()
    assert len(set(spec.unit_params()[1:-1])) == 1
    active = spec.total_active_params()
    assert 3.3e9 <= active < 3.4e9
    assert spec.layer_active_params() < spec.layer_params() / 9


def test_tiny_qwen3_shape():
    s = load_model("tiny-qwen3")
    shape = (s.vocab_size, s.hidden, s.ffn, s.n_layers, s.n_heads, s.n_kv_heads, s.head_dim)
    assert shape == (512, 64, 128, 2, 4, 2, 16)
    assert s.tie_embeddings and s.qk_norm and not s.qkv_bias


def test_mixed_moe_layers():
    cfg = dict(load_model("tiny-qwen3").config)
    cfg.update(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_hidden_layers=4,
               num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
               decoder_sparse_step=2, mlp_only_layers=[3])  # fmt: skip
    spec = parse_hf_config(cfg, "<mixed>")
    assert spec.dense_layers == (0, 2, 3)  # layer 1 is the only MoE layer ((i + 1) % 2 == 0)
    assert not spec.is_moe_layer() and spec.is_moe_layer(1)
    assert spec.layer_params() == spec.layer_params(0) != spec.layer_params(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = meta_model(AutoConfig.for_model(**cfg))
    assert spec.total_params() == numel(model)


# ---- (c) loading -----------------------------------------------------------------------------


def _same_shape(a: ModelSpec, b: ModelSpec) -> bool:
    return dataclasses.replace(a, name="x", source="x") == dataclasses.replace(
        b, name="x", source="x"
    )


def test_load_directory_and_file(tmp_path):
    preset = load_model("tiny-qwen3")
    d = tmp_path / "my-tiny"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(dict(preset.config)))
    from_dir = load_model(str(d))
    assert from_dir.name == "my-tiny"
    assert from_dir.source == str(d / "config.json")
    assert _same_shape(from_dir, preset)

    from_file = load_model(str(d / "config.json"))
    assert from_file.name == "my-tiny" and _same_shape(from_file, preset)

    other = tmp_path / "other.json"
    other.write_text(json.dumps(dict(preset.config) | {"tie_word_embeddings": False}))
    untied = load_model(str(other))
    assert untied.name == "other" and untied.source == str(other)
    assert untied.head_params() == preset.vocab_size * preset.hidden
    assert not _same_shape(untied, preset)


def test_spec_is_frozen_and_config_read_only():
    spec = load_model("tiny-qwen3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.hidden = 1
    with pytest.raises(TypeError):
        spec.config["hidden_size"] = 1
    assert "config" not in repr(spec) and "rope_theta" not in repr(spec)
    assert dataclasses.replace(spec, config=None) == spec  # config is not compared


# ---- (d) bad input ---------------------------------------------------------------------------


def _write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return p


def _tiny() -> dict:
    return dict(load_model("tiny-qwen3").config)


def test_unknown_preset():
    with pytest.raises(SpecError) as e:
        load_model("no-such-model")
    assert e.value.field == "name"
    assert "no-such-model" in str(e.value) and "'name'" in str(e.value)
    assert "tiny-qwen3" in str(e.value)  # lists the presets


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"hidden_size": None}, "hidden_size"),
        ({"num_hidden_layers": None}, "num_hidden_layers"),
        ({"model_type": None}, "model_type"),
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "model_type"),
        ({"model_type": "qwen2_vl", "architectures": ["Qwen2VLForConditionalGeneration"]}, "model_type"),
        ({"model_type": "t5"}, "model_type"),
        ({"architectures": ["Qwen3ForSequenceClassification"]}, "architectures"),
        ({"hidden_size": "64"}, "hidden_size"),
        ({"num_key_value_heads": 3}, "num_key_value_heads"),
        ({"tie_word_embeddings": "yes"}, "tie_word_embeddings"),
        ({"attention_bias": True}, "attention_bias"),
        ({"model_type": "llama", "mlp_bias": True}, "mlp_bias"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 8}, "num_experts_per_tok"),
        ({"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 5, "moe_intermediate_size": 8},
         "num_experts_per_tok"),
        ({"model_type": "qwen3_moe", "num_experts_per_tok": 2, "moe_intermediate_size": 8}, "num_experts"),
    ],
)  # fmt: skip
def test_bad_config_names_file_and_field(tmp_path, change, field):
    cfg = _tiny()
    for k, v in change.items():
        if v is None:
            cfg.pop(k)
        else:
            cfg[k] = v
    p = _write(tmp_path, cfg)
    with pytest.raises(SpecError) as e:
        load_model(str(p))
    assert e.value.field == field
    assert str(p) in str(e.value) and f"'{field}'" in str(e.value)


def test_moe_dense_layers_need_intermediate_size(tmp_path):
    cfg = _tiny() | dict(model_type="qwen3_moe", num_experts=4, num_experts_per_tok=2,
                         moe_intermediate_size=8, mlp_only_layers=[0])  # fmt: skip
    cfg.pop("architectures")
    all_moe = cfg | {"mlp_only_layers": []}
    all_moe.pop("intermediate_size")
    assert load_model(str(_write(tmp_path, all_moe, "a.json"))).ffn == 0
    cfg.pop("intermediate_size")
    with pytest.raises(SpecError, match="intermediate_size"):
        load_model(str(_write(tmp_path, cfg, "b.json")))


def test_bad_files(tmp_path):
    with pytest.raises(SpecError, match="<syntax>"):
        load_model(str(_write(tmp_path, "{not json", "broken.json")))
    with pytest.raises(SpecError, match="<root>"):
        load_model(str(_write(tmp_path, "[1, 2]", "list.json")))
    with pytest.raises(SpecError, match="does not exist"):
        load_model(str(tmp_path / "missing.json"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError) as e:
        load_model(str(tmp_path / "empty"))
    assert e.value.field == "config.json" and str(tmp_path / "empty") in str(e.value)


def test_unknown_activation_policy():
    with pytest.raises(SpecError, match="policy"):
        load_model("tiny-qwen3").activation_bytes_per_token("segment-everything")


# ---- (e) FLOPs and activations ---------------------------------------------------------------


def test_flops_tiny_by_hand():
    s = load_model("tiny-qwen3")  # h 64, q 4 x 16 = 64, k 2 x 16 = 32, ffn 128, V 512
    # matmul weights: q 64*64 + k 64*32 + v 64*32 + o 64*64 + mlp 3*64*128 = 12288 + 24576
    # fwd at seq 8: 2 * 36864 + attention 2 * n_q * d * seq = 2 * 4 * 16 * 8 = 1024
    assert s.layer_flops_per_token(8) == {"fwd": 74752.0, "bwd": 149504.0, "recompute": 74752.0}
    f1, f2 = s.layer_flops_per_token(1000)["fwd"], s.layer_flops_per_token(2000)["fwd"]
    assert f2 - f1 == 2 * 4 * 16 * 1000
    # head: 2 * 64 * 512 + 4 * 512
    assert s.head_flops_per_token() == {"fwd": 67584.0, "bwd": 135168.0}


def _counted_layer_flops(cfg, seq: int) -> tuple[float, float, float]:
    """(forward matmul FLOPs, forward attention bmm FLOPs, backward FLOPs) of layer 0, counted
    by torch's FlopCounterMode on a real CPU run with eager (full-square) attention."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    if hasattr(cfg, "_experts_implementation"):  # the per-expert loop: matmuls the counter sees
        model.config._experts_implementation = "eager"
    layer = model.model.layers[0]
    x = torch.randn(1, seq, cfg.hidden_size, requires_grad=True)
    pos = torch.arange(seq)[None]
    mask = torch.full((seq, seq), float("-inf")).triu(1)[None, None]
    with FlopCounterMode(display=False) as fwd:
        y = layer(
            x,
            attention_mask=mask,
            position_embeddings=model.model.rotary_emb(x, pos),
            position_ids=pos,
        )
        y = y[0] if isinstance(y, tuple) else y
    counts = fwd.get_flop_counts()["Global"]
    mm = sum(v for op, v in counts.items() if "bmm" not in str(op))
    bmm = sum(v for op, v in counts.items() if "bmm" in str(op))
    with FlopCounterMode(display=False) as bwd:
        y.float().pow(2).sum().backward()
    return mm, bmm, bwd.get_total_flops()


@pytest.mark.parametrize("moe", [False, True])
def test_flops_match_torch_flop_counter(moe):
    seq = 16
    d = _tiny()
    if moe:
        d |= dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"], num_experts=4,
                  num_experts_per_tok=2, moe_intermediate_size=24)  # fmt: skip
    spec = parse_hf_config(d, "<flops>")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = AutoConfig.for_model(**d)
    mm, bmm, bwd = _counted_layer_flops(cfg, seq)
    fl = spec.layer_flops_per_token(seq)
    # the counter charges the full seq x seq square; the formula charges the causal half
    assert fl["fwd"] * seq == pytest.approx(mm + bmm / 2, rel=1e-9)
    assert fl["bwd"] * seq == pytest.approx(bwd - bmm, rel=1e-9)  # 2 x fwd, causal half again
    assert fl["recompute"] == fl["fwd"]


def test_activation_bytes_tiny_by_hand():
    s = load_model("tiny-qwen3")  # h 64, q 64, k 32, ffn 128, n_q 4, n_kv 2
    assert s.activation_bytes_per_token("layer") == 2 * 64
    # bf16 elements: 4 h + (q + k) roped + k (v) + 2 q (attn out, o_proj in) + 4 ffn
    #   + (q + k) (q_norm/k_norm inputs) = 256 + 96 + 32 + 128 + 512 + 96 = 1120
    # fp32: logsumexp n_q + 2 norm rstd + (n_q + n_kv) q/k-norm rstd = 12
    # eager RMSNorm (segments.EAGER_NORM_BYTES): 6 B per element more for the two layer norms
    #   (12 h = 768) and 4 B more for q_norm / k_norm (4 (q + k) = 384)
    none = 2 * 1120 + 4 * 12 + 768 + 384
    assert s.activation_bytes_per_token("none") == none
    # + output and input gradients (2 h) + d gate, d up (2 ffn), bf16
    assert s.backward_transient_bytes_per_token() == none + 2 * (2 * 64 + 2 * 128)


@pytest.mark.parametrize(
    "name", ["tiny-qwen3", "qwen3-8b", "llama-3.1-8b", "qwen2.5-72b", "qwen3-30b-a3b"]
)
def test_activation_ordering(name):
    s = load_model(name)
    layer, none = s.activation_bytes_per_token("layer"), s.activation_bytes_per_token("none")
    assert layer == 2 * s.hidden
    assert none > 5 * layer
    assert s.backward_transient_bytes_per_token() > none
    # qwen3's q_norm/k_norm keep the raw q and k as well; llama does not
    if s.family == "llama":
        assert none == dataclasses.replace(s, qk_norm=True).activation_bytes_per_token(
            "none"
        ) - 6 * (s.n_heads + s.n_kv_heads) * s.head_dim - 4 * (s.n_heads + s.n_kv_heads)
