"""Entry points: simulate a (hardware, workload, plan), or any task graph with its durations.

simulate() builds the same task graph as the analytic model (slidedp.graph.build_graph), the same
durations and resource draws (slidedp.graph.costs), runs the engine and returns a SimResult that
also carries the analytic lower bound and critical path of that very graph.
"""

from __future__ import annotations

import numpy as np

from slidedp.graph.build import build_graph
from slidedp.graph.costs import resource_use, task_durations
from slidedp.graph.tasks import TaskGraph
from slidedp.model.memory import check_fits
from slidedp.model.predict import graph_bounds
from slidedp.sim.engine import SimConfig, run_graph
from slidedp.sim.result import SimResult
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import ParamRoute, Plan, UpdateSharding
from slidedp.spec.workload import Workload


def check_routes(wl: Workload, plan: Plan, explicit: set[str], where: str = "command line") -> None:
    """Reject explicitly asked routes the topology cannot run: GPU-fabric routes need >= 2 GPUs.

    Only fields in `explicit` are checked: the default plan of a fabric (sharded upload on
    NVLink) quietly degenerates to the single-GPU path when one GPU is used.
    """
    if wl.gpus > 1:
        return
    fabric_routes = {"param_route": plan.param_route == ParamRoute.SHARDED,
                     "update_sharding": plan.update_sharding == UpdateSharding.SHARDED}
    for name, bad in fabric_routes.items():
        if bad and name in explicit:
            raise SpecError(where, f"--{name.replace('_', '-')}",
                            f"a single-GPU route with 1 GPU ({getattr(plan, name)} needs >= 2 "
                            "GPUs joined by a GPU fabric)")


def analytic(g: TaskGraph, durations: np.ndarray, use) -> dict[str, float]:
    """The analytic model's lower bound and critical-path step on the same graph (a one-iteration
    graph: its makespan)."""
    gb = graph_bounds(g, durations, use)
    return {"lower_bound_s": gb.lower_bound_s, "critical_path_s": gb.critical_path_s,
            "makespan_s": gb.ends_s[-1]}


def simulate_graph(g: TaskGraph, hw: HardwareSpec, durations: np.ndarray, cfg: SimConfig,
                   tokens_per_step: int = 0) -> SimResult:
    """Simulate any task graph (synthetic ones included) with the given per-task durations."""
    use = resource_use(g, hw, durations)
    run = run_graph(g, durations, use, hw, cfg)
    return SimResult(g, durations, use, run, cfg, tokens_per_step, analytic(g, durations, use))


def simulate(hw: HardwareSpec, wl: Workload, plan: Plan, cfg: SimConfig | None = None,
             check_memory: bool = True) -> SimResult:
    """Check memory, build the graph of cfg.iterations steps and simulate it."""
    cfg = cfg or SimConfig()
    if check_memory:
        check_fits(hw, wl, plan)
    g = build_graph(wl, plan, hw.host.cores, iterations=cfg.iterations)
    return simulate_graph(g, hw, task_durations(g, hw, wl), cfg, wl.tokens_per_step)
