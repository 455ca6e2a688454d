"""Runs one streaming unit at a time on parameters that live in flat slots.

One transformers model is built on the meta device (nothing allocated) for its modules' code:
a decoder layer, the final norm and the rotary embedding. A decoder layer's parameters are views
of a flat slot (layout.UnitLayout.views) handed in with torch.func.functional_call, so the same
module object computes every layer and nothing is allocated per layer or per step besides
activations (and packed rows' masks, below). The rotary embedding is rebuilt for real on the
device (a few kB) and evaluated once per step into an `Attention` (what a layer's attention needs besides its input):
    unpacked   positions 0..seq-1 shared by every row and micro-batch, no mask: SDPA with
               is_causal (a row's padding, if any, follows its tokens: no padding mask)
    packed     rows that hold several documents (exec/packing.py): position ids that restart at 0
               where a document starts, so RoPE sees each document from position 0, and an
               additive block-diagonal causal mask (0 where a query may attend a key: same
               document, not later; -inf elsewhere) in the compute dtype, one per micro-batch,
               (micro_batch, 1, seq, seq). A packed row then computes what its documents compute
               one by one. The mask is built in the compute dtype, not as booleans, because SDPA
               turns a boolean mask into a new additive tensor on every call, which autograd
               would save per layer; this one is saved by reference, once per step.
`kernels` (plan.kernels) picks the layers' and the head's kernels (exec/fused_kernels.py: eager, or
liger-kernel's on CUDA); `head_loss` is HEAD_LOSS's linear + cross-entropy for them.

Supported: transformers' Qwen3, Qwen2, Llama and Mistral decoder models without sliding-window
layers; anything else is a SpecError.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.func import functional_call

from slidedp.exec import fused_kernels
from slidedp.exec.layout import UnitLayout, model_layout
from slidedp.spec.errors import SpecError

SUPPORTED_FAMILIES = ("qwen3", "qwen2", "llama", "mistral")


def hf_config(config):
    """A transformers PretrainedConfig from a config.json mapping (a dict, or a preset ModelSpec's
    read-only config) or the config itself, validated."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(config, Mapping):
        config = copy.deepcopy(dict(config))  # transformers may rewrite nested dicts in place
        family = config.get("model_type")
        if family not in SUPPORTED_FAMILIES:
            raise SpecError(
                "model config",
                "model_type",
                f"one of {', '.join(SUPPORTED_FAMILIES)} for the executor, got {family!r}",
            )
        config = AutoConfig.for_model(**config)
    elif not isinstance(config, PretrainedConfig):
        raise SpecError("model config", "<root>", "a config.json mapping or a PretrainedConfig")
    if config.model_type not in SUPPORTED_FAMILIES:
        raise SpecError(
            "model config",
            "model_type",
            f"one of {', '.join(SUPPORTED_FAMILIES)} for the executor, got {config.model_type!r}",
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise SpecError(
            "model config",
            "layer_types",
            "full attention in every layer (sliding-window layers are not supported)",
        )
    config._attn_implementation = "sdpa"
    return config


@dataclass(frozen=True)
class Attention:
    """What a decoder layer's attention needs besides its input, for one micro-batch: the RoPE
    tables (cos, sin), (1 or rows, seq, head_dim), and the additive mask, None for causal."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | None = None

    def of(self, b: int) -> Attention:
        """Micro-batch b's: this one, shared by every micro-batch."""
        return self

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.cos, self.sin) if self.mask is None else (self.cos, self.sin, self.mask)


@dataclass(frozen=True)
class PerMicroBatch:
    """A step's Attention for packed rows: one per micro-batch."""

    parts: tuple[Attention, ...]

    def of(self, b: int) -> Attention:
        return self.parts[b]


def document_mask(position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive block-diagonal causal mask (rows, 1, seq, seq) of rows whose documents start
    where position_ids is 0: 0 where key j <= query i lies in i's document, -inf elsewhere."""
    doc = torch.cumsum(position_ids == 0, dim=1)
    seq = position_ids.shape[1]
    causal = torch.ones(seq, seq, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (doc[:, :, None] == doc[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    return mask.masked_fill_(~allowed, float("-inf"))[:, None]


class ModelRunner:
    """The model's code, driven with parameters from flat slots; all methods run on `device`.

    `packed`: the steps' rows hold several documents (an explicit mask in every layer, see the
    module docstring); rope() then gives the explicit mask too, so that what a layer saves for
    its backward, which depends on SDPA's kernel, is the same in a layout forward as in a step."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype, kernels: str = "auto",
                 packed: bool = False):
        from transformers import AutoModelForCausalLM

        self.config = hf_config(config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(self.config)
        self.kernels, self.kernels_why = fused_kernels.apply(model, kernels, torch.device(device))
        self.head_loss = fused_kernels.head_loss(self.kernels)  # HEAD_LOSS: loss.py's contract
        self.layouts: list[UnitLayout] = model_layout(model)
        self.n_layers = len(self.layouts) - 2
        self.tied = all(e.name != "lm_head.weight" for e in self.layouts[-1].entries)
        self.layer = model.model.layers[0]
        self.norm = model.model.norm
        self.padding_idx = model.model.embed_tokens.padding_idx
        self.vocab, self.hidden = self.layouts[0].entries[0].shape
        self.rotary = type(model.model.rotary_emb)(config=self.config).to(device)
        self.device, self.dtype, self.packed = device, dtype, packed

    def rope(self, seq_len: int, position_ids: Sequence[torch.Tensor] | None = None
             ) -> Attention | PerMicroBatch:
        """The step's attention inputs, once per step. Without position_ids: positions
        0..seq_len-1 for every row (one document a row; with `packed`, as an explicit mask of
        one row). With them (packed engines only): per micro-batch, from its (rows, seq_len)
        position ids on the device."""
        if position_ids is not None:
            if not self.packed:
                raise ValueError("position_ids need a runner built with packed=True")
            return PerMicroBatch(tuple(self._attention(p) for p in position_ids))
        pos = torch.arange(seq_len, device=self.device)[None]
        if self.packed:
            return self._attention(pos)
        return Attention(*self.rotary(torch.empty(0, device=self.device, dtype=self.dtype), pos))

    def _attention(self, position_ids: torch.Tensor) -> Attention:
        if position_ids.dim() != 2:
            raise ValueError(f"position_ids must be (rows, seq), got {tuple(position_ids.shape)}")
        cos, sin = self.rotary(torch.empty(0, device=self.device, dtype=self.dtype), position_ids)
        return Attention(cos, sin, document_mask(position_ids, self.dtype))

    def layer_forward(self, params: dict[str, torch.Tensor], x: torch.Tensor,
                      attn: Attention) -> torch.Tensor:
        out = functional_call(self.layer, params, (x,), {
            "position_embeddings": (attn.cos, attn.sin), "attention_mask": attn.mask})
        return out[0] if isinstance(out, tuple) else out

    def norm_forward(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.norm, {"weight": weight}, (x,))
