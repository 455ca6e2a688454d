"""Unit weights without a checkpoint: random init per unit (as transformers initializes), and the
flattening of an instantiated HF model into units (tests compare against real HF models).

Random init follows transformers' `PreTrainedModel._init_weights` for the supported families:
Linear / Embedding / MoE expert and router weights ~ normal(0, initializer_range), biases 0,
RMSNorm weights 1, the embedding's padding_idx row (pad_token_id) 0. Each unit draws from its own
generator seeded by (seed, unit), so unit u's init is reproducible on its own without building
the model or drawing the other units first. (Same distribution as transformers, not the same
numbers: transformers draws from the global RNG in module order.)
"""

from __future__ import annotations

import numpy as np
import torch

from slidedp.exec.layout import UnitLayout, model_layout


def _rule(model: torch.nn.Module, name: str) -> str:
    """'normal', 'ones' or 'zeros' for the parameter `name` (decided by its module, as HF does)."""
    mod_name, _, pname = name.rpartition(".")
    mod = model.get_submodule(mod_name)
    if "Norm" in type(mod).__name__:
        return "ones" if pname == "weight" else "zeros"
    return "zeros" if pname == "bias" else "normal"


def unit_seed(seed: int, unit: int) -> int:
    """A 63-bit seed for unit `unit`, independent across units (numpy SeedSequence mixing)."""
    return int(np.random.SeedSequence((seed, unit)).generate_state(1, np.uint64)[0]) >> 1


class RandomInit:
    """Per-unit random init for a model built on the meta device (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, layout: list[UnitLayout], seed: int):
        self.layout, self.seed = layout, seed
        self.std = float(getattr(model.config, "initializer_range", None) or 0.02)
        self.pad_row = model.model.embed_tokens.padding_idx
        self.rules = {e.name: _rule(model, e.name) for ul in layout for e in ul.entries}

    def unit(self, u: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Unit u's flat FP32 init, written into `out` when given."""
        ul = self.layout[u]
        flat = torch.empty(ul.numel, dtype=torch.float32) if out is None else out
        g = torch.Generator().manual_seed(unit_seed(self.seed, u))
        for e in ul.entries:
            view = flat[e.offset : e.offset + e.numel]
            rule = self.rules[e.name]
            if rule == "normal":
                view.normal_(0.0, self.std, generator=g)
            else:
                view.fill_(1.0 if rule == "ones" else 0.0)
        if u == 0 and self.pad_row is not None:
            ul.views(flat)["weight"][self.pad_row].zero_()
        return flat


def init_from_hf_model(model: torch.nn.Module) -> list[torch.Tensor]:
    """Flat FP32 unit vectors (layout.model_layout order) holding a real HF model's parameters."""
    params = dict(model.named_parameters())
    units = []
    for ul in model_layout(model):
        flat = torch.empty(ul.numel, dtype=torch.float32)
        for e in ul.entries:
            flat[e.offset : e.offset + e.numel].copy_(params[e.name].detach().reshape(-1))
        units.append(flat)
    return units
