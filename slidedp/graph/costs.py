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
from slidedp.graph.kinds import (
    KINDS,
    MOVING_KINDS,
    KindInputs,
    Load,
    Machine,
    TaskLoad,
    task_core_share,
)
from slidedp.graph.rates import flops_per_hbm_byte, task_gaps_s
from slidedp.graph.tasks import Kind, TaskGraph
from slidedp.graph.topology import TopologyHost
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.workload import Workload

# re-exported: policy/activations.py reads it from here
__all__ = ["MACHINES", "ResourceUse", "flops_per_hbm_byte", "held_cores", "machine_of",
           "resource_use", "task_core_share", "task_durations"]

# the machines a hardware spec may describe, most specific first: each factory returns None for
# a spec it does not describe; the flat spec's machine takes every spec
MACHINES: tuple[Callable[[HardwareSpec, TaskGraph], Machine | None], ...] = (
    TopologyHost.of, FlatHost.of)


@dataclass(frozen=True)
class ResourceUse:
    """Per-task resource draws in CSR form: task v uses res[ptr[v]:ptr[v+1]] with `amount`."""

    names: list[str]
    capacity: np.ndarray  # units of amount per second
    ptr: np.ndarray
    res: np.ndarray
    amount: np.ndarray
    # the copies' slowdown of the CPU kernels, per memory of the machine (Machine.slowdowns):
    # (S bytes/s, the resource where the copies' bytes of that memory are drawn, the CPU
    # kernels' cap on it), which the simulator's FluidShare reads and scales; () where none
    slowdowns: tuple[tuple[float, int, int], ...] = ()

    def index(self, name: str) -> int:
        return self.names.index(name)


def machine_of(hw: HardwareSpec, g: TaskGraph) -> Machine:
    """The first machine of MACHINES that describes `hw`."""
    return next(m for make in MACHINES if (m := make(hw, g)) is not None)


def held_cores(g: TaskGraph) -> np.ndarray:
    """Cores each task holds while it runs: its team's threads x its share (0 for GPU tasks)."""
    return g.threads * task_core_share(g)


def task_durations(g: TaskGraph, hw: HardwareSpec, wl: Workload) -> np.ndarray:
    """Seconds per task, alone on its agent (the kinds' duration rules, kinds.py), a copy or a
    collective at least as long as the tightest link of its path lets it be (lone_on_links)."""
    d = np.zeros(g.n_tasks)
    c = KindInputs(g, hw, wl)
    for k in np.unique(g.kind).tolist():
        idx = np.flatnonzero(g.kind == k)
        d[idx] = KINDS[Kind(k)].seconds(c, idx)
    d += task_gaps_s(g, hw)
    return lone_on_links(g, hw, d)


def lone_on_links(g: TaskGraph, hw: HardwareSpec, durations: np.ndarray) -> np.ndarray:
    """Each copy's and collective's duration, at least the time its largest draw takes alone at
    the capacity of its resource (max over its draws of amount / capacity): what the simulator
    gives a lone task, so that the critical path reads the machine's links (a switch uplink or a
    socket's cap below the GPU's own link, a ring hop staged through host memory)."""
    machine = machine_of(hw, g)
    out = durations.copy()
    moving = np.flatnonzero(np.isin(g.kind, [int(k) for k in MOVING_KINDS]))
    kind_list = list(Kind)
    for v in moving.tolist():
        k = kind_list[int(g.kind[v])]
        t = TaskLoad(v, k, KINDS[k].load, int(g.rank[v]), float(g.work[v]), float(out[v]), 0.0,
                     0.0)
        longest = max((a / machine.capacity[name] for name, a in machine.draws(t)), default=0.0)
        if longest > out[v]:
            out[v] = longest
    return out


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
                       np.asarray(amt, np.float64),
                       tuple((s_bps, idx[copy], idx[kernel])
                             for s_bps, copy, kernel in machine.slowdowns))
