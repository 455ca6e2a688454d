"""Simulated steps of many plans of one (hardware, workload), several at once.

AutoPolicy simulates tens of plans of one workload (the route ranking's top candidates, each
finalist's marginal costs tau_j and whole plans: ~0.2 s each at Qwen3-8B, 40-50 of them), every
one independent and pure Python (simpy). StepTimes memoizes them by plan and, given a batch
(prefetch), runs the ones not known yet in a pool of worker processes.

  StepTimes(hw, wl, workers=None)  workers: processes of the pool; None: default_workers();
                                   1: everything in this process
  prefetch(plans)                  simulate those not memoized, in the pool when two or more
  summary(plan) / step_s(plan)     a plan's SimSummary / simulated step (memoized; simulated
                                   here if new)
  default_workers()                SLIDEDP_SIM_WORKERS where set, else the cores this process may
                                   use (affinity, and a cgroup CPU quota where there is one) less
                                   one (a probe's host-state build or the caller keeps one), at
                                   most MAX_WORKERS

The pool's processes are spawned, not forked: the caller may hold threads (the probe's background
build) and a CUDA context, which a fork would copy in whatever state they are. Spawning re-imports
the caller's main module, so a script that calls AutoPolicy needs `if __name__ == "__main__":`
around it (the `slidedp` command, Jupyter and pytest have it); where the workers cannot start the
batch runs in this process and says so once on stderr. A worker imports only the simulator (no
torch), ~0.3 s, and receives the hardware and workload once (pickled here with the specs'
read-only mappings as dicts); the pool lives until close() (a context manager). The simulation is
deterministic: a plan's figures do not depend on where it ran (tests/test_sim_batch.py).
"""

from __future__ import annotations

import copyreg
import io
import math
import multiprocessing
import os
import pickle
import sys
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

MAX_WORKERS = 8
ENV_WORKERS = "SLIDEDP_SIM_WORKERS"


@dataclass(frozen=True)
class SimSummary:
    """What AutoPolicy reads of a simulated plan (sim/result.py SimResult's properties)."""

    step_time_s: float
    compute_s: float
    host: tuple[str, float]  # the busiest non-compute resource or agent, its busy seconds
    exposed_by_channel_s: dict[str, float]


def summarize(hw: HardwareSpec, wl: Workload, plan: Plan) -> SimSummary:
    res = simulate(hw, wl, plan, check_memory=False)
    return SimSummary(res.step_time_s, res.compute_s, res.host, res.exposed_by_channel_s)


def _cgroup_cores() -> int | None:
    """ceil(quota / period) of a cgroup v2 CPU limit on this process, None without one."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else max(1, math.ceil(int(quota) / int(period)))


def default_workers() -> int:
    """Worker processes for a batch (module docstring), at least 1."""
    if os.environ.get(ENV_WORKERS):
        try:
            return max(1, int(os.environ[ENV_WORKERS]))
        except ValueError:
            raise ValueError(f"{ENV_WORKERS}: a whole number of worker processes, got "
                             f"{os.environ[ENV_WORKERS]!r}") from None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cores = min(cores or 1, _cgroup_cores() or cores or 1)
    return max(1, min(MAX_WORKERS, cores - 1))


def _specs_bytes(hw: HardwareSpec, wl: Workload) -> bytes:
    """(hw, wl) pickled with read-only mappings as dicts (a private dispatch table: nothing
    global changes)."""
    buf = io.BytesIO()
    p = pickle.Pickler(buf, pickle.HIGHEST_PROTOCOL)
    p.dispatch_table = copyreg.dispatch_table | {MappingProxyType: lambda m: (dict, (dict(m),))}
    p.dump((hw, wl))
    return buf.getvalue()


_WORKER_SPECS: tuple[HardwareSpec, Workload] | None = None


def _worker_init(specs: bytes) -> None:
    global _WORKER_SPECS
    _WORKER_SPECS = pickle.loads(specs)


def _worker_summary(plan: Plan) -> SimSummary:
    return summarize(*_WORKER_SPECS, plan)


class StepTimes:
    """Memoized simulated steps by plan, batches run in worker processes (module docstring)."""

    def __init__(self, hw: HardwareSpec, wl: Workload, workers: int | None = None):
        self.hw, self.wl = hw, wl
        self.workers = default_workers() if workers is None else workers
        if self.workers < 1:
            raise ValueError(f"workers must be >= 1, got {self.workers}")
        self.memo: dict[Plan, SimSummary] = {}
        self._pool: ProcessPoolExecutor | None = None

    def __enter__(self) -> StepTimes:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def check(self, hw: HardwareSpec, wl: Workload) -> StepTimes:
        """self, after checking it simulates this hardware and workload."""
        if hw is not self.hw or wl is not self.wl:
            raise ValueError("StepTimes of another hardware or workload")
        return self

    def summary(self, plan: Plan) -> SimSummary:
        if plan not in self.memo:
            self.memo[plan] = summarize(self.hw, self.wl, plan)
        return self.memo[plan]

    def step_s(self, plan: Plan) -> float:
        return self.summary(plan).step_time_s

    def prefetch(self, plans: list[Plan]) -> None:
        """Simulate the plans not memoized yet: in the pool where there are two or more and
        workers > 1, else here."""
        todo = list(dict.fromkeys(p for p in plans if p not in self.memo))
        if len(todo) >= 2 and self.workers > 1:
            try:
                if self._pool is None:
                    self._pool = ProcessPoolExecutor(
                        self.workers, mp_context=multiprocessing.get_context("spawn"),
                        initializer=_worker_init, initargs=(_specs_bytes(self.hw, self.wl),))
                futures = [self._pool.submit(_worker_summary, p) for p in todo]
                for p, f in zip(todo, futures, strict=True):
                    self.memo[p] = f.result()
            except BrokenProcessPool:
                self.close()
                self.workers = 1
                print(f"slidedp: simulating in this process: the simulation worker processes "
                      f"did not start (a script that runs AutoPolicy without `if __name__ == "
                      f"'__main__':`? {ENV_WORKERS}=1 keeps them off)", file=sys.stderr)
        for p in todo:
            self.summary(p)
