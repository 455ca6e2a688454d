"""CPU AdamW on one chunk of a unit, bit-for-bit what torch.optim.AdamW(fused=True) computes.

The update of a chunk [lo, hi) of unit u at optimizer step t (t counts this unit's updates, from 1):
    p <- p (1 - lr wd)                                   (decoupled weight decay)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
torch's fused CPU kernel (`torch._fused_adamw_`) is applied to the chunk views directly: no copy
of the parameters, and the result equals torch.optim.AdamW(fused=True) exactly (tests check it,
and check the default for-loop implementation within rounding). Weight decay applies to every
parameter, as torch.optim.AdamW(model.parameters()) does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from slidedp.spec.errors import SpecError


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = None  # max global L2 norm, as clip_grad_norm_ (engine.py: exact)

    def __post_init__(self):
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise SpecError("optimizer", "lr/eps/weight_decay", "non-negative numbers")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise SpecError("optimizer", "grad_clip", f"a positive number or None, got {self.grad_clip}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise SpecError("optimizer", "betas", f"two numbers in [0, 1), got {self.betas}")


def adamw_chunk(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamWConfig,
    lr: float,
) -> None:
    """Update FP32 `param`, `exp_avg`, `exp_avg_sq` in place from FP32 `grad` (same shape).

    `step` is the unit's step count including this update (1 for the first update).
    """
    steps = [torch.tensor(float(step))]
    torch._fused_adamw_(
        [param],
        [grad],
        [exp_avg],
        [exp_avg_sq],
        [],
        steps,
        lr=lr,
        beta1=cfg.betas[0],
        beta2=cfg.betas[1],
        weight_decay=cfg.weight_decay,
        eps=cfg.eps,
        amsgrad=False,
        maximize=False,
    )
