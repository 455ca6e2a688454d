"""The discrete-event engine: one simpy environment, one process per agent, fluid bandwidth sharing.

build -> run -> collect (desmod's shape):
  build    per task: how many predecessors it waits on (DATA edges, version gates among them,
           ORDER, and BUFFER unless buffer limits are off), its successors, its resource demands
           (resources.task_flows_spec).
  run      one simpy process per agent (gpu{r}.compute, gpu{r}.h2d, gpu{r}.d2h, fabric,
           cpu.cast{w}, cpu.update{w}) walks the agent's tasks in issue order (g.agent_tasks):
             waits on   one simpy event, fired when the task's last predecessor finishes: the data
                        it reads, the version gate of I3, the release of the slot or staging
                        buffer it writes (BUFFER edges: back-pressure), the previous task on its
                        own agent (the agent is a serial server);
             duration   contention off: exactly durations[v] (a simpy timeout), so start and
                        finish equal the f(v) recurrence of slidedp.model.critical_path;
                        contention on: the task becomes a Flow in FluidShare, which runs it at
                        the weighted max-min fair speed of resources.py and fires its event when its
                        work is done.
           Events happen only at task boundaries (a task starts, a task ends, a flow's rate
           changes because another one started or ended).
  collect  start_s / finish_s per task, core-seconds held per CPU task, events, wall time.
Determinism: simpy orders simultaneous events by insertion; processes are created in agent order
and successors are released in task-id order, so the same input gives the same output.
Several hosts later: agents and resources are opaque indices here (core pools are the resources
named `*.cores`); a multi-node graph adds agents and resources such as host{h}.dram, nothing here.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import simpy

from slidedp.graph.costs import ResourceUse, held_cores
from slidedp.graph.tasks import EdgeKind, TaskGraph
from slidedp.sim.resources import REL_EPS, Flow, allocate_cores, fill_speeds, task_flows_spec
from slidedp.spec.hardware import HardwareSpec

GATE = max(EdgeKind) + 1  # pred_why code of a version-gate (I3) DATA edge
TIME_EPS = 1e-12  # relative: flows this close to done, in seconds at their speed, finish together
SLOWDOWN_FILLS = 60  # fills at most, for the CPU flows' factor beside copies (stage 3)
SLOWDOWN_TOL = 1e-9  # that factor's tolerance


@dataclass(frozen=True)
class SimConfig:
    """What the simulator models. Switching contention and buffers off gives the critical path.

    iterations              steps simulated (>= 3): iteration 0 fills the pipeline from empty
                            (warm-up); iterations 1.. are steady (gated by the previous update)
    contention              share bandwidth and cores (resources.py); off: every task takes its
                            uncontended task_durations time
    buffers                 honour BUFFER edges (bounded slots and staging chunks); off: drop them
    collective_sm_fraction  fraction of a GPU's compute a running collective occupies (estimate:
                            NCCL runs 8-16 channels, one SM each, of 108-132 SMs)
    """

    iterations: int = 3
    contention: bool = True
    buffers: bool = True
    collective_sm_fraction: float = 0.1

    def __post_init__(self):
        if self.iterations < 3:
            raise ValueError("simulate at least 3 iterations (one warm-up, two steady)")
        if not 0.0 <= self.collective_sm_fraction < 1.0:
            raise ValueError("collective_sm_fraction must be in [0, 1)")


@dataclass(frozen=True)
class RawRun:
    start_s: np.ndarray
    finish_s: np.ndarray
    core_s: np.ndarray  # core-seconds each CPU task held
    pred_ptr: np.ndarray  # predecessors the run honoured, CSR by destination
    pred_src: np.ndarray
    pred_why: np.ndarray  # per predecessor: EdgeKind value, or GATE for a version-gate edge
    events: int
    wall_s: float


class FluidShare:
    """The running flows and their speeds; one pending simpy timeout for the next completion.

    Fast path: while no flow is slowed, a flow whose demands fit into the free capacity starts at
    full speed and a finishing flow frees its capacity, with no recomputation; otherwise
    allocate_cores + fill_speeds (and, where copies slow the CPU kernels, resources.py stage 3)
    run over all running flows (there are at most a few dozen: one per agent). A CPU flow
    joining copies, or a copy joining CPU flows, always recomputes.
    """

    def __init__(self, env: simpy.Environment, capacity: list[float], pools: dict[int, float],
                 slowdowns: tuple[tuple[float, int, int], ...] = ()):
        self.env, self.capacity, self.pools = env, capacity, pools
        # per memory (ResourceUse.slowdowns): (S bytes/s, where the copies' bytes of that memory
        # are drawn, the CPU kernels' cap on it); CPU flows on it beside copies of D bytes/s
        # there are capped at S / (S + D) of their speed
        self.groups = tuple(slowdowns)
        self.slowing = [i for i, grp in enumerate(self.groups) if grp[0] > 0]
        self.flows: list[Flow] = []
        self.load = [0.0] * len(capacity)
        self.running = {"cpu": 0, "copy": 0}  # CPU flows, and copies drawing on a copy_traffic
        self.pool_threads = dict.fromkeys(pools, 0.0)
        self.slowed = 0
        self.t_last = 0.0
        self.generation = 0
        self.next_flow: Flow | None = None
        self.events = 0

    def start(self, f: Flow) -> None:
        self._advance()
        f.copy_bps = () if f.pool >= 0 else tuple(
            sum(d for j, d in f.uses if j == copy) for _, copy, _ in self.groups)
        self.flows.append(f)
        if self.slowed == 0 and self._fits(f):
            f.speed, f.cap, f.cores = 1.0, 1.0, f.threads
            self._add_load(f, 1.0)
        else:
            self._recompute()
        self._schedule()

    def _fits(self, f: Flow) -> bool:
        if any(self.pool_threads[p] + f.threads * frac > self.pools[p] for p, frac in f.pools):
            return False
        if self.slowing and self.running["copy" if f.pool >= 0 else "cpu"] and (
                f.pool >= 0 or any(b > 0 for b in f.copy_bps)):
            return False  # a CPU flow beside a copy: both kinds slow it (_slow_cpu_beside_copies)
        cap, load = self.capacity, self.load
        return all(load[j] + d <= cap[j] * (1 + REL_EPS) for j, d in f.uses)

    def _add_load(self, f: Flow, sign: float) -> None:
        for j, d in f.uses:
            self.load[j] += sign * d * f.speed
        if f.pool >= 0:
            for p, frac in f.pools:
                self.pool_threads[p] += sign * f.threads * frac
            self.running["cpu"] += int(sign)
        elif any(b > 0 for b in f.copy_bps):
            self.running["copy"] += int(sign)

    def _slow_cpu_beside_copies(self) -> None:
        """Stage 3 of resources.py, per memory i of the machine (ResourceUse.slowdowns): the
        ceilings of the CPU flows on it (those drawing its kernels' cap; a flow drawing none
        of them is on every one) and its kernels' cap times k_i, at the k_i where
        k_i = S_i / (S_i + D_i(k)), D_i the copies' bytes/s of that memory that stage 2 gives.
        A flow on several memories takes the smallest of their k. One memory: one root found
        by _settle; several: _settle on each in turn, the others held, until no k moves by
        more than SLOWDOWN_TOL (at most SLOWDOWN_FILLS rounds)."""
        cpu = [f for f in self.flows if f.pool >= 0]
        if not cpu or not any(f.copy_bps and any(f.copy_bps) for f in self.flows):
            return
        kernels = {i: self.groups[i][2] for i in self.slowing}
        on = [tuple(i for i, kd in kernels.items() if any(j == kd for j, _ in f.uses))
              or tuple(kernels) for f in cpu]
        ceilings, capacity = [f.cap for f in cpu], list(self.capacity)
        k = dict.fromkeys(kernels, 1.0)

        def fill() -> None:
            for f, c, groups in zip(cpu, ceilings, on, strict=True):
                f.cap = c * min(k[i] for i in groups)
            for i, kd in kernels.items():
                capacity[kd] = self.capacity[kd] * k[i]
            fill_speeds(self.flows, capacity)

        if len(kernels) == 1:
            self._settle(self.slowing[0], k, fill, filled=True)
            return
        for _ in range(SLOWDOWN_FILLS):
            before = dict(k)
            for i in kernels:
                self._settle(i, k, fill, filled=False)
            if max(abs(k[i] - before[i]) for i in k) <= SLOWDOWN_TOL:
                return
        raise RuntimeError(f"the copies' slowdown of the CPU flows did not settle over "
                           f"{len(kernels)} memories in {SLOWDOWN_FILLS} rounds (k = {k})")

    def _settle(self, i: int, k: dict[int, float], fill, filled: bool) -> None:
        """k[i] at the root of h(k_i) = k_i - S_i / (S_i + D_i(k)), the other k held, the flows
        filled at it. The root lies in [S_i / (S_i + its copies at full speed), 1] (h <= 0 at
        the low end, >= 0 at 1); found by regula falsi (Illinois), each step one fill, to
        SLOWDOWN_TOL (a plain iteration can crawl: ~0.9 a step where host.mem binds). `filled`:
        the flows are filled at k_i = 1 already."""
        s_bps = self.groups[i][0]
        copies = [(f, f.copy_bps[i]) for f in self.flows if f.copy_bps and f.copy_bps[i] > 0]
        if not copies:
            return

        def h(x: float) -> float:  # fills at x; > 0: x too large for the copies it lets run
            k[i] = x
            fill()
            return x - s_bps / (s_bps + sum(f.speed * b for f, b in copies))

        lo = s_bps / (s_bps + sum(b for _, b in copies))
        if filled:
            hi, h_hi = 1.0, 1.0 - s_bps / (s_bps + sum(f.speed * b for f, b in copies))
        else:
            hi, h_hi = 1.0, h(1.0)
        if h_hi <= SLOWDOWN_TOL:  # the copies starved at k = 1 (stage 2 as it stands)
            return
        h_lo = h(lo)
        if h_lo >= 0:
            return  # the copies at full speed: k = lo, filled
        side = 0
        for _ in range(SLOWDOWN_FILLS):
            x = hi - h_hi * (hi - lo) / (h_hi - h_lo)
            h_x = h(x)
            if abs(h_x) <= SLOWDOWN_TOL or hi - lo <= SLOWDOWN_TOL:
                return
            if h_x > 0:
                hi, h_hi = x, h_x
                h_lo, side = (h_lo / 2, side) if side == 1 else (h_lo, 1)
            else:
                lo, h_lo = x, h_x
                h_hi, side = (h_hi / 2, side) if side == -1 else (h_hi, -1)
        raise RuntimeError(f"the copies' slowdown of the CPU flows did not settle in "
                           f"{SLOWDOWN_FILLS} fills (k in [{lo:.9f}, {hi:.9f}])")

    def _recompute(self) -> None:
        allocate_cores(self.flows, self.pools)
        fill_speeds(self.flows, self.capacity)
        if self.slowing:
            self._slow_cpu_beside_copies()
        load = self.load = [0.0] * len(self.capacity)
        threads = self.pool_threads = dict.fromkeys(self.pools, 0.0)
        cpu = copy = slowed = 0
        for f in self.flows:  # _add_load(f, 1.0) of each flow, in the same order
            speed = f.speed
            for j, d in f.uses:
                load[j] += d * speed
            if f.pool >= 0:
                for p, frac in f.pools:
                    threads[p] += f.threads * frac
                cpu += 1
            elif any(b > 0 for b in f.copy_bps):
                copy += 1
            if speed < 1.0 - REL_EPS:
                slowed += 1
        self.running = {"cpu": cpu, "copy": copy}
        self.slowed = slowed

    def _advance(self) -> None:
        now = self.env.now
        dt = now - self.t_last
        if dt > 0:
            for f in self.flows:
                f.rem_s -= f.speed * dt
                f.core_s += f.cores * dt
        self.t_last = now

    def _schedule(self) -> None:
        self.generation += 1
        if not self.flows:
            return
        best, first = math.inf, None
        for f in self.flows:
            t = f.rem_s / f.speed
            if t < best:
                best, first = t, f
        self.next_flow = first
        gen = self.generation
        self.events += 1
        self.env.timeout(max(best, 0.0)).callbacks.append(lambda _e: self._fire(gen))

    def _fire(self, gen: int) -> None:
        if gen != self.generation:
            return  # superseded by a later rate change
        self._advance()
        tol = TIME_EPS * max(1.0, self.env.now)
        done, running = [], []
        for f in self.flows:
            (done if f is self.next_flow or f.rem_s <= f.speed * tol else running).append(f)
        self.flows = running
        if self.slowed == 0:
            for f in done:
                self._add_load(f, -1.0)
        else:
            self._recompute()
        self._schedule()
        for f in done:
            f.done.succeed()


def _pred_csr(g: TaskGraph, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    src, dst = g.edge_src[keep], g.edge_dst[keep]
    why = np.where(g.edge_gate[keep], GATE, g.edge_kind[keep]).astype(np.int8)
    order = np.argsort(dst, kind="stable")
    ptr = np.zeros(g.n_tasks + 1, np.int64)
    np.add.at(ptr, dst + 1, 1)
    return np.cumsum(ptr), src[order], why[order]


def run_graph(g: TaskGraph, durations: np.ndarray, use: ResourceUse, hw: HardwareSpec,
              cfg: SimConfig) -> RawRun:
    """Simulate every iteration of `g`; see the module docstring for what each process does."""
    t0 = time.perf_counter()
    keep = np.ones(g.n_edges, bool) if cfg.buffers else g.edge_kind != int(EdgeKind.BUFFER)
    pred_ptr, pred_src, pred_why = _pred_csr(g, keep)
    n = g.n_tasks
    pending = np.diff(pred_ptr).tolist()
    order = np.argsort(g.edge_src[keep], kind="stable")
    succ_dst = g.edge_dst[keep][order].tolist()
    succ_ptr = np.searchsorted(g.edge_src[keep][order], np.arange(n + 1)).tolist()
    dur = durations.tolist()
    specs = task_flows_spec(g, durations, use, hw, cfg.collective_sm_fraction) if cfg.contention else None
    threads = held_cores(g).tolist()  # a team's threads x its share (graph.sizes.team_share)
    pools = {i: float(use.capacity[i]) for i, nm in enumerate(use.names) if nm.endswith(".cores")}
    start, finish, core_s = [math.nan] * n, [math.nan] * n, [0.0] * n
    env = simpy.Environment()
    share = FluidShare(env, use.capacity.tolist(), pools, use.slowdowns)
    waiting: dict[int, simpy.Event] = {}
    counters = [0]

    def agent(tasks: list[int]):
        for v in tasks:
            if pending[v]:
                ev = env.event()
                waiting[v] = ev
                yield ev
            start[v] = env.now
            d = dur[v]
            if specs is None or d <= 0 or not (specs[v][0] or specs[v][1]):
                yield env.timeout(d)
            else:
                uses, split, curve, weight = specs[v]
                f = Flow(v, d, uses, threads[v] if split else 0.0, curve, pools=split,
                         weight=weight)
                f.done = env.event()
                share.start(f)
                yield f.done
                core_s[v] = f.core_s
            finish[v] = env.now
            counters[0] += 2
            for i in range(succ_ptr[v], succ_ptr[v + 1]):
                s = succ_dst[i]
                pending[s] -= 1
                if pending[s] == 0 and s in waiting:
                    waiting.pop(s).succeed()

    for tasks in g.agent_tasks:
        env.process(agent(tasks.tolist()))
    env.run()
    fin = np.asarray(finish)
    if np.isnan(fin).any():
        v = int(np.flatnonzero(np.isnan(fin))[0])
        raise RuntimeError(f"simulation deadlocked: {g.label(v)} never ran (graph bug)")
    return RawRun(np.asarray(start), fin, np.asarray(core_s), pred_ptr, pred_src, pred_why,
                  counters[0] + share.events, time.perf_counter() - t0)
