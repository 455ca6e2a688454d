"""Non-finite values (NaN, Inf) in training: found at the step that made them, never saved.

  every step   the loss and the gradient norm (exact, global: the engine) are checked. A
               non-finite one stops the run (RunError, one line: the step and which value), the
               newest checkpoint untouched; or, with --skip-nonfinite N, the engine has skipped
               the step's whole update (features/deferred_update.py: its first ADAMs see the norm
               before any parameter changes) and up to N such steps are passed over.
  every write  a checkpoint's state and the final export are checked unit by unit before they
               are written (all_finite): a non-finite state is never saved, and since the check
               fails before the new checkpoint is complete, older ones are never pruned for it.
"""

from __future__ import annotations

import math

import torch

from slidedp.exec.outcome import RunError

CHECK_CHUNK_ELEMS = 1 << 24  # elements checked at a time (bounds the temporary bool mask)


class NonFinite(RunError):
    """A NaN or Inf where the run needs finite values; the message says where."""


def nonfinite_terms(loss: float, grad_norm: float) -> list[str]:
    """['the loss is nan', 'the gradient norm is inf', ...] for the step's non-finite values."""
    return [f"the {name} is {v}" for name, v in (("loss", loss), ("gradient norm", grad_norm))
            if not math.isfinite(v)]


def all_finite(t: torch.Tensor) -> bool:
    """Whether every element of flat tensor `t` is finite (checked a chunk at a time)."""
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(flat[lo:lo + CHECK_CHUNK_ELEMS]).all())
               for lo in range(0, flat.numel(), CHECK_CHUNK_ELEMS))


def check_finite(t: torch.Tensor, what: str) -> None:
    """NonFinite naming `what` unless every element of `t` is finite."""
    if not all_finite(t):
        raise NonFinite(f"{what} holds NaN or Inf: not written")
