"""CPU AdamW on one chunk of a unit, bit-for-bit what torch.optim.AdamW(fused=True) computes.

The update of a chunk [lo, hi) of unit u at optimizer step t (t counts this unit's updates, from 1):
    p <- p (1 - lr wd)                                   (decoupled weight decay)
    m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2
    p <- p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
torch's fused CPU kernel (`torch._fused_adamw_`) is applied to the chunk views directly: no copy
of the parameters, and the result equals torch.optim.AdamW(fused=True) exactly (tests check it,
and check the default for-loop implementation within rounding). Weight decay applies to every
parameter, as torch.optim.AdamW(model.parameters()) does.

A gradient in a narrower dtype (BF16, downloaded as is: plan.grad_widen = host) is widened to FP32
WIDEN_BLOCK elements at a time into a per-thread scratch buffer, and each block updated there: the
block stays in the cores' caches between the widening and the update, so host memory sees the 2 B
read instead of a 4 B FP32 gradient (and no widening pass of its own). Widening is exact, so the
result equals the update of the FP32 gradient bit for bit. torch's fused kernel wants every
tensor in one dtype, hence the blocks. Clipping multiplies the FP32 gradient by its coefficient
before the update, as clip_grad_norm_ does (in place for an FP32 gradient, in the scratch for a
narrower one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from slidedp.spec.errors import SpecError


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.01
    grad_clip: float | None = None  # max global L2 norm, as clip_grad_norm_ (features/deferred_update.py: exact)
    # skip a step's whole update where its global gradient norm is NaN or Inf (the state stays
    # untouched: features/deferred_update.py)
    skip_nonfinite: bool = False

    def __post_init__(self):
        if self.lr < 0 or self.eps < 0 or self.weight_decay < 0:
            raise SpecError("optimizer", "lr/eps/weight_decay", "non-negative numbers")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise SpecError("optimizer", "grad_clip", f"a positive number or None, got {self.grad_clip}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise SpecError("optimizer", "betas", f"two numbers in [0, 1), got {self.betas}")


WIDEN_BLOCK = 1 << 22  # elements widened and updated at a time (16 MiB FP32): 4-6% faster than
# 1 << 20 on nvidia-h200-x2 at 12 and 24 threads (benchmarks/probes/widen_block_probe.py)
ALIGN = 64  # elements: a multiple of every vector width of torch's CPU kernels
_scratch = threading.local()  # per update thread: its FP32 block, allocated once


def adamw_chunk(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamWConfig,
    lr: float,
    clip: float = 1.0,
) -> None:
    """Update FP32 `param`, `exp_avg`, `exp_avg_sq` in place from `grad` (same shape; FP32, or
    narrower and widened block by block: module docstring), times `clip` when below 1.

    `step` is the unit's step count including this update (1 for the first update).
    """
    if grad.dtype == torch.float32:
        if clip < 1.0:
            grad.mul_(clip)
        _fused(param, grad, exp_avg, exp_avg_sq, step, cfg, lr)
        return
    block = getattr(_scratch, "block", None)
    if block is None:
        block = _scratch.block = torch.empty(WIDEN_BLOCK, dtype=torch.float32)
    for lo in range(0, len(grad), WIDEN_BLOCK):
        hi = min(len(grad), lo + WIDEN_BLOCK)
        wide = block[:hi - lo]
        wide.copy_(grad[lo:hi])
        if clip < 1.0:
            wide.mul_(clip)
        _fused(param[lo:hi], wide, exp_avg[lo:hi], exp_avg_sq[lo:hi], step, cfg, lr)


def adamw_chunk_into(
    out: torch.Tensor,
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
    cfg: AdamWConfig,
    lr: float,
    clip: float,
    lo: int,
) -> None:
    """Elements [lo, lo + len(out)) of the parameters adamw_chunk(param, grad, ...) would
    leave in `param`, written into `out` (its dtype: the BF16 upload chunk), with `param`,
    `grad` and the moments untouched. Bit for bit adamw_chunk's: torch's fused kernel computes
    an element alike wherever it sits, except in the scalar tail of the range it is called on
    (the last elements past a multiple of the vector width), so each range here starts at a
    multiple of ALIGN from the start of one of adamw_chunk's ranges (its WIDEN_BLOCK blocks, a
    multiple of ALIGN long) and ends where that range ends. The range is copied into per-thread
    FP32 blocks and updated there."""
    blocks = getattr(_scratch, "state", None)
    if blocks is None:
        blocks = _scratch.state = torch.empty(4, WIDEN_BLOCK, dtype=torch.float32)
    hi = lo + len(out)
    for b0 in range(lo // WIDEN_BLOCK * WIDEN_BLOCK, hi, WIDEN_BLOCK):
        a = b0 + (max(lo, b0) - b0) // ALIGN * ALIGN
        z = min(len(param), b0 + WIDEN_BLOCK)
        p, g, m, v = (b[:z - a].copy_(x[a:z])
                      for b, x in zip(blocks, (param, grad, exp_avg, exp_avg_sq), strict=True))
        if clip < 1.0:
            g.mul_(clip)
        _fused(p, g, m, v, step, cfg, lr)
        w0, w1 = max(lo, a), min(hi, z)
        out[w0 - lo:w1 - lo].copy_(p[w0 - a:w1 - a])


def _fused(param, grad, exp_avg, exp_avg_sq, step: int, cfg: AdamWConfig, lr: float) -> None:
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
