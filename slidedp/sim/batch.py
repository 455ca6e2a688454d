"""Simulated step times of many plans of one (hardware, workload), several at once.

AutoPolicy simulates tens of plans of one workload (the route ranking's top candidates, then each
finalist's marginal costs tau_j: ~0.2 s each at Qwen3-8B, 35-40 of them), every one independent
and pure Python (simpy). StepTimes memoizes them by plan and, given a batch (prefetch), runs the
ones not known yet in a pool of worker processes.

  StepTimes(hw, wl, workers=None)  workers: processes of the pool; None: the cores this process
                                   may run on less one (a probe's host-state build or the caller
                                   keeps one), at most MAX_WORKERS; 1: everything in this process
  prefetch(plans)                  simulate those not memoized, in the pool when two or more
  step_s(plan)                     a plan's simulated step (memoized; simulated here if new)

The pool's processes are spawned, not forked: the caller may hold threads (the probe's background
build) and a CUDA context, which a fork would copy in whatever state they are. A worker imports
only the simulator (no torch), ~0.3 s, once per pool; the pool lives as long as the StepTimes (a
context manager). The simulation is deterministic, so a step time does not depend on where it ran
(tests/test_sim_batch.py compares them).
"""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from multiprocessing.reduction import ForkingPickler
from types import MappingProxyType

from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

MAX_WORKERS = 8

# the specs' read-only mappings (HostSpec.task_gap_s, ModelSpec.config) travel to the workers as
# the same read-only views of a copied dict
def _read_only(d: dict) -> MappingProxyType:
    return MappingProxyType(d)


ForkingPickler.register(MappingProxyType, lambda m: (_read_only, (dict(m),)))


def default_workers() -> int:
    """The cores this process may run on, less one, at most MAX_WORKERS (at least 1)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(MAX_WORKERS, (cores or 1) - 1))


def _step_s(hw: HardwareSpec, wl: Workload, plan: Plan) -> float:
    return simulate(hw, wl, plan, check_memory=False).step_time_s


class StepTimes:
    """Memoized simulated step seconds by plan, batches run in worker processes (module
    docstring)."""

    def __init__(self, hw: HardwareSpec, wl: Workload, workers: int | None = None):
        self.hw, self.wl = hw, wl
        self.workers = default_workers() if workers is None else workers
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self.memo: dict[Plan, float] = {}
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> StepTimes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def step_s(self, plan: Plan) -> float:
        if plan not in self.memo:
            self.memo[plan] = _step_s(self.hw, self.wl, plan)
        return self.memo[plan]

    def prefetch(self, plans: list[Plan]) -> None:
        """Simulate the plans not memoized yet: in the pool where there are two or more and
        workers > 1, else here."""
        todo = list(dict.fromkeys(p for p in plans if p not in self.memo))
        if len(todo) < 2 or self.workers == 1:
            for p in todo:
                self.step_s(p)
            return
        if self._pool is None:
            self._pool = ProcessPoolExecutor(self.workers,
                                             mp_context=multiprocessing.get_context("spawn"))
        futures = [self._pool.submit(_step_s, self.hw, self.wl, p) for p in todo]
        for p, f in zip(todo, futures, strict=True):
            self.memo[p] = f.result()
