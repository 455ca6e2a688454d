"""Route and chunk stages of AutoPolicy (method.md section 7, steps 1-2), simulator-first.

candidates()  param route x grad route x chunk size (H2D = D2H) x update sharding; with one GPU
              only the single-GPU routes (replicated, gpu, rank0) exist.
rank()        drop candidates that do not fit GPU or host memory (model/memory.py), pre-filter
              with the analytic model (slidedp.model.predict, ~0.03 s each), simulate the best
              `simulate_top` (~0.2 s each for Qwen3-8B) and order them by simulated step time.
              `probe` is the hook for method.md's "confirm with short real probes": a callable
              Plan -> measured seconds per step; when given, the `probe_top` best simulated
              candidates are re-ordered by it. Without it nothing is measured, and the report
              says so.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from slidedp.model.predict import predict
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import GradRoute, ParamRoute, Plan, UpdateSharding
from slidedp.spec.workload import Workload

CHUNK_MIB = (16.0, 64.0, 256.0)
Probe = Callable[[Plan], float]


@dataclass(frozen=True)
class Scored:
    plan: Plan
    analytic_s: float
    simulated_s: float | None = None
    measured_s: float | None = None

    @property
    def best_s(self) -> float:
        """The most trusted step time we have: measured, else simulated, else analytic."""
        if self.measured_s is not None:
            return self.measured_s
        return self.simulated_s if self.simulated_s is not None else self.analytic_s


def candidates(base: Plan, gpus: int) -> list[Plan]:
    """Every route x chunk combination the topology can run, on top of `base`."""
    multi = gpus > 1
    params = list(ParamRoute) if multi else [ParamRoute.REPLICATED]
    grads = list(GradRoute) if multi else [GradRoute.GPU]
    updates = list(UpdateSharding) if multi else [UpdateSharding.RANK0]
    return [
        replace(
            base, param_route=p, grad_route=g, update_sharding=u, h2d_chunk_mib=c, d2h_chunk_mib=c
        )
        for p, g, u, c in itertools.product(params, grads, updates, CHUNK_MIB)
    ]


def rank(
    hw: HardwareSpec,
    wl: Workload,
    plans: list[Plan],
    simulate_top: int = 8,
    probe: Probe | None = None,
    probe_top: int = 2,
) -> list[Scored]:
    """Feasible candidates, best first (module docstring)."""
    scored = []
    for p in plans:
        try:
            analytic_s = predict(hw, wl, p).step_time_s  # predict checks the fit first
        except InfeasiblePlan:
            continue
        scored.append(Scored(p, analytic_s))
    scored.sort(key=lambda s: s.analytic_s)
    top = [
        replace(s, simulated_s=simulate(hw, wl, s.plan, check_memory=False).step_time_s)
        for s in scored[:simulate_top]
    ]
    top.sort(key=lambda s: s.simulated_s)
    if probe is not None:
        top[:probe_top] = sorted(
            (replace(s, measured_s=probe(s.plan)) for s in top[:probe_top]),
            key=lambda s: s.measured_s,
        )
    return top + scored[simulate_top:]
