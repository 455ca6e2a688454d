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
                 dma_slowdown: tuple[float, int, int] = (0.0, -1, -1)):
        self.env, self.capacity, self.pools = env, capacity, pools
        # (S bytes/s, where the copies' host-memory bytes are drawn, the CPU kernels' cap):
        # CPU flows beside copies of D bytes/s are capped at S / (S + D) of their speed
        # (ResourceUse.dma_slowdown_bps)
        self.slowdown_bps, self.copy_traffic, self.kernel_dram = dma_slowdown
        self.flows: list[Flow] = []
        self.load = [0.0] * len(capacity)
        self.running = {"cpu": 0, "copy": 0}  # CPU flows, and copies drawing on copy_traffic
        self.pool_threads = dict.fromkeys(pools, 0.0)
        self.slowed = 0
        self.t_last = 0.0
        self.generation = 0
        self.next_flow: Flow | None = None
        self.events = 0

    def start(self, f: Flow) -> None:
        self._advance()
        f.copy_bps = 0.0 if f.pool >= 0 else sum(d for j, d in f.uses if j == self.copy_traffic)
        self.flows.append(f)
        if self.slowed == 0 and self._fits(f):
            f.speed, f.cap, f.cores = 1.0, 1.0, f.threads
            self._add_load(f, 1.0)
        else:
            self._recompute()
        self._schedule()

    def _fits(self, f: Flow) -> bool:
        if f.pool >= 0 and self.pool_threads[f.pool] + f.threads > self.pools[f.pool]:
            return False
        if self.slowdown_bps > 0 and self.running["copy" if f.pool >= 0 else "cpu"] and (
                f.pool >= 0 or f.copy_bps > 0):
            return False  # a CPU flow beside a copy: both kinds slow it (_slow_cpu_beside_copies)
        cap, load = self.capacity, self.load
        return all(load[j] + d <= cap[j] * (1 + REL_EPS) for j, d in f.uses)

    def _add_load(self, f: Flow, sign: float) -> None:
        for j, d in f.uses:
            self.load[j] += sign * d * f.speed
        if f.pool >= 0:
            self.pool_threads[f.pool] += sign * f.threads
            self.running["cpu"] += int(sign)
        elif f.copy_bps > 0:
            self.running["copy"] += int(sign)

    def _slow_cpu_beside_copies(self) -> None:
        """Stage 3 of resources.py: the CPU flows' ceilings and the CPU kernels' cap times k, at
        the k where k = S / (S + D(k)), D(k) the copies' bytes/s that stage 2 gives at k. The
        root lies in [S / (S + the copies at full speed), 1] (h(k) = k - S / (S + D(k)) is <= 0
        at the low end, >= 0 at 1); found by regula falsi (Illinois), each step one fill, to
        SLOWDOWN_TOL in k (a plain iteration can crawl: ~0.9 a step where host.mem binds)."""
        cpu = [f for f in self.flows if f.pool >= 0]
        copies = [(f, f.copy_bps) for f in self.flows if f.copy_bps > 0]
        if not cpu or not copies:
            return
        ceilings, capacity, s_bps = [f.cap for f in cpu], list(self.capacity), self.slowdown_bps

        def h(k: float) -> float:  # fills at k; > 0: k too large for the copies it lets run
            for f, c in zip(cpu, ceilings, strict=True):
                f.cap = c * k
            capacity[self.kernel_dram] = self.capacity[self.kernel_dram] * k
            fill_speeds(self.flows, capacity)
            return k - s_bps / (s_bps + sum(f.speed * b for f, b in copies))

        lo = s_bps / (s_bps + sum(b for _, b in copies))
        hi, h_hi = 1.0, 1.0 - s_bps / (s_bps + sum(f.speed * b for f, b in copies))  # filled
        if h_hi <= SLOWDOWN_TOL:  # the copies starved at k = 1 (stage 2 as it stands)
            return
        h_lo = h(lo)
        if h_lo >= 0:
            return  # the copies at full speed: k = lo, filled
        side = 0
        for _ in range(SLOWDOWN_FILLS):
            k = hi - h_hi * (hi - lo) / (h_hi - h_lo)
            h_k = h(k)
            if abs(h_k) <= SLOWDOWN_TOL or hi - lo <= SLOWDOWN_TOL:
                return
            if h_k > 0:
                hi, h_hi = k, h_k
                h_lo, side = (h_lo / 2, side) if side == 1 else (h_lo, 1)
            else:
                lo, h_lo = k, h_k
                h_hi, side = (h_hi / 2, side) if side == -1 else (h_hi, -1)
        raise RuntimeError(f"the copies' slowdown of the CPU flows did not settle in "
                           f"{SLOWDOWN_FILLS} fills (k in [{lo:.9f}, {hi:.9f}])")

    def _recompute(self) -> None:
        allocate_cores(self.flows, self.pools)
        fill_speeds(self.flows, self.capacity)
        if self.slowdown_bps > 0:
            self._slow_cpu_beside_copies()
        self.load = [0.0] * len(self.capacity)
        self.running = {"cpu": 0, "copy": 0}
        self.pool_threads = dict.fromkeys(self.pools, 0.0)
        self.slowed = 0
        for f in self.flows:
            self._add_load(f, 1.0)
            if f.speed < 1.0 - REL_EPS:
                self.slowed += 1

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
    share = FluidShare(env, use.capacity.tolist(), pools,
                       (use.dma_slowdown_bps, use.copy_traffic, use.kernel_dram))
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
            if specs is None or d <= 0 or not (specs[v][0] or specs[v][1] >= 0):
                yield env.timeout(d)
            else:
                uses, pool, curve, weight = specs[v]
                f = Flow(v, d, uses, threads[v] if pool >= 0 else 0.0, curve, pool, weight=weight)
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
