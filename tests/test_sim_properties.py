"""Simulator invariants on random small graphs and hardware (hypothesis, CI profile)."""

from dataclasses import replace

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from strategies import small_plans, small_workloads

from slidedp.graph.build import build_graph
from slidedp.graph.costs import task_durations
from slidedp.graph.tasks import EdgeKind
from slidedp.model.bounds import resource_bound
from slidedp.model.critical_path import longest_path
from slidedp.sim.engine import SimConfig
from slidedp.sim.simulator import simulate_graph
from slidedp.spec.hardware import load_hardware

PRESETS = {n: load_hardware(n) for n in ("h200x2", "a800x4-nobridge", "rtx4090x4")}


@st.composite
def hardware(draw, copies_slow: bool = False):
    """A preset with its PCIe, DRAM and cores scaled; with `copies_slow`, half the time also a
    profiled all-traffic cap and the copies' slowdown of the CPU kernels (HostSpec.
    dma_slowdown_bps = the teams beside the copies / the weight)."""
    hw = PRESETS[draw(st.sampled_from(sorted(PRESETS)))]
    pcie = draw(st.sampled_from([0.1, 0.5, 1.0, 2.0]))
    dram = draw(st.sampled_from([0.02, 0.2, 1.0]))
    p = hw.pcie
    host = replace(hw.host, dram_bps=hw.host.dram_bps * dram,
                   cores=draw(st.sampled_from([4, 8, hw.host.cores])))
    if copies_slow and draw(st.booleans()):
        memory_bps = host.dram_bps * draw(st.sampled_from([1.0, 1.5, 3.0]))
        host = replace(host, dram_dma=(8, 8, hw.gpu.count, memory_bps),
                       dram_dma_weight=draw(st.sampled_from([0.1, 0.5, 1.0])),
                       dram_dma_teams_bps=host.dram_bps * draw(st.sampled_from([0.05, 0.6])))
    return replace(
        hw, pcie=replace(p, **{k: getattr(p, k) * pcie for k in (
            "h2d_bps", "d2h_bps", "duplex_bps", "all_h2d_bps", "all_d2h_bps", "all_total_bps")}),
        host=host)


def _run(hw, wl, plan, **cfg):
    g = build_graph(wl, plan, hw.host.cores, iterations=3)
    d = task_durations(g, hw, wl)
    return g, d, simulate_graph(g, hw, d, SimConfig(**cfg), wl.tokens_per_step)


def _without_buffers(g):
    keep = g.edge_kind != int(EdgeKind.BUFFER)
    return replace(g, edge_src=g.edge_src[keep], edge_dst=g.edge_dst[keep],
                   edge_kind=g.edge_kind[keep], edge_gate=g.edge_gate[keep])


@given(hardware(), small_workloads(max_gpus=3), small_plans())
def test_no_contention_is_exactly_the_critical_path(hw, wl, plan):
    g, d, res = _run(hw, wl, plan, contention=False)
    assert np.array_equal(res.run.finish_s, longest_path(g, d).finish_s)
    assert res.step_time_s == res.analytic["critical_path_s"]
    _, _, off = _run(hw, wl, plan, contention=False, buffers=False)
    assert np.array_equal(off.run.finish_s, longest_path(_without_buffers(g), d).finish_s)


@given(hardware(copies_slow=True), small_workloads(max_gpus=3), small_plans())
def test_contention_never_beats_the_analytic_model(hw, wl, plan):
    g, d, res = _run(hw, wl, plan)
    cp = longest_path(g, d)
    assert np.all(res.run.finish_s >= cp.finish_s * (1 - 1e-9))
    # every resource's work over all iterations fits in the makespan
    busy = sum(np.array(list(resource_bound(g, res.use, t).busy_s.values())) for t in range(3))
    assert res.run.finish_s.max() >= busy.max() * (1 - 1e-9)
    # (per-step differences of iteration ends are not bounded this way on tiny graphs: iterations
    # overlap, so one step's work may run inside the previous step's window; see test below)
    # exposure covers exactly the idle time of each rank's compute stream
    for r in range(g.n_ranks):
        comp = g.agent_tasks[g.agents.index(f"gpu{r}.compute")]
        idle = res.run.finish_s.max() - (res.run.finish_s[comp] - res.run.start_s[comp]).sum()
        exposed = sum(e.end_s - e.start_s for e in res.exposures if e.rank == r)
        assert np.isclose(exposed, idle, rtol=1e-9, atol=1e-12)


@given(hardware(), small_workloads(max_gpus=3), small_plans(), st.sampled_from(["pcie", "dram", "cores", "slots"]))
def test_more_capacity_never_slower(hw, wl, plan, knob):
    _, _, base = _run(hw, wl, plan)
    if knob == "pcie":
        more = replace(hw, pcie=replace(hw.pcie, all_h2d_bps=hw.pcie.all_h2d_bps * 2,
                                        all_d2h_bps=hw.pcie.all_d2h_bps * 2,
                                        all_total_bps=hw.pcie.all_total_bps * 2))
        _, _, res = _run(more, wl, plan)
    elif knob == "dram":
        _, _, res = _run(replace(hw, host=replace(hw.host, dram_bps=hw.host.dram_bps * 2)), wl, plan)
    elif knob == "cores":
        more = replace(hw, host=replace(hw.host, cores=hw.host.cores * 2))
        g = build_graph(wl, plan, hw.host.cores, iterations=3)  # same threads, bigger pool
        res = simulate_graph(g, more, task_durations(g, more, wl), SimConfig(), wl.tokens_per_step)
    else:
        _, _, res = _run(hw, wl, replace(plan, staging_chunks=plan.staging_chunks + 1,
                                         d2h_staging_chunks=plan.d2h_staging_chunks + 1))
    assert res.run.finish_s.max() <= base.run.finish_s.max() * (1 + 1e-9)


@given(hardware(), small_workloads(max_gpus=2), small_plans())
def test_same_input_same_output(hw, wl, plan):
    _, _, a = _run(hw, wl, plan)
    _, _, b = _run(hw, wl, plan)
    assert np.array_equal(a.run.finish_s, b.run.finish_s) and a.exposures == b.exposures


def test_step_time_at_least_bound_and_path_on_presets():
    from slidedp.sim.simulator import simulate
    from slidedp.spec.model import load_model
    from slidedp.spec.plan import default_plan
    from slidedp.spec.workload import Workload

    for name, gpus in (("h200x2", 2), ("a800x4", 4), ("rtx4090x4", 4)):
        hw = PRESETS.get(name) or load_hardware(name)
        res = simulate(hw, Workload(load_model("qwen3-1.7b"), 4096, gpus, 1, gpus),
                       default_plan(hw.fabric.kind))
        assert res.step_time_s >= res.analytic["lower_bound_s"]
        assert res.step_time_s >= res.analytic["critical_path_s"]
