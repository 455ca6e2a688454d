"""Model I/O: reading HF directories unit by unit, random init, export to HF and back."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp.exec.io import export_hf, init_from_hf_model, open_model_source
from slidedp.spec.errors import SpecError

SMALL = dict(
    vocab_size=96,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)
FAMILIES = {
    "qwen3": dict(head_dim=8, tie_word_embeddings=True),
    "qwen2": dict(tie_word_embeddings=False),
    "llama": dict(tie_word_embeddings=False),
    "mistral": dict(tie_word_embeddings=False),
}


def tiny_model(family: str, seed: int = 0, **over) -> torch.nn.Module:
    cfg = AutoConfig.for_model(family, **{**SMALL, **FAMILIES[family], **over})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # norms and biases start at 1 / 0: perturb so every tensor is checked
        for p in model.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return model


def logits(model, ids):
    with torch.no_grad():
        return model(ids).logits


@pytest.mark.parametrize("family", list(FAMILIES))
def test_export_loads_in_hf_with_same_logits_and_reads_back(tmp_path, family):
    model = tiny_model(family)
    units = init_from_hf_model(model)
    out = export_hf(tmp_path / "out", model.config, enumerate(units), dtype="float32")
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(logits(back, ids), logits(model, ids), rtol=0, atol=0)
    src = open_model_source(out)
    assert src.unit_numels == [u.numel() for u in units]
    for u, flat in src.units():
        assert torch.equal(flat, units[u]), u


def test_tied_export_writes_only_embedding_and_untied_writes_head(tmp_path):
    tied = tiny_model("qwen3")
    export_hf(tmp_path / "t", tied.config, enumerate(init_from_hf_model(tied)), dtype="float32")
    assert "lm_head.weight" not in load_file(tmp_path / "t" / "model.safetensors")
    untied = tiny_model("llama")
    export_hf(tmp_path / "u", untied.config, enumerate(init_from_hf_model(untied)), dtype="float32")
    assert "lm_head.weight" in load_file(tmp_path / "u" / "model.safetensors")


def test_sharded_bf16_export_in_reverse_unit_order(tmp_path):
    model = tiny_model("qwen2")
    units = init_from_hf_model(model)
    out = export_hf(
        tmp_path / "o",
        model.config,
        reversed(list(enumerate(units))),
        dtype="bfloat16",
        max_shard_bytes=20_000,
    )
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    want = model.to(torch.bfloat16).state_dict()
    for name, p in back.state_dict().items():
        assert torch.equal(p, want[name]), name
    for u, flat in open_model_source(out).units():  # sharded read: bf16 values widened exactly
        assert torch.equal(flat, units[u].bfloat16().float()), u


def test_export_is_atomic(tmp_path):
    model = tiny_model("llama")
    units = init_from_hf_model(model)

    def failing():
        yield 0, units[0]
        raise RuntimeError("injected")

    with pytest.raises(RuntimeError, match="injected"):
        export_hf(tmp_path / "o", model.config, failing())
    assert list(tmp_path.iterdir()) == []  # neither the target nor a temp dir is left
    export_hf(tmp_path / "o", model.config, enumerate(units))
    with pytest.raises(SpecError, match="already holds files"):
        export_hf(tmp_path / "o", model.config, enumerate(units))
    export_hf(tmp_path / "o", model.config, enumerate(units), dtype="float32", overwrite=True)
    assert [p.name for p in tmp_path.iterdir()] == ["o"]
    with pytest.raises(ValueError, match="never given"):
        export_hf(tmp_path / "p", model.config, [(0, units[0])])


def test_file_with_tied_lm_head_is_ignored(tmp_path):
    model = tiny_model("qwen3")
    out = export_hf(
        tmp_path / "o", model.config, enumerate(init_from_hf_model(model)), dtype="float32"
    )
    tensors = load_file(out / "model.safetensors")
    tensors["lm_head.weight"] = torch.zeros_like(tensors["model.embed_tokens.weight"])
    save_file(tensors, out / "model.safetensors")
    src = open_model_source(out)
    assert torch.equal(src.read_unit(0).view(96, 32), model.model.embed_tokens.weight)


def test_preset_random_init_is_per_unit_reproducible_and_hf_distributed():
    a, b = open_model_source("tiny-qwen3", seed=3), open_model_source("tiny-qwen3", seed=3)
    last = len(a.layout) - 1
    assert torch.equal(
        a.read_unit(last), b.read_unit(last)
    )  # no need to draw units 0..last-1 first
    assert not torch.equal(a.read_unit(1), open_model_source("tiny-qwen3", seed=4).read_unit(1))
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(a.config)
    hf_units = init_from_hf_model(hf)
    std = a.config.initializer_range
    for ul in a.layout:
        ours, theirs = ul.views(a.read_unit(ul.unit)), ul.views(hf_units[ul.unit])
        for e in ul.entries:
            x, y = ours[e.local], theirs[e.local]
            if "norm" in e.local:
                assert torch.equal(x, y) and bool((x == 1).all()), e.name
            else:
                assert abs(x.std().item() - std) < 0.1 * std and abs(x.mean().item()) < 0.1 * std, (
                    e.name
                )
                assert abs(y.std().item() - std) < 0.1 * std, e.name


def test_random_init_zeroes_biases_and_padding_row(tmp_path):
    cfg = AutoConfig.for_model("qwen2", **SMALL, pad_token_id=5).to_dict()
    (tmp_path / "m.json").write_text(json.dumps(cfg))
    # a preset-like config file is not a model directory: only presets get random init
    with pytest.raises(SpecError, match="a directory, got a file"):
        open_model_source(tmp_path / "m.json")
    from slidedp.exec.io import RandomInit, hf_config, meta_layout

    model, layout = meta_layout(hf_config(cfg))
    init = RandomInit(model, layout, seed=0)
    emb = layout[0].views(init.unit(0))["weight"]
    assert bool((emb[5] == 0).all()) and bool((emb[4] != 0).all())
    views = layout[1].views(init.unit(1))
    assert bool((views["self_attn.q_proj.bias"] == 0).all())


def _dir_with(tmp_path, family="llama"):
    model = tiny_model(family)
    return export_hf(
        tmp_path / "m", model.config, enumerate(init_from_hf_model(model)), dtype="float32"
    )


def test_bad_model_directories_name_file_and_field(tmp_path):
    with pytest.raises(SpecError, match=r"nope: field '<model directory>': does not exist"):
        open_model_source(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(SpecError, match=r"empty: field 'config.json'"):
        open_model_source(tmp_path / "empty")
    d = _dir_with(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "bert"}))
    with pytest.raises(SpecError, match=r"config.json: field 'model_type'"):
        open_model_source(d)
    (d / "config.json").write_text(json.dumps(cfg))
    tensors = load_file(d / "model.safetensors")

    bad = {k: v for k, v in tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    save_file(bad, d / "model.safetensors")
    with pytest.raises(
        SpecError,
        match=r"model.safetensors: field 'model.layers.1.mlp.up_proj.weight': a tensor of shape \[48, 32\], missing",
    ):
        open_model_source(d)
    save_file({**tensors, "model.norm.weight": torch.ones(31)}, d / "model.safetensors")
    with pytest.raises(
        SpecError, match=r"model.safetensors: field 'model.norm.weight': shape \[32\], got \[31\]"
    ):
        open_model_source(d)
    save_file(
        {**tensors, "model.norm.weight": torch.ones(32, dtype=torch.int32)}, d / "model.safetensors"
    )
    with pytest.raises(SpecError, match=r"field 'model.norm.weight': dtype"):
        open_model_source(d)
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(SpecError, match=r"model.safetensors: field '<header>'"):
        open_model_source(d)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SpecError, match=r"field 'model.safetensors': .*convert to safetensors"):
        open_model_source(d)


def test_bad_sharded_index_names_index_and_tensor(tmp_path):
    model = tiny_model("mistral")
    d = export_hf(
        tmp_path / "m",
        model.config,
        enumerate(init_from_hf_model(model)),
        dtype="float32",
        max_shard_bytes=20_000,
    )
    index_path = d / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = index["weight_map"]["model.embed_tokens.weight"]
    (d / first).rename(d / "elsewhere.safetensors")
    with pytest.raises(
        SpecError,
        match=rf"index.json: field 'weight_map.model.embed_tokens.weight': an existing file, {first} is missing",
    ):
        open_model_source(d)
    (d / "elsewhere.safetensors").rename(d / first)
    index["weight_map"]["model.embed_tokens.weight"] = index["weight_map"]["model.norm.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        SpecError,
        match=r"field 'model.embed_tokens.weight': a tensor \(listed in the index\), missing",
    ):
        open_model_source(d)
    del index["weight_map"]["lm_head.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(
        SpecError,
        match=r"index.json: field 'lm_head.weight': a tensor of shape \[96, 32\], missing",
    ):
        open_model_source(d)


def test_unknown_preset_and_bad_export_dtype(tmp_path):
    with pytest.raises(SpecError, match=r"--model: field 'name'"):
        open_model_source("no-such-preset")
    src = open_model_source("tiny-qwen3")
    with pytest.raises(SpecError, match=r"export: field 'dtype'"):
        export_hf(tmp_path / "o", src.config, src.units(), dtype="int8")


def test_qwen3_moe_reads_hub_per_expert_files_and_exports_fused(tmp_path):
    cfg = AutoConfig.for_model(
        "qwen3_moe",
        **{
            **SMALL,
            "head_dim": 8,
            "moe_intermediate_size": 16,
            "num_experts": 4,
            "num_experts_per_tok": 2,
        },
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    units = init_from_hf_model(model)
    model.save_pretrained(tmp_path / "hub")  # transformers writes experts.{i}.*_proj.weight
    assert "model.layers.0.mlp.experts.3.up_proj.weight" in load_file(
        tmp_path / "hub" / "model.safetensors"
    )
    for u, flat in open_model_source(tmp_path / "hub").units():
        assert torch.equal(flat, units[u]), u
    out = export_hf(tmp_path / "o", model.config, enumerate(units), dtype="float32")
    ids = torch.randint(0, SMALL["vocab_size"], (2, 12), generator=torch.Generator().manual_seed(1))
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(logits(back, ids), logits(model, ids), rtol=0, atol=0)
