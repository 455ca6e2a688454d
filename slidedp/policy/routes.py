"""Route, chunk and window stages of AutoPolicy (method.md section 7, steps 1-2), simulator-first.

window_candidates()  GPU slots for decoder layers worth trying: the base plan's, the largest that
              fits the GPU memory with every layer on `layer` (at most L: with W = L no layer is
              uploaded twice, graph/build.py), and their middle. More slots cost GPU memory the
              activations could use instead; auto.py settles that trade on whole plans.
candidates()  param route x grad route x chunk size (H2D = D2H) x update sharding x window; with
              one GPU only the single-GPU routes (replicated, gpu, rank0) exist.
              A field named in `fixed` (FIXABLE: what a user's option sets) keeps the base plan's
              value instead: the options given stay, the search fills in the rest.
rank()        drop candidates that do not fit GPU or host memory (model/memory.py), pre-filter
              with the analytic model (slidedp.model.predict, ~0.03 s each), simulate the best
              `simulate_top` (~0.2 s each for Qwen3-8B; several at once where `sims` has worker
              processes, sim/batch.py) and order them by simulated step time
              (best_first: within TIE_REL of the best, larger chunks first, then fewer
              window slots, which leaves more memory to the activations).
Real probes (Probe: Plan -> measured seconds per step, None where the executor does not run the
plan) confirm the finalists in auto.py, not here: every candidate is ranked by the simulator.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace

from slidedp.model.memory import check_fits
from slidedp.model.predict import predict
from slidedp.sim.batch import StepTimes
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import GradRoute, ParamRoute, Plan, UpdateSharding
from slidedp.spec.workload import Workload

CHUNK_MIB = (16.0, 64.0, 256.0)
MIN_WINDOW = 2  # Plan's smallest window
# the chosen fields a caller may fix at its base plan's value ("chunk_mib": both chunk sizes)
FIXABLE = ("param_route", "grad_route", "update_sharding", "chunk_mib", "window_slots",
           "offload_ratio")
Probe = Callable[[Plan], float | None]
# simulated steps this close to the best are a tie, broken towards larger chunks: each chunk is
# a cast, a copy and an update dispatched from Python, a host cost per task the model leaves out,
# and the executor measured larger chunks faster wherever the simulator saw no difference
# (benchmarks/RESULTS.md: Qwen3-4B mb 4 `sac` 256 MiB 6% faster than 64 MiB;
# Qwen3-8B mb 4 window 3 `layer` 2.789 s at 256 MiB, 2.906 at 64; Qwen3-4B seq 16384 `layer`
# 2.196 s at 256 MiB, 2.302 at 16 MiB, where the simulator put them 0.2% apart)
TIE_REL = 0.005


def best_first(items: list, step_s: Callable[[object], float],
               plan: Callable[[object], Plan]) -> list:
    """`items` best first by a simulated step_s: those within TIE_REL of the smallest by larger
    chunks, then by step_s and fewer window slots; the others after them by step_s and window
    slots. (Measured steps need no tie rule: they carry the per-task cost.)"""
    if not items:
        return []
    best = min(step_s(i) for i in items)

    def key(i):
        tied = step_s(i) <= best * (1 + TIE_REL)
        return (not tied, -plan(i).h2d_chunk_mib if tied else 0.0, step_s(i),
                plan(i).window_slots)
    return sorted(items, key=key)


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


def fits(hw: HardwareSpec, wl: Workload, plan: Plan) -> bool:
    """Whether `plan` fits GPU and host memory (model/memory.py check_fits)."""
    try:
        check_fits(hw, wl, plan)
    except InfeasiblePlan:
        return False
    return True


def window_candidates(hw: HardwareSpec, wl: Workload, base: Plan,
                      fixed: frozenset[str] = frozenset()) -> list[int]:
    """The base plan's window, the largest that fits with every layer on `layer` (<= L), and
    their middle; ascending, without repeats. A fixed window: the base plan's alone."""
    if "window_slots" in fixed:
        return [base.window_slots]
    all_layer = replace(base, layer_policies=("layer",) * wl.model.n_layers)
    top = max(MIN_WINDOW, wl.model.n_layers)
    largest = next((w for w in range(top, MIN_WINDOW - 1, -1)
                    if fits(hw, wl, replace(all_layer, window_slots=w))), None)
    if largest is None:  # nothing fits: rank() drops every candidate and says so upstream
        return [base.window_slots]
    return sorted({base.window_slots, (base.window_slots + largest) // 2, largest})


def candidates(base: Plan, gpus: int, windows: list[int],
               fixed: frozenset[str] = frozenset()) -> list[Plan]:
    """Every route x chunk x window combination the topology can run, on top of `base`; the
    fields in `fixed` (FIXABLE) keep `base`'s value."""
    multi = gpus > 1

    def choices(name: str, values: list) -> list:
        return [getattr(base, name)] if name in fixed else values
    params = choices("param_route", list(ParamRoute) if multi else [ParamRoute.REPLICATED])
    grads = choices("grad_route", list(GradRoute) if multi else [GradRoute.GPU])
    updates = choices("update_sharding", list(UpdateSharding) if multi else [UpdateSharding.RANK0])
    chunks = ([(base.h2d_chunk_mib, base.d2h_chunk_mib)] if "chunk_mib" in fixed
              else [(c, c) for c in CHUNK_MIB])
    return [
        replace(base, param_route=p, grad_route=g, update_sharding=u, h2d_chunk_mib=c[0],
                d2h_chunk_mib=c[1], window_slots=w)
        for p, g, u, c, w in itertools.product(params, grads, updates, chunks, windows)
    ]


def rank(hw: HardwareSpec, wl: Workload, plans: list[Plan], simulate_top: int = 8,
         sims: StepTimes | None = None) -> list[Scored]:
    """Feasible candidates, best first (module docstring); sims: where the simulated steps come
    from (sim/batch.py: several at once in worker processes; default: one by one here)."""
    sims = (sims or StepTimes(hw, wl, workers=1)).check(hw, wl)
    scored = []
    for p in plans:
        try:
            analytic_s = predict(hw, wl, p).step_time_s  # predict checks the fit first
        except InfeasiblePlan:
            continue
        scored.append(Scored(p, analytic_s))
    scored.sort(key=lambda s: (s.analytic_s, s.plan.window_slots))
    sims.prefetch([s.plan for s in scored[:simulate_top]])
    top = [replace(s, simulated_s=sims.step_s(s.plan)) for s in scored[:simulate_top]]
    return best_first(top, lambda s: s.simulated_s, lambda s: s.plan) + scored[simulate_top:]
