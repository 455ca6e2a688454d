"""The analytic prediction of one steady-state step: lower bound, critical path, C / H / E, traffic.

    lower bound    max over resources j of W_j / beta_j, and over serial agents of their busy time
    critical path  f(v) over STEADY_ITERATIONS iterations; the step is the distance between the
                   finish of the last two iterations (the first one carries start-up)
    step time      max(lower bound, critical-path step)
    C              GPU compute per step (the busiest rank's compute stream)
    H              the busiest non-compute resource or agent per step (host work, PCIe, fabric)
    E              step - max(C, H): the exposed remainder that neither hides
    gpu_idle_s     per rank, step - that rank's compute (model/idle.py)
    R_cross        C(1) / H with C(1) = R * C: the GPU count at which a fixed global batch turns
                   host-bound (method.md section 5)
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import numpy as np

from slidedp.graph.build import build_graph
from slidedp.graph.costs import resource_use, task_durations
from slidedp.graph.kinds import KINDS
from slidedp.graph.tasks import Kind, TaskGraph
from slidedp.model.bounds import resource_bound
from slidedp.model.critical_path import longest_path
from slidedp.model.idle import gpu_idle_s
from slidedp.model.memory import check_fits, gpu_footprint, host_footprint
from slidedp.model.traffic import graph_traffic_bytes
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

STEADY_ITERATIONS = 3


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    lower_bound_s: float
    critical_path_s: float
    tokens_per_s: float
    bottleneck: str
    bottleneck_utilization: float
    compute_s: float
    host_s: float
    host_resource: str
    exposed_s: float
    gpu_idle_s: list[float]
    r_cross: float
    busy_s: dict[str, float]
    critical_path_by_channel_s: dict[str, float]
    traffic_bytes: dict[str, float]
    memory: dict[str, float]
    gpu_memory_terms: dict[str, float]
    host_memory_terms: dict[str, float]
    n_tasks: int
    n_edges: int
    elapsed_s: float

    @property
    def bound_by(self) -> str:
        return "gpu" if self.compute_s >= self.host_s else "host"

    def limiter(self) -> str:
        """One plain-words sentence on what limits the step."""
        if self.bound_by == "gpu":
            s = (f"GPU-bound: {self.compute_s:.3f} s of compute per step hides the host work "
                 f"(busiest: {self.host_resource}, {self.host_s:.3f} s)")
        else:
            s = (f"host-bound: {self.host_resource} needs {self.host_s:.3f} s per step against "
                 f"{self.compute_s:.3f} s of GPU compute; saving d s there saves "
                 f"min(d, {self.host_s - self.compute_s:.3f}) s")
        if self.exposed_s > 0.02 * self.step_time_s:
            cp = {k: v for k, v in self.critical_path_by_channel_s.items() if k != "COMPUTE"}
            worst = max(cp, key=cp.get) if cp else "none"
            s += f"; {self.exposed_s:.3f} s exposed, mostly waiting on {worst}"
        return s + "."

    def to_json(self) -> dict:
        d = asdict(self)
        d["bound_by"] = self.bound_by
        d["limiter"] = self.limiter()
        return d


def step_saving_s(delta_s: float, host_s: float, compute_s: float) -> float:
    """Step time saved by removing delta_s of host work: min(delta_H, H - C), never negative."""
    return max(0.0, min(delta_s, host_s - compute_s))


def agent_busy_s(g: TaskGraph, durations: np.ndarray, iteration: int) -> dict[str, float]:
    m = g.iteration == iteration
    busy = np.bincount(g.agent[m], weights=durations[m], minlength=len(g.agents))
    return {f"agent:{a}": float(b) for a, b in zip(g.agents, busy, strict=True)}


@dataclass(frozen=True)
class GraphBounds:
    """The analytic figures of one task graph: per-resource / per-agent busy seconds of its last
    iteration, their maximum (the lower bound), the longest-path schedule, each iteration's end,
    and the critical-path step (the distance between the last two ends; the makespan of a
    one-iteration graph)."""

    busy_s: dict[str, float]
    lower_bound_s: float
    bottleneck: str
    schedule: object  # critical_path.Schedule
    ends_s: list[float]
    critical_path_s: float


def graph_bounds(g: TaskGraph, durations: np.ndarray, use) -> GraphBounds:
    """Lower bound and critical-path step of `g` (module docstring); shared with the simulator."""
    last = g.n_iterations - 1
    busy = {**resource_bound(g, use, last).busy_s, **agent_busy_s(g, durations, last)}
    bottleneck = max(busy, key=busy.get)
    sched = longest_path(g, durations)
    ends = [float(sched.finish_s[g.iteration == t].max()) for t in range(g.n_iterations)]
    step = ends[-1] - ends[-2] if len(ends) > 1 else ends[-1]
    return GraphBounds(busy, busy[bottleneck], bottleneck, sched, ends, step)


def predict(hw: HardwareSpec, wl: Workload, plan: Plan) -> Prediction:
    """Check memory, build the graph, evaluate bounds and the recurrence (see module docstring)."""
    t0 = time.perf_counter()
    gpu_bytes, host_bytes = check_fits(hw, wl, plan)
    g = build_graph(wl, plan, hw.host.cores, iterations=STEADY_ITERATIONS)
    d = task_durations(g, hw, wl)
    use = resource_use(g, hw, d)
    last = STEADY_ITERATIONS - 1
    gb = graph_bounds(g, d, use)
    busy, lower, bottleneck = gb.busy_s, gb.lower_bound_s, gb.bottleneck
    sched, ends, cp_step = gb.schedule, gb.ends_s, gb.critical_path_s
    step = max(lower, cp_step)

    compute_keys = [k for k in busy if k.endswith(".compute")]
    c = max(busy[k] for k in compute_keys)
    host_items = {k: v for k, v in busy.items() if k not in compute_keys}
    host_res = max(host_items, key=host_items.get)
    h = host_items[host_res]

    # time on the critical path inside the last iteration's window, by channel
    end_task = int(np.flatnonzero(g.iteration == last)[np.argmax(sched.finish_s[g.iteration == last])])
    by_channel: dict[str, float] = {}
    for v in sched.critical_path(end_task):
        lo = max(sched.start_s[v], ends[-2])
        if sched.finish_s[v] > lo:
            ch = KINDS[Kind(int(g.kind[v]))].channel.name
            by_channel[ch] = by_channel.get(ch, 0.0) + float(sched.finish_s[v] - lo)

    traffic = graph_traffic_bytes(g, last)
    return Prediction(
        step_time_s=step, lower_bound_s=lower, critical_path_s=cp_step,
        tokens_per_s=wl.tokens_per_step / step, bottleneck=bottleneck,
        bottleneck_utilization=busy[bottleneck] / step, compute_s=c, host_s=h,
        host_resource=host_res, exposed_s=max(0.0, step - max(c, h)),
        gpu_idle_s=gpu_idle_s(step, busy, wl.gpus),
        r_cross=(wl.gpus * c) / h if h > 0 else float("inf"), busy_s=busy,
        critical_path_by_channel_s=by_channel,
        traffic_bytes=traffic,
        memory={"gpu_peak_bytes": gpu_bytes, "host_bytes": host_bytes},
        gpu_memory_terms=gpu_footprint(wl, plan), host_memory_terms=host_footprint(wl, plan),
        n_tasks=g.n_tasks, n_edges=g.n_edges, elapsed_s=time.perf_counter() - t0,
    )
