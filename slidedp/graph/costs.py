"""Work -> time, in one place: each task's duration and its draws on the machine's resources.

task_durations applies each kind's duration rule (graph/kinds.py KINDS) to the graph's tasks,
alone on their agents at the full rate of their resources (no contention), plus the executor's
dispatch gap of the CPU kinds where measured. resource_use asks the machine (kinds.py, "The
machine") what each task draws: the analytic lower bound sums the draws per resource, the
simulator shares the resources between concurrent tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from slidedp.graph.flat_host import FlatHost
from slidedp.graph.kinds import KINDS, KindInputs, Load, Machine, TaskLoad, task_core_share
from slidedp.graph.rates import flops_per_hbm_byte, task_gaps_s
from slidedp.graph.tasks import Kind, TaskGraph
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.workload import Workload

# re-exported: policy/activations.py reads it from here
__all__ = ["MACHINES", "ResourceUse", "flops_per_hbm_byte", "held_cores", "machine_of",
           "resource_use", "task_core_share", "task_durations"]

# the machines a hardware spec may describe, most specific first: each factory returns None for
# a spec it does not describe; the flat spec's machine takes every spec
MACHINES: tuple[Callable[[HardwareSpec, TaskGraph], Machine | None], ...] = (FlatHost.of,)


@dataclass(frozen=True)
class ResourceUse:
    """Per-task resource draws in CSR form: task v uses res[ptr[v]:ptr[v+1]] with `amount`."""

    names: list[str]
    capacity: np.ndarray  # units of amount per second
    ptr: np.ndarray
    res: np.ndarray
    amount: np.ndarray
    # the copies' slowdown of the CPU kernels (HostSpec.dma_slowdown_bps; 0: none) and the
    # resources it reads and scales (the simulator's FluidShare): `copy_traffic`, where the
    # copies' host-memory bytes are drawn (-1: none), and `kernel_dram`, the CPU kernels' cap
    dma_slowdown_bps: float = 0.0
    copy_traffic: int = -1
    kernel_dram: int = -1

    def index(self, name: str) -> int:
        return self.names.index(name)


def machine_of(hw: HardwareSpec, g: TaskGraph) -> Machine:
    """The first machine of MACHINES that describes `hw`."""
    return next(m for make in MACHINES if (m := make(hw, g)) is not None)


def held_cores(g: TaskGraph) -> np.ndarray:
    """Cores each task holds while it runs: its team's threads x its share (0 for GPU tasks)."""
    return g.threads * task_core_share(g)


def task_durations(g: TaskGraph, hw: HardwareSpec, wl: Workload) -> np.ndarray:
    """Seconds per task, alone on its agent (the kinds' duration rules, kinds.py)."""
    d = np.zeros(g.n_tasks)
    c = KindInputs(g, hw, wl)
    for k in np.unique(g.kind).tolist():
        idx = np.flatnonzero(g.kind == k)
        d[idx] = KINDS[Kind(k)].seconds(c, idx)
    d += task_gaps_s(g, hw)
    return d


def resource_use(g: TaskGraph, hw: HardwareSpec, durations: np.ndarray) -> ResourceUse:
    """Which shared resources each task draws on and how much: the machine's draws (kinds.py)."""
    machine = machine_of(hw, g)
    idx = {n: i for i, n in enumerate(machine.names)}
    kind_list = list(Kind)  # Kind values are 0..15
    rules = [KINDS[k] for k in kind_list]
    per_work = {int(k): r.dram_bytes(g, hw) for k, r in KINDS.items() if r.dram_bytes is not None}
    kinds, ranks, work = g.kind.tolist(), g.rank.tolist(), g.work.tolist()
    cores = held_cores(g).tolist()
    kernel_s = (durations - task_gaps_s(g, hw)).tolist()  # cores: the team idles in the gap
    dur = durations.tolist()
    ptr, res, amt = [0], [], []
    for v, k in enumerate(kinds):
        rule = rules[k]
        cpu = rule.load is Load.CPU
        w = work[v]
        t = TaskLoad(v, kind_list[k], rule.load, ranks[v], w, dur[v], w * per_work[k] if cpu else 0.0,
                     cores[v] * kernel_s[v] if cpu else 0.0)
        for name, a in machine.draws(t):
            res.append(idx[name])
            amt.append(a)
        ptr.append(len(res))
    return ResourceUse(machine.names, np.array([machine.capacity[n] for n in machine.names]),
                       np.asarray(ptr, np.int64), np.asarray(res, np.int64),
                       np.asarray(amt, np.float64), machine.dma_slowdown_bps,
                       idx.get(machine.copy_traffic, -1), idx[machine.kernel_dram])
