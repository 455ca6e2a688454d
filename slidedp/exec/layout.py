"""Flat unit layout: which Hugging Face parameter lives where in each streaming unit's flat vector.

Units follow the task graph: 0 = embedding (`model.embed_tokens.weight`), 1..L = decoder layer
l-1 (its parameters in `named_parameters()` order), L+1 = final norm (+ `lm_head.weight` when not
tied). A unit's FP32 master, Adam moments, BF16 GPU slot and gradient buffer are flat vectors with
this layout, so a chunk [lo, hi) of a unit means the same elements everywhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Entry:
    name: str  # HF state-dict name
    local: str  # name inside the unit's module (e.g. "self_attn.q_proj.weight")
    shape: tuple[int, ...]
    offset: int
    numel: int


@dataclass(frozen=True)
class UnitLayout:
    unit: int
    entries: tuple[Entry, ...]

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Module-local name -> view of `flat` with the parameter's shape (no copy)."""
        return {e.local: flat[e.offset:e.offset + e.numel].view(e.shape) for e in self.entries}


def _unit(u: int, named: list[tuple[str, str, torch.Size]]) -> UnitLayout:
    entries, off = [], 0
    for full, local, shape in named:
        n = 1
        for s in shape:
            n *= s
        entries.append(Entry(full, local, tuple(shape), off, n))
        off += n
    return UnitLayout(u, tuple(entries))


def model_layout(model: torch.nn.Module) -> list[UnitLayout]:
    """The unit layouts of a transformers *ForCausalLM (works on the meta device)."""
    base = model.model
    units = [_unit(0, [("model.embed_tokens.weight", "weight", base.embed_tokens.weight.shape)])]
    for i, layer in enumerate(base.layers):
        units.append(_unit(i + 1, [(f"model.layers.{i}.{n}", n, p.shape)
                                   for n, p in layer.named_parameters()]))
    head = [("model.norm.weight", "norm.weight", base.norm.weight.shape)]
    tied = model.lm_head.weight is base.embed_tokens.weight or getattr(
        model.config, "tie_word_embeddings", False)
    if not tied:
        head.append(("lm_head.weight", "lm_head.weight", model.lm_head.weight.shape))
    units.append(_unit(len(units), head))
    return units
