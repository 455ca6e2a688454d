"""Learning-rate schedules: constant or cosine, both after a linear warmup.

For the optimizer step with 0-based index i (i steps done before it) out of S steps, warmup W
steps and base rate lr:
    warmup     i < W:   lr * (i + 1) / W          (the first step already moves: never 0)
    constant   i >= W:  lr
    cosine     i >= W:  lr * (1 + cos(pi * (i - W) / (S - W))) / 2
The cosine starts at lr right after warmup and decays towards 0 without reaching it: its last
step (i = S - 1) still has a positive rate. The rate depends only on (i, S, W), so a resumed run
gets the same rates as an uninterrupted one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slidedp.spec.errors import SpecError

SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    kind: str
    base_lr: float
    warmup_steps: int
    total_steps: int

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise SpecError("lr schedule", "lr_schedule", f"one of {', '.join(SCHEDULES)}, got {self.kind!r}")
        if self.warmup_steps < 0:
            raise SpecError("lr schedule", "warmup_steps", f"an integer >= 0, got {self.warmup_steps}")

    def lr(self, i: int) -> float:
        """The rate of the step with 0-based index `i`."""
        w = self.warmup_steps
        if i < w:
            return self.base_lr * (i + 1) / w
        if self.kind == "constant":
            return self.base_lr
        return self.base_lr * (1 + math.cos(math.pi * (i - w) / (self.total_steps - w))) / 2
