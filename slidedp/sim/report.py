"""A SimResult as predict-compatible JSON and as a text table (for `slidedp simulate`).

The JSON has every key of `slidedp predict --json`, with the simulated value where the simulator
measures it (step time, tokens/s, bottleneck, C, H, exposed_s = step - max(C, H), busy_s, critical
path by channel), plus: analytic (the model's step, lower bound and critical path on the same
graph), step_times_s and steady_iterations, exposed_by_channel_s (the critical rank's compute idle
by the channel waited on), gpu_idle_s (per rank, model/idle.py), exposed_by_rank_s, channel_busy_s, utilization per resource, events,
events_per_s, sim_wall_s, config.
"""

from __future__ import annotations

from dataclasses import asdict

from slidedp.model.idle import gpu_idle_s
from slidedp.model.memory import gpu_footprint, host_footprint
from slidedp.model.traffic import graph_traffic_bytes
from slidedp.sim.result import SimResult
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload


def to_json(res: SimResult, wl: Workload, plan: Plan) -> dict:
    step, c = res.step_time_s, res.compute_s
    host_res, h = res.host
    bottleneck, util = res.bottleneck
    gpu, hostm = gpu_footprint(wl, plan), host_footprint(wl, plan)
    d = {
        "step_time_s": step, "lower_bound_s": res.analytic["lower_bound_s"],
        "critical_path_s": res.analytic["critical_path_s"], "tokens_per_s": res.tokens_per_s,
        "bottleneck": bottleneck, "bottleneck_utilization": util, "compute_s": c, "host_s": h,
        "host_resource": host_res, "exposed_s": res.exposed_s,
        "gpu_idle_s": gpu_idle_s(step, res.busy_s, res.graph.n_ranks),
        "r_cross": wl.gpus * c / h if h > 0 else float("inf"), "busy_s": res.busy_s,
        "critical_path_by_channel_s": res.critical_path_by_channel_s,
        "traffic_bytes": graph_traffic_bytes(res.graph, res.graph.n_iterations - 1),
        "memory": {"gpu_peak_bytes": sum(gpu.values()), "host_bytes": sum(hostm.values())},
        "gpu_memory_terms": gpu, "host_memory_terms": hostm,
        "n_tasks": res.graph.n_tasks, "n_edges": res.graph.n_edges, "elapsed_s": res.run.wall_s,
        "bound_by": "gpu" if c >= h else "host",
        "analytic": {"step_time_s": res.analytic_step_s,
                     **res.analytic},
        "step_times_s": res.step_times_s, "steady_iterations": res.steady_iterations,
        "exposed_by_channel_s": res.exposed_by_channel_s, "critical_rank": res.critical_rank,
        "exposed_by_rank_s": res.exposed_by_rank, "channel_busy_s": res.channel_busy_s,
        "utilization": res.utilization, "events": res.run.events,
        "events_per_s": res.events_per_s, "sim_wall_s": res.run.wall_s,
        "config": asdict(res.config),
    }
    d["limiter"] = limiter(d)
    return d


def limiter(d: dict) -> str:
    """One sentence on what limits the simulated step, and what the GPU waits for."""
    if d["bound_by"] == "gpu":
        s = (f"GPU-bound: {d['compute_s']:.3f} s of compute per step hides the host work "
             f"(busiest: {d['host_resource']}, {d['host_s']:.3f} s)")
    else:
        s = (f"host-bound: {d['host_resource']} busy {d['host_s']:.3f} s per step against "
             f"{d['compute_s']:.3f} s of GPU compute")
    exp = {k: v for k, v in d["exposed_by_channel_s"].items() if v > 0}
    if exp:
        worst = max(exp, key=exp.get)
        s += (f"; rank {d['critical_rank']}'s GPU idles {sum(exp.values()):.3f} s, most waiting on "
              f"{worst} ({exp[worst]:.3f} s)")
    return s + "."


def format_table(d: dict) -> str:
    a = d["analytic"]
    steady = ", ".join(f"{t:.3f}" for t in d["step_times_s"])
    rows = [
        ("step time (simulated)", f"{d['step_time_s']:.3f} s  (steps after iteration 0: {steady})"),
        ("  analytic step / bound / path", f"{a['step_time_s']:.3f} / {a['lower_bound_s']:.3f} / "
                                           f"{a['critical_path_s']:.3f} s"),
        ("tokens/s", f"{d['tokens_per_s']:,.0f}"),
        ("bottleneck", f"{d['bottleneck']} ({100 * d['bottleneck_utilization']:.0f}% busy)"),
        ("C  GPU compute / step", f"{d['compute_s']:.3f} s"),
        ("H  busiest other / step", f"{d['host_s']:.3f} s ({d['host_resource']})"),
        ("E  step - max(C, H)", f"{d['exposed_s']:.3f} s"),
    ]
    exp = ", ".join(f"{k.lower()} {v:.3f}" for k, v in sorted(d["exposed_by_channel_s"].items(),
                                                              key=lambda kv: -kv[1]) if v > 0)
    rows.append((f"GPU idle by channel (rank {d['critical_rank']}, s)", exp or "none"))
    util = ", ".join(f"{k} {100 * v:.0f}%" for k, v in sorted(d["utilization"].items(),
                                                            key=lambda kv: -kv[1])[:6])
    rows.append(("utilization (top 6)", util))
    cp = ", ".join(f"{k.lower()} {v:.3f}" for k, v in sorted(
        d["critical_path_by_channel_s"].items(), key=lambda kv: -kv[1]))
    rows.append(("critical chain by channel (s)", cp))
    w = max(len(x) for x, _ in rows)
    return "\n".join(f"{x:<{w}}  {y}" for x, y in rows) + "\n" + d["limiter"]
