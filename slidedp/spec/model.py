"""Model spec: the shape of a Hugging Face decoder-only causal LM, with exact parameter counts,
FLOPs per token and activation bytes per token, the inputs of the step-time and memory models.

Loaded from a Hugging Face `config.json` (a preset name under slidedp/presets/models/, a file, or
a directory holding config.json). Supported `model_type`s: qwen3, qwen2, llama, mistral,
qwen3_moe; anything else (vision, encoder, encoder-decoder models) is a SpecError naming the file.

Notation: V vocab, h hidden, f dense ffn (intermediate_size), L layers, n_q query heads, n_kv
key/value heads, d head_dim, q = n_q d, k = n_kv d, E experts, e experts per token, m moe ffn.

Parameter counts (exact; they equal `sum(p.numel())` of the model transformers builds):
  embed         V h
  attention     h q + 2 h k + q h            (q/k/v/o projections)
                + q + 2 k                    (qwen2 only: bias on q/k/v, none on o_proj)
                + 2 d                        (qwen3, qwen3_moe: q_norm and k_norm over head_dim)
  norms         2 h                          (input and post-attention RMSNorm)
  dense MLP     3 h f                        (gate, up, down)
  MoE MLP       3 E h m + E h                (all experts' gate/up/down + router; no biases)
  final norm    h
  LM head       V h, or 0 when tie_word_embeddings (the head reuses the embedding)
Streaming units are [embed, layer_0 .. layer_{L-1}, final norm + LM head].

Qwen3-MoE (num_experts, also read as num_local_experts, the name transformers >= 5 writes;
num_experts_per_tok; moe_intermediate_size; no shared experts): layer i is MoE when
num_experts > 0, i is not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0 (as
transformers decides); the other layers have a dense MLP of intermediate_size. `dense_layers` lists the dense ones. unit_params() and total_params() are
exact per layer; layer_params() and the other per-layer methods take an optional layer index and
without it describe the typical layer (the more common kind, MoE on a tie). Qwen3-30B-A3B is
all-MoE (ffn = 0).

Defaults for absent keys follow transformers' config classes (so counts match what it builds):
  head_dim             qwen3: 128; others: hidden_size // num_attention_heads
  num_key_value_heads  llama: num_attention_heads; qwen2, qwen3: 32; mistral: 8; qwen3_moe: 4
  tie_word_embeddings  false for all five families
  attention_bias       qwen2 ignores it (q/k/v bias always on, o_proj never); mistral ignores it
                       (no bias); llama/qwen3/qwen3_moe with attention_bias=true (bias on o_proj
                       too) and llama with mlp_bias=true are rejected: not modelled.
Sliding-window attention (mistral, qwen2 use_sliding_window) is ignored: it changes neither the
parameter count nor, at the sequence lengths we fine-tune at, the attention FLOPs materially.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any

from slidedp.spec.errors import SpecError

FAMILIES = ("qwen3", "qwen2", "llama", "mistral", "qwen3_moe")
ACTIVATION_POLICIES = ("layer", "none")  # named here; bytes other than "layer" in slidedp.spec.segments
BF16 = 2  # bytes per element of activations
FP32 = 4

# transformers' defaults when the key is absent from config.json (None: derived, see below)
_DEFAULT_HEAD_DIM = {"qwen3": 128}  # others: hidden_size // num_attention_heads
_DEFAULT_KV_HEADS = {"qwen2": 32, "qwen3": 32, "mistral": 8, "qwen3_moe": 4}  # llama: n_heads
# cross-entropy elementwise work per logit (max, subtract+exp, sum, log, pick), forward
_LOSS_FLOPS_PER_LOGIT = 4


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a decoder-only causal LM. See the module docstring for every formula."""

    name: str
    family: str  # HF model_type: "qwen3", "qwen2", "llama", "mistral", "qwen3_moe"
    vocab_size: int
    hidden: int
    ffn: int  # dense intermediate_size (for MoE: 0 if every layer is MoE)
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    tie_embeddings: bool
    qkv_bias: bool  # qwen2 has q/k/v bias
    qk_norm: bool  # qwen3 has q_norm/k_norm (head_dim params each)
    n_experts: int = 0  # MoE only
    experts_per_token: int = 0
    moe_ffn: int = 0  # moe_intermediate_size
    source: str = ""  # where the config came from (preset name or file path)
    config: MappingProxyType | None = field(default=None, compare=False, repr=False)
    # MoE models only: indices of the layers whose MLP is dense (mlp_only_layers,
    # decoder_sparse_step); () means every layer is MoE. Ignored when n_experts == 0.
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        where = f"model {self.name}"
        for f in ("vocab_size", "hidden", "n_layers", "n_heads", "n_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise SpecError(where, f, f"a positive integer, got {v!r}")
        if self.n_heads % self.n_kv_heads:
            raise SpecError(
                where, "n_kv_heads", f"a divisor of n_heads={self.n_heads}, got {self.n_kv_heads}"
            )
        if self.n_experts:
            if not 1 <= self.experts_per_token <= self.n_experts:
                raise SpecError(
                    where,
                    "experts_per_token",
                    f"in 1..{self.n_experts}, got {self.experts_per_token}",
                )
            if self.moe_ffn < 1:
                raise SpecError(where, "moe_ffn", f"a positive integer, got {self.moe_ffn}")
            if any(not 0 <= i < self.n_layers for i in self.dense_layers):
                raise SpecError(where, "dense_layers", f"layer indices in 0..{self.n_layers - 1}")
        if self.ffn < 0 or (self.ffn == 0 and self._n_dense_layers() > 0):
            raise SpecError(where, "ffn", f"a positive integer for dense layers, got {self.ffn}")

    # ---- layer kinds -------------------------------------------------------------------------

    def _n_dense_layers(self) -> int:
        return self.n_layers if not self.n_experts else len(set(self.dense_layers))

    def is_moe_layer(self, layer: int | None = None) -> bool:
        """Whether layer `layer` has an MoE MLP; None: the typical layer (more common kind)."""
        if not self.n_experts:
            return False
        if layer is None:
            return self._n_dense_layers() * 2 <= self.n_layers
        return layer not in self.dense_layers

    # ---- parameter counts --------------------------------------------------------------------

    def _q(self) -> int:
        return self.n_heads * self.head_dim

    def _kv(self) -> int:
        return self.n_kv_heads * self.head_dim

    def _attn_matmul_params(self) -> int:
        h, q, k = self.hidden, self._q(), self._kv()
        return h * q + 2 * h * k + q * h

    def _attn_params(self) -> int:
        p = self._attn_matmul_params()
        if self.qkv_bias:
            p += self._q() + 2 * self._kv()
        if self.qk_norm:
            p += 2 * self.head_dim
        return p

    def _mlp_matmul_params(self, layer: int | None, active: bool) -> int:
        """Matmul weights of the MLP; MoE: router + all experts, or e experts when `active`."""
        h = self.hidden
        if not self.is_moe_layer(layer):
            return 3 * h * self.ffn
        experts = self.experts_per_token if active else self.n_experts
        return experts * 3 * h * self.moe_ffn + self.n_experts * h

    def embed_params(self) -> int:
        return self.vocab_size * self.hidden

    def layer_params(self, layer: int | None = None) -> int:
        """All parameters of one decoder layer (MoE: all experts + router).

        attention + 2 h (norms) + MLP, see the module docstring; `layer` picks a layer of a mixed
        dense/MoE model, None the typical one.
        """
        return self._attn_params() + 2 * self.hidden + self._mlp_matmul_params(layer, False)

    def layer_active_params(self, layer: int | None = None) -> int:
        """Parameters touched per token: attention + norms + router + e of the E experts (MoE)."""
        return self._attn_params() + 2 * self.hidden + self._mlp_matmul_params(layer, True)

    def final_norm_params(self) -> int:
        return self.hidden

    def head_params(self) -> int:
        """LM head weight V h; 0 when tied to the embedding."""
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden

    def unit_params(self) -> list[int]:
        """Streaming units: [embed, layer_0 .. layer_{L-1}, final norm + LM head]."""
        layers = [self.layer_params(i) for i in range(self.n_layers)]
        return [self.embed_params(), *layers, self.final_norm_params() + self.head_params()]

    def total_params(self) -> int:
        """Unique parameters (a tied head is counted once, as the embedding)."""
        return sum(self.unit_params())

    def total_active_params(self) -> int:
        """Parameters touched per token over the whole model (= total_params() for dense models)."""
        layers = sum(self.layer_active_params(i) for i in range(self.n_layers))
        return self.embed_params() + layers + self.final_norm_params() + self.head_params()

    # ---- FLOPs -------------------------------------------------------------------------------

    def layer_flops_per_token(self, seq: int, layer: int | None = None) -> dict[str, float]:
        """FLOPs per token of one decoder layer at sequence length `seq`.

        fwd = 2 P_mm + 2 n_q d seq
          P_mm: matmul weights touched per token: h q + 2 h k + q h + MLP (3 h f dense;
          MoE: 3 e h m + E h, the router included); norms, biases, RoPE and SiLU are not counted.
          Attention: QK^T and AV each cost 2 n_q d seq FLOPs per token over the full seq x seq
          square, halved by the causal mask: 2 x (2 n_q d seq) / 2 = 2 n_q d seq.
        bwd = 2 fwd (gradients w.r.t. inputs and weights), recompute = fwd.
        """
        if seq < 1:
            raise SpecError("layer_flops_per_token", "seq", f"a positive integer, got {seq}")
        mm = self._attn_matmul_params() + self._mlp_matmul_params(layer, True)
        fwd = 2.0 * mm + 2.0 * self.n_heads * self.head_dim * seq
        return {"fwd": fwd, "bwd": 2.0 * fwd, "recompute": fwd}

    def head_flops_per_token(self) -> dict[str, float]:
        """LM head + loss: fwd = 2 h V + 4 V (logits matmul + cross-entropy), bwd = 2 fwd."""
        fwd = 2.0 * self.hidden * self.vocab_size + _LOSS_FLOPS_PER_LOGIT * self.vocab_size
        return {"fwd": fwd, "bwd": 2.0 * fwd}

    # ---- activation memory -------------------------------------------------------------------

    def _mlp_width(self, layer: int | None) -> int:
        """Width of the MLP's per-token intermediates: f (dense) or e m (MoE, e experts)."""
        if self.is_moe_layer(layer):
            return self.experts_per_token * self.moe_ffn
        return self.ffn

    def activation_bytes_per_token(self, policy: str, layer: int | None = None) -> float:
        """Activation bytes per token one decoder layer keeps for backward, bf16.

        "layer" (whole-layer checkpoint): the layer input, 2 h. "sac" and "seg:<mask>": see
        slidedp.spec.segments (an unknown name is a SpecError naming the policy).
        "none" (plain autograd, SDPA/flash attention: no seq x seq scores), the tensors autograd
        saves in a Qwen3/Llama decoder layer, in elements per token (x2 bytes):
          h      layer input x (input RMSNorm input; the residual)
          h      normed x (q/k/v projection input)
          q + k  q, k projection outputs (q_norm/k_norm inputs; qwen3 family only)
          q + k  roped q, k (attention inputs)
          k      v
          q      attention output (kept by the attention kernel)
          q      o_proj input (the transposed contiguous copy of the attention output; aliased
                 with flash-attn 2, so this is an upper bound by q elements there)
          h      h1 = x + attn (post-attention RMSNorm input; the second residual)
          h      normed h1 (gate/up input)
          4 w    gate output, up output, SiLU(gate), SiLU(gate) * up (down_proj input)
        plus fp32 terms: attention logsumexp (4 n_q bytes), one rstd per RMSNorm row (4 x 2, and
        4 (n_q + n_kv) for q_norm/k_norm). w = f (dense) or e m (MoE); MoE adds the e gathered
        expert inputs (e h) and the router probabilities (E, fp32). The norms are transformers'
        eager RMSNorm, which the executor runs: each keeps 6 B per element more (its fp32 input
        copy and the normalized bf16 tensor; 12 h for the two layer norms, and q_norm / k_norm
        keep fp32 q, k instead of the bf16 ones: 4 (q + k) more); slidedp.spec.segments
        (segment_costs, EAGER_NORM_BYTES) is where these bytes are counted.
        """
        if policy == "layer":
            return float(BF16 * self.hidden)
        from slidedp.spec.segments import parse_policy, policy_cost  # they import this module

        if policy not in ACTIVATION_POLICIES:  # sac, seg:<mask>
            parsed = parse_policy(policy, "activation policy", "policy")
            return policy_cost(self, parsed, 1, layer).retained_bytes  # retained bytes ignore seq
        return policy_cost(self, "none", 1, layer).retained_bytes

    def backward_transient_bytes_per_token(self, layer: int | None = None) -> float:
        """Peak bytes per token that coexist while one layer's recompute + backward runs ("layer").

        The recomputed activations of the layer (activation_bytes_per_token("none")), the incoming
        output gradient and the input gradient being accumulated (2 x h), and the two widest
        gradient temporaries alive at once in the MLP backward (d gate and d up: 2 w), all bf16.
        Weight gradients are per layer, not per token, and are not included.
        """
        w = self._mlp_width(layer)
        return self.activation_bytes_per_token("none", layer) + BF16 * (2 * self.hidden + 2 * w)


# ---- parsing ---------------------------------------------------------------------------------


def _int(cfg: dict, key: str, where: str, default: Any = ..., minimum: int = 1) -> int:
    v = cfg.get(key)
    if v is None:
        if default is ...:
            raise SpecError(where, key, "required but missing")
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise SpecError(where, key, f"an integer, got {v!r}")
    if v < minimum:
        raise SpecError(where, key, f"an integer >= {minimum}, got {v}")
    return v


def _bool(cfg: dict, key: str, where: str, default: bool) -> bool:
    v = cfg.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise SpecError(where, key, f"true or false, got {v!r}")
    return v


def first_layers_config(cfg: dict, n_layers: int) -> dict:
    """A config.json dict cut to its first `n_layers` decoder layers (per-layer lists cut too)."""
    out = dict(cfg) | {"num_hidden_layers": n_layers}
    if isinstance(out.get("layer_types"), list):
        out["layer_types"] = out["layer_types"][:n_layers]
    return out


def parse_hf_config(cfg: dict, where: str) -> ModelSpec:
    """A ModelSpec from the contents of a Hugging Face config.json; `where` names the file."""
    if not isinstance(cfg, dict):
        raise SpecError(where, "<root>", "a JSON object (a Hugging Face config.json)")
    family = cfg.get("model_type")
    if family is None:
        raise SpecError(where, "model_type", f"required but missing (one of {', '.join(FAMILIES)})")
    if family not in FAMILIES:
        raise SpecError(
            where,
            "model_type",
            f"a decoder-only causal LM, one of {', '.join(FAMILIES)}; got {family!r}",
        )
    archs = cfg.get("architectures")
    if archs is not None and (
        not isinstance(archs, list)
        or not all(isinstance(a, str) and a.endswith("ForCausalLM") for a in archs)
    ):
        raise SpecError(where, "architectures", f"a *ForCausalLM decoder, got {archs!r}")

    vocab = _int(cfg, "vocab_size", where)
    hidden = _int(cfg, "hidden_size", where)
    n_layers = _int(cfg, "num_hidden_layers", where)
    n_heads = _int(cfg, "num_attention_heads", where)
    # absent: the config class's default; an explicit null: n_heads (transformers' __post_init__)
    kv_default = (
        _DEFAULT_KV_HEADS.get(family, n_heads) if "num_key_value_heads" not in cfg else n_heads
    )
    n_kv = _int(cfg, "num_key_value_heads", where, kv_default)
    if n_heads % n_kv:
        raise SpecError(
            where, "num_key_value_heads", f"a divisor of num_attention_heads={n_heads}, got {n_kv}"
        )
    hd_default = (
        _DEFAULT_HEAD_DIM.get(family, hidden // n_heads)
        if "head_dim" not in cfg
        else hidden // n_heads
    )
    head_dim = _int(cfg, "head_dim", where, hd_default)
    tie = _bool(cfg, "tie_word_embeddings", where, False)

    if family in ("llama", "qwen3", "qwen3_moe") and _bool(cfg, "attention_bias", where, False):
        raise SpecError(
            where, "attention_bias", "false (bias on q/k/v/o projections is not modelled)"
        )
    if family == "llama" and _bool(cfg, "mlp_bias", where, False):
        raise SpecError(where, "mlp_bias", "false (bias on MLP projections is not modelled)")
    qkv_bias = family == "qwen2"
    qk_norm = family in ("qwen3", "qwen3_moe")

    n_experts = k_experts = moe_ffn = 0
    dense: tuple[int, ...] = ()
    ffn_needed = True
    if family == "qwen3_moe":
        # transformers >= 5 writes num_experts under its attribute_map name num_local_experts
        key = (
            "num_experts"
            if cfg.get("num_experts") is not None or "num_local_experts" not in cfg
            else "num_local_experts"
        )
        n_experts = _int(cfg, key, where, minimum=0)
        if n_experts:
            k_experts = _int(cfg, "num_experts_per_tok", where)
            if k_experts > n_experts:
                raise SpecError(
                    where,
                    "num_experts_per_tok",
                    f"at most num_experts={n_experts}, got {k_experts}",
                )
            moe_ffn = _int(cfg, "moe_intermediate_size", where)
            step = _int(cfg, "decoder_sparse_step", where, 1)
            only = cfg.get("mlp_only_layers") or []
            if not isinstance(only, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in only
            ):
                raise SpecError(where, "mlp_only_layers", f"a list of layer indices, got {only!r}")
            dense = tuple(i for i in range(n_layers) if i in only or (i + 1) % step != 0)
            ffn_needed = bool(dense)
    ffn = _int(cfg, "intermediate_size", where) if ffn_needed else 0

    name = str(cfg.get("_name_or_path") or family)
    return ModelSpec(
        name=name,
        family=family,
        vocab_size=vocab,
        hidden=hidden,
        ffn=ffn,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        tie_embeddings=tie,
        qkv_bias=qkv_bias,
        qk_norm=qk_norm,
        n_experts=n_experts,
        experts_per_token=k_experts,
        moe_ffn=moe_ffn,
        source=where,
        config=MappingProxyType(dict(cfg)),
        dense_layers=dense,
    )


def _read_json(p: Path) -> dict:
    if not p.is_file():
        raise SpecError(str(p), "<file>", "file does not exist")
    try:
        return json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SpecError(str(p), "<syntax>", f"valid JSON ({e})") from None


def preset_dir() -> Path:
    return Path(str(resources.files("slidedp") / "presets" / "models"))


def model_presets() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.json"))


def load_model(name_or_path: str) -> ModelSpec:
    """A preset name (see `model_presets()`), a config.json file, or a directory holding one."""
    p = Path(name_or_path)
    if p.is_dir():
        f = p / "config.json"
        if not f.is_file():
            raise SpecError(str(p), "config.json", "a directory holding a Hugging Face config.json")
        return dataclasses.replace(parse_hf_config(_read_json(f), str(f)), name=p.resolve().name)
    if p.suffix == ".json" or p.exists():
        name = p.resolve().parent.name if p.name == "config.json" else p.stem
        return dataclasses.replace(parse_hf_config(_read_json(p), str(p)), name=name)
    preset = preset_dir() / f"{name_or_path}.json"
    if not preset.is_file():
        raise SpecError(
            "--model",
            "name",
            f"a preset ({', '.join(model_presets())}), a config.json file or a directory holding "
            f"one, got {name_or_path!r}",
        )
    spec = parse_hf_config(_read_json(preset), f"preset {name_or_path} ({preset})")
    return dataclasses.replace(spec, name=name_or_path, source=name_or_path)
