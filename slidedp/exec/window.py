"""The GPU window: parameter slots and gradient buffers, reserved once, reused every layer and step.

Slots (flat, compute dtype), indexed as the task graph's H2D `buffer`:
    0 .. W-1   decoder layers (layer l computes in slot (l-1) mod W), each the largest layer
    W          the embedding (resident: its own slot)
    W+1        final norm + LM head
Gradient buffers, indexed as the graph's BWD `buffer`:
    0 .. G-1   decoder layers (layer l writes buffer l mod G), each the largest layer
    G          the embedding (with tied embeddings the head's weight gradient lands here too)
    G+1        final norm + LM head
A unit's parameters are views of its slot with the unit's layout; nothing here is allocated after
construction. Without `embedding_grad` (an untied embedding whose update is split,
plan.embedding_rows: its gradient lives in exec/features/embedding_rows.py's compact buffer) the
embedding's gradient buffer is empty.
"""

from __future__ import annotations

import torch

from slidedp.exec.layout import UnitLayout


class Window:
    def __init__(
        self,
        layouts: list[UnitLayout],
        window_slots: int,
        grad_buffers: int,
        device: torch.device,
        dtype: torch.dtype,
        embedding_grad: bool = True,
    ):
        numels = [lay.numel for lay in layouts]
        layer = max(numels[1:-1])
        self.layouts, self.W, self.G = layouts, window_slots, grad_buffers
        self.n_layers = len(layouts) - 2
        sizes = [layer] * window_slots + [numels[0], numels[-1]]
        self.slots = [torch.empty(n, device=device, dtype=dtype) for n in sizes]
        gsizes = [layer] * grad_buffers + [numels[0] if embedding_grad else 0, numels[-1]]
        self.grads = [torch.empty(n, device=device, dtype=dtype) for n in gsizes]

    def slot_index(self, unit: int) -> int:
        if unit == 0:
            return self.W
        return self.W + 1 if unit == self.n_layers + 1 else (unit - 1) % self.W

    def grad_index(self, unit: int) -> int:
        if unit == 0:
            return self.G
        return self.G + 1 if unit == self.n_layers + 1 else unit % self.G

    def slot(self, unit: int) -> torch.Tensor:
        """The flat slot unit `unit` is uploaded to (only its first numel elements are used)."""
        return self.slots[self.slot_index(unit)][: self.layouts[unit].numel]

    def grad(self, unit: int) -> torch.Tensor:
        return self.grads[self.grad_index(unit)][: self.layouts[unit].numel]

    def params(self, unit: int) -> dict[str, torch.Tensor]:
        return self.layouts[unit].views(self.slot(unit))

    def grad_views(self, unit: int) -> dict[str, torch.Tensor]:
        return self.layouts[unit].views(self.grad(unit))
