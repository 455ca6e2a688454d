"""One decoder layer computed segment by segment (slidedp.spec.segments), with the HF layer's code.

The executor's policies other than "layer" cut a decoder layer at the boundaries segments.py
defines. This module computes the layer as a chain of PIECES, each calling the HF layer's own
submodules (norms, projections, its family's apply_rotary_pos_emb, SiLU) on parameters that are
views of a flat slot (torch.func.functional_call, as ModelRunner does; an nn.Linear's forward,
F.linear, is called directly: functional_call costs ~15 us of host time a call), so a piece's
forward and backward are the operations of the HF layer's forward, in the same order:

    piece            segment  inputs        outputs        computes
    input_norm       0        x             xn             input_layernorm(x)
    qkv_proj         1        xn            q_pre k_pre v  q/k/v projections (+ biases), v as
                                                           (batch, kv heads, seq, head_dim)
    qk_norm_rope     1        q_pre k_pre   q k            q_norm/k_norm (qwen3), RoPE
    attention        2        q k v         o              SDPA, causal (or the packed rows' mask),
                                                           as transformers' sdpa integration
                                                           calls it (GQA or repeat_kv)
    o_copy           3        o             o_flat         o.transpose(1, 2).contiguous(): the
                                                           o_proj input copy
    o_proj_residual  3        x o_flat      h1             x + o_proj(o_flat)
    post_norm        4        h1            h1n            post_attention_layernorm(h1)
    gate_up          5        h1n           g u            gate_proj, up_proj
    act_mul          6        g u           a              SiLU(g) * u
    down_residual    7        h1 a          out            h1 + down_proj(a)

Pieces refine segments 1 and 3 so that selective checkpointing's cut points (the outputs of the
matmuls and of attention) fall between pieces. Boundary i of segments.py is BOUNDARY_VALUES[i].
Every piece gets the micro-batch's layer_runner.Attention (RoPE tables, mask); only qk_norm_rope
and attention read it.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.func import functional_call

from slidedp.exec.layer_runner import Attention
from slidedp.spec.errors import SpecError


@dataclass(frozen=True)
class Piece:
    name: str
    segment: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    modules: tuple[str, ...]  # the layer's submodules whose parameters it reads


PIECES = (
    Piece("input_norm", 0, ("x",), ("xn",), ("input_layernorm",)),
    Piece("qkv_proj", 1, ("xn",), ("q_pre", "k_pre", "v"),
          ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    Piece("qk_norm_rope", 1, ("q_pre", "k_pre"), ("q", "k"), ("self_attn.q_norm", "self_attn.k_norm")),
    Piece("attention", 2, ("q", "k", "v"), ("o",), ()),
    Piece("o_copy", 3, ("o",), ("o_flat",), ()),
    Piece("o_proj_residual", 3, ("x", "o_flat"), ("h1",), ("self_attn.o_proj",)),
    Piece("post_norm", 4, ("h1",), ("h1n",), ("post_attention_layernorm",)),
    Piece("gate_up", 5, ("h1n",), ("g", "u"), ("mlp.gate_proj", "mlp.up_proj")),
    Piece("act_mul", 6, ("g", "u"), ("a",), ()),
    Piece("down_residual", 7, ("h1", "a"), ("out",), ("mlp.down_proj",)),
)
BOUNDARY_VALUES = (("xn",), ("q", "k", "v"), ("o",), ("h1",), ("h1n",), ("g", "u"), ("a",))


class SegmentLayer:
    """The pieces of the HF decoder layer `layer` (a module, typically on the meta device)."""

    def __init__(self, layer: torch.nn.Module, param_names: list[str]):
        self.layer = layer
        attn = layer.self_attn
        self.attn = attn
        self.head_dim = attn.head_dim
        self.rope_fn = sys.modules[type(attn).__module__].apply_rotary_pos_emb
        self.qk_norm = hasattr(attn, "q_norm")
        # per piece, per submodule: (submodule, [(its local name, the layer's name)])
        self.subs: dict[str, dict[str, tuple[torch.nn.Module, list[tuple[str, str]]]]] = {}
        seen: set[str] = set()
        for p in PIECES:
            self.subs[p.name] = {}
            for mod in p.modules:
                names = [(n[len(mod) + 1:], n) for n in param_names if n.startswith(mod + ".")]
                if names:
                    self.subs[p.name][mod] = (layer.get_submodule(mod), names)
                    seen.update(n for _, n in names)
        if unknown := sorted(set(param_names) - seen):
            raise SpecError("model config", "architecture", "a decoder layer of norms, q/k/v/o "
                            f"projections and a gated MLP; parameters {unknown} belong to no segment")
        self._run = {"input_norm": self._input_norm, "qkv_proj": self._qkv_proj,
                     "qk_norm_rope": self._qk_norm_rope, "attention": self._attention,
                     "o_copy": self._o_copy, "o_proj_residual": self._o_proj_residual,
                     "post_norm": self._post_norm, "gate_up": self._gate_up,
                     "act_mul": self._act_mul, "down_residual": self._down_residual}

    def run(self, piece: Piece, params: dict[str, torch.Tensor], inputs: list[torch.Tensor],
            attn: Attention) -> tuple[torch.Tensor, ...]:
        """The piece's outputs from its inputs (params: the layer's, by its module-local names)."""
        return self._run[piece.name](params, attn, *inputs)

    def forward(self, params, x, attn: Attention) -> torch.Tensor:
        """The whole layer, piece after piece (what ModelRunner.layer_forward computes)."""
        values = {"x": x}
        for p in PIECES:
            values.update(zip(p.outputs, self.run(p, params, [values[n] for n in p.inputs], attn),
                              strict=True))
        return values["out"]

    def _call(self, piece: str, mod: str, params, x):
        sub, names = self.subs[piece][mod]
        local = {loc: params[n] for loc, n in names}
        if type(sub) is torch.nn.Linear:  # nn.Linear.forward, without functional_call's ~15 us
            return F.linear(x, local["weight"], local.get("bias"))
        return functional_call(sub, local, (x,))

    def _input_norm(self, params, attn, x):
        return (self._call("input_norm", "input_layernorm", params, x),)

    def _qkv_proj(self, params, attn, xn):
        shape = (*xn.shape[:-1], -1, self.head_dim)
        q = self._call("qkv_proj", "self_attn.q_proj", params, xn).view(shape)
        k = self._call("qkv_proj", "self_attn.k_proj", params, xn).view(shape)
        v = self._call("qkv_proj", "self_attn.v_proj", params, xn).view(shape).transpose(1, 2)
        return q, k, v

    def _qk_norm_rope(self, params, attn, q, k):
        if self.qk_norm:
            q = self._call("qk_norm_rope", "self_attn.q_norm", params, q)
            k = self._call("qk_norm_rope", "self_attn.k_norm", params, k)
        return self.rope_fn(q.transpose(1, 2), k.transpose(1, 2), attn.cos, attn.sin)

    def _attention(self, params, attn, q, k, v):
        from transformers.integrations.sdpa_attention import repeat_kv, use_gqa_in_sdpa

        kw = {}
        groups = self.attn.num_key_value_groups
        if groups > 1:
            if use_gqa_in_sdpa(attn.mask, k, v):
                kw["enable_gqa"] = True
            else:
                k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn.mask, dropout_p=0.0, scale=self.attn.scaling,
            is_causal=q.shape[2] > 1 and attn.mask is None, **kw)
        return (o,)

    def _o_copy(self, params, attn, o):
        return (o.transpose(1, 2).contiguous().reshape(*o.shape[:1], o.shape[2], -1),)

    def _o_proj_residual(self, params, attn, x, o_flat):
        return (x + self._call("o_proj_residual", "self_attn.o_proj", params, o_flat),)

    def _post_norm(self, params, attn, h1):
        return (self._call("post_norm", "post_attention_layernorm", params, h1),)

    def _gate_up(self, params, attn, h1n):
        return (self._call("gate_up", "mlp.gate_proj", params, h1n),
                self._call("gate_up", "mlp.up_proj", params, h1n))

    def _act_mul(self, params, attn, g, u):
        return (self.layer.mlp.act_fn(g) * u,)

    def _down_residual(self, params, attn, h1, a):
        return (h1 + self._call("down_residual", "mlp.down_proj", params, a),)
