"""Resource models of the simulator: what a running task draws on and how concurrent draws share.

Every task runs on its agent (a serial server, see engine.py) and, while it runs, draws on shared
resources. The draws come from slidedp.graph.costs.resource_use (the machine of graph/kinds.py;
the flat hardware spec's resources are listed in graph/flat_host.py), the same data the analytic
lower bound sums, so the model and the simulator turn the same knobs. A task alone runs at full
rate and takes durations[v] seconds (costs.task_durations); with others it runs at a *speed* s in
[0, 1] (fraction of its full rate) and its remaining work, in seconds at full rate, drops by s
per second.

Resources have a capacity per second; a task's demand is its draw divided by its duration. Two
are special here:
  gpu{r}.compute  one serial compute stream per GPU, capacity 1 (stream-seconds per second). A
                  compute task demands 1. A running collective also occupies a fraction of every
                  participating GPU's SMs (SimConfig.collective_sm_fraction), so compute and
                  collectives slow each other while both run.
  *.cores         a CPU core pool (cores): not shared by speed but by threads, first (below).
The machine also names where the copies' host-memory bytes are drawn (copy_traffic, the flat
spec's host.mem) and the CPU kernels' memory cap (kernel_dram, host.dram), which stage 3 reads.

Sharing rule, in stages, recomputed whenever a task starts or ends:
  1. cores: CPU tasks (CAST, ADAM, HOST_SUM) ask for `threads` cores. If the pool has enough,
     each gets what it asks; otherwise cores are split max-min fair (water-filling on thread
     counts). A task holding c of its t threads runs at most at rate(c) / rate(t) of its full
     rate, with rate() its kind's curve (graph/kinds.py KindRule.rate: the cast's at its chunk
     size, HostSpec.cast_rate; Adam's; linear for HOST_SUM), so a pool shared by workers beyond
     the saturation knee loses little.
  2. bandwidth: speeds are weighted max-min fair (progressive filling): a level rises from 0
     and each task runs at speed weight x level; when a resource's capacity is reached, the tasks
     on it freeze at their speed; when a task reaches its ceiling from stage 1 it freezes; the
     others keep rising. Equal weights = equal fractions of each task's own full rate, so two
     identical DMAs through a saturated host cap get equal bytes/s. Every weight is 1 but the
     CAST's (KindRule.weight): HostSpec.cast_weight, from the profile's teams-at-once run (at the graph's upload
     chunk where the profile ran the teams by chunk size), where the cast team got a smaller
     fraction of its own rate than the update team beside it (1 where not measured).
  3. copies beside CPU kernels (where the profile measured HostSpec.dma_slowdown_bps S): with
     the copies moving D bytes/s of host memory (their copy_traffic draws at their speeds), every
     CPU task's ceiling and kernel_dram's capacity are scaled by k = S / (S + D), and stage 2 runs
     at the k that the D it gives returns (engine.FluidShare._slow_cpu_beside_copies): a copy
     lengthens each memory access, so a kernel's ceiling drops by the same fraction however
     little traffic it has of its own (a kernel held lower by a shared cap, e.g. a full
     host.mem, may lose less). The copies are not slowed by it, only by the caps they share.
     Measured on nvidia-h200 (benchmarks/RESULTS.md): a lone update's 64 MiB chunks took +44%
     beside a D2H stream of ~45 GB/s (64 MiB in ~1.5 ms), where S = 125-140 GB/s gives
     +32-36%; the teams at their cap lost w = 0.31-0.51 of each copied byte (S = their traffic
     beside the copies / w: 125-254 GB/s on five profiles).
The rule has no memory: rates depend only on the set of running tasks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np

from slidedp.graph.costs import ResourceUse
from slidedp.graph.kinds import COLLECTIVE_KINDS, COPY_KINDS, KINDS
from slidedp.graph.tasks import Kind, TaskGraph
from slidedp.spec.hardware import HardwareSpec

REL_EPS = 1e-12


@dataclass
class Flow:
    """One running task under contention; `rem_s` is its remaining work in seconds at full rate."""

    task: int
    rem_s: float
    uses: list[tuple[int, float]]  # (resource index, demand per second at full speed)
    threads: float = 0.0  # CPU threads asked (0: not a CPU task)
    curve: Callable[[float], float] | None = None  # rate against threads (None: linear)
    pool: int = -1  # index of its (first) core pool (a `.cores` resource), -1 for GPU tasks
    # (core pool, fraction of the threads it asks there): a CPU task whose team is split over
    # several pools (a host topology's sockets); default ((pool, 1.0),)
    pools: tuple[tuple[int, float], ...] = ()
    cap: float = 1.0  # speed ceiling after the core allocation
    weight: float = 1.0  # share of a saturated resource, relative (stage 2)
    speed: float = 1.0
    cores: float = 0.0  # cores held now
    core_s: float = 0.0  # core-seconds held so far
    # a copy's host-memory bytes/s at full speed on each slowdown group's copy_traffic (set by
    # FluidShare.start)
    copy_bps: tuple[float, ...] = ()
    done: object = field(default=None, repr=False)  # the simpy event fired at completion
    # fill_speeds' view of `uses`: (resource, weight x demand) and the set of resources
    wuses: list[tuple[int, float]] = field(init=False, repr=False)
    rset: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self):
        if not self.weight > 0:
            raise ValueError(f"task {self.task}: a flow's weight must be > 0, got {self.weight}")
        self.wuses = [(j, self.weight * d) for j, d in self.uses]
        self.rset = frozenset(j for j, _ in self.uses)
        if not self.pools and self.pool >= 0:
            self.pools = ((self.pool, 1.0),)
        elif self.pools and self.pool < 0:
            self.pool = self.pools[0][0]


def allocate_cores(flows: list[Flow], pool_cores: dict[int, float]) -> None:
    """Stage 1: split each core pool between its CPU flows, max-min fair on the threads each
    asks there; set caps. A flow split over several pools runs at its most starved part's
    fraction (its team splits every kernel statically: the slowest part sets the pace)."""
    flows = [f for f in flows if f.pools]  # the others hold no cores
    by_pool: dict[int, list[tuple[Flow, float]]] = {}
    for f in flows:
        for p, frac in f.pools:
            by_pool.setdefault(p, []).append((f, f.threads * frac))
    got: dict[int, list[tuple[float, float]]] = {}  # id(flow) -> [(cores got, asked)]
    for pool, asks in by_pool.items():
        left, todo = pool_cores[pool], sorted(asks, key=lambda fa: (fa[1], fa[0].task))
        while todo:
            share = left / len(todo)
            f, ask = todo.pop(0)
            c = min(ask, share)
            got.setdefault(id(f), []).append((c, ask))
            left -= c
    for f in flows:
        parts = got.get(id(f))
        if parts is None:
            continue
        if len(parts) == 1:
            f.cores = parts[0][0]
            held = f.cores
        else:
            f.cores = sum(c for c, _ in parts)
            held = f.threads * min(c / a for c, a in parts)
        if held >= f.threads:
            f.cap = 1.0
        elif f.curve is None:
            f.cap = held / f.threads
        else:
            f.cap = f.curve(held) / f.curve(f.threads)


def fill_speeds(flows: list[Flow], capacity: list[float]) -> None:
    """Stage 2: weighted max-min fair speeds by progressive filling: a common level rises from
    0, each unfrozen flow runs at speed weight x level; a flow freezes when a resource it uses
    saturates or when it reaches its `cap`."""
    left: dict[int, float] = {}
    for f in flows:
        for j in f.rset:
            left[j] = capacity[j]
    below, above = 1 - REL_EPS, 1 + REL_EPS
    unfrozen = flows
    level = 0.0
    while unfrozen:
        demand: dict[int, float] = {}  # per unit of level, in order of first use
        for f in unfrozen:
            for j, wd in f.wuses:
                if j in demand:
                    demand[j] += wd
                else:
                    demand[j] = wd  # wd >= 0: the same as 0.0 + wd
        nxt = min([f.cap / f.weight for f in unfrozen])
        nxt_below, nxt_above = nxt * below, nxt * above
        saturated = set()
        for j, d in demand.items():
            if d > 0:
                room = left[j]
                sat = level + (room if room > 0.0 else 0.0) / d
                if sat < nxt_below:
                    nxt, saturated = sat, {j}
                    nxt_below, nxt_above = nxt * below, nxt * above
                elif sat <= nxt_above:
                    saturated.add(j)
        rise = nxt - level
        for j, d in demand.items():
            left[j] -= d * rise
        level = nxt
        keep = []
        for f in unfrozen:
            s = f.weight * level
            if f.cap <= s * above or (saturated and not saturated.isdisjoint(f.rset)):
                f.speed = s if s <= f.cap else f.cap
            else:
                keep.append(f)
        unfrozen = keep


def task_flows_spec(g: TaskGraph, durations: np.ndarray, use: ResourceUse, hw: HardwareSpec,
                    collective_sm_fraction: float):
    """Per task: (demands [(resource, per second)], core pools [(pool, fraction of its threads)],
    rate curve, weight). Built once.

    Demands are draws / duration; draws on `.cores` pools become the pools, each with its share
    of the task's core-seconds (stage 1). Collectives add `collective_sm_fraction` of each rank's
    compute stream. The rate curve and the weight are the kind's (graph/kinds.py KindRule.rate,
    .weight).
    """
    names = use.names
    pools = {i for i, n in enumerate(names) if n.endswith(".cores")}
    compute_of = [names.index(f"gpu{r}.compute") for r in range(g.n_ranks)]
    rules = [KINDS[k] for k in Kind]  # Kind values are 0..15
    weights = [1.0 if r.weight is None else r.weight(hw, g) for r in rules]
    curves: dict[tuple[int, float], Callable[[float], float]] = {}  # (kind, work) -> curve
    work = g.work.tolist()
    coll = {int(k) for k in COLLECTIVE_KINDS}
    copies = {int(k) for k in COPY_KINDS}
    # the copies' draw on the CPU kernels' cap where the slowdown stands for it (stage 3; the
    # draw is the analytic bound's linear part of it, graph/flat_host.py)
    kernel_dram = {kernel for s_bps, _, kernel in use.slowdowns if s_bps > 0}
    uses_of, held_of = _split_draws(g, durations, use, pools, kernel_dram, copies)
    kinds, dur = g.kind.tolist(), durations.tolist()
    specs = []
    for v, k in enumerate(kinds):
        uses, held = uses_of(v), held_of(v)
        if k in coll and collective_sm_fraction > 0 and dur[v] > 0:
            uses += [(j, collective_sm_fraction) for j in compute_of]
        total = sum(a for _, a in held)
        split = tuple((j, a / total) for j, a in held) if total > 0 else tuple(
            (j, 1.0) for j, _ in held[:1])
        rate, curve = rules[k].rate, None
        if rate is not None:
            curve = curves.get((k, work[v]))
            if curve is None:
                curve = curves[k, work[v]] = partial(rate, hw, g, work=work[v])
        specs.append((uses, split, curve, weights[k]))
    return specs


def _split_draws(g: TaskGraph, durations: np.ndarray, use: ResourceUse, pools: set[int],
                 kernel_dram: set[int], copies: set[int]):
    """Per task v of positive duration, in draw order: uses_of(v), a new list of (resource,
    draw / duration) of its positive draws on resources other than core pools (a copy's draw on
    a CPU kernels' cap in `kernel_dram` left out), and held_of(v), (pool, core-seconds) of its
    draws on core pools; both empty for a task of no duration."""
    per_task = np.diff(use.ptr)
    task = np.repeat(np.arange(g.n_tasks), per_task)
    dur = durations[task]
    res, amount = use.res, use.amount
    live = dur > 0
    on_pool = np.isin(res, list(pools))
    copy_on_kernel = np.isin(res, list(kernel_dram)) & np.isin(g.kind[task], list(copies))
    is_use = live & ~on_pool & (amount > 0) & ~copy_on_kernel
    is_held = live & on_pool
    per_s = np.divide(amount, dur, out=np.zeros_like(amount), where=is_use)
    at = np.flatnonzero(is_use)
    uses = list(zip(res[at].tolist(), per_s[at].tolist(), strict=True))
    uptr = np.searchsorted(at, use.ptr).tolist()
    at = np.flatnonzero(is_held)
    held = list(zip(res[at].tolist(), amount[at].tolist(), strict=True))
    hptr = np.searchsorted(at, use.ptr).tolist()
    return (lambda v: uses[uptr[v]:uptr[v + 1]]), (lambda v: held[hptr[v]:hptr[v + 1]])
