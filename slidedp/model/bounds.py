"""Resource lower bound: T_step >= max_j W_j / beta_j over the work of one iteration.

W_j sums every task's draw on resource j (costs.resource_use) in one iteration; beta_j is the
resource's capacity per second. The bottleneck is the argmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slidedp.graph.costs import ResourceUse
from slidedp.graph.tasks import TaskGraph


@dataclass(frozen=True)
class ResourceBound:
    busy_s: dict[str, float]  # W_j / beta_j per resource, one iteration
    bottleneck: str

    @property
    def lower_bound_s(self) -> float:
        return self.busy_s[self.bottleneck]


def resource_bound(g: TaskGraph, use: ResourceUse, iteration: int) -> ResourceBound:
    """Per-resource busy seconds of one iteration and the largest of them."""
    in_it = g.iteration == iteration
    counts = np.diff(use.ptr)
    task_of_draw = np.repeat(np.arange(g.n_tasks), counts)
    mask = in_it[task_of_draw]
    work = np.bincount(use.res[mask], weights=use.amount[mask], minlength=len(use.names))
    busy = work / use.capacity
    b = {n: float(x) for n, x in zip(use.names, busy, strict=True)}
    return ResourceBound(b, max(b, key=b.get))
