"""Runs one streaming unit at a time on parameters that live in flat slots.

One transformers model is built on the meta device (nothing allocated) for its modules' code:
a decoder layer, the final norm and the rotary embedding. A decoder layer's parameters are views
of a flat slot (layout.UnitLayout.views) handed in with torch.func.functional_call, so the same
module object computes every layer and nothing is allocated per layer or per step besides
activations. The rotary embedding is rebuilt for real on the device (a few kB) and evaluated once
per step; attention is SDPA with is_causal (packed full-length sequences: no padding mask).
`kernels` (plan.kernels) picks the layers' and the head's kernels (exec/kernels.py: eager, or
liger-kernel's on CUDA); `head_loss` is HEAD_LOSS's linear + cross-entropy for them.

Supported: transformers' Qwen3, Qwen2, Llama and Mistral decoder models without sliding-window
layers; anything else is a SpecError.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import torch
from torch.func import functional_call

from slidedp.exec import kernels as fused_kernels
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


class ModelRunner:
    """The model's code, driven with parameters from flat slots; all methods run on `device`."""

    def __init__(self, config, device: torch.device, dtype: torch.dtype, kernels: str = "auto"):
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
        self.device, self.dtype = device, dtype

    def rope(self, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) for positions 0..seq_len-1, shape (1, seq_len, head_dim): once per step."""
        pos = torch.arange(seq_len, device=self.device)[None]
        return self.rotary(torch.empty(0, device=self.device, dtype=self.dtype), pos)

    def layer_forward(
        self,
        params: dict[str, torch.Tensor],
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        out = functional_call(
            self.layer, params, (x,), {"position_embeddings": rope, "attention_mask": None}
        )
        return out[0] if isinstance(out, tuple) else out

    def norm_forward(self, weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return functional_call(self.norm, {"weight": weight}, (x,))
