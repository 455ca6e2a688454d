"""The analytic model: traffic formulas, bounds vs critical path, monotonicity, exact cases, purity."""

import dataclasses
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st
from isolation import run_without
from strategies import small_plans, small_workloads

from slidedp.graph import build_graph
from slidedp.graph.costs import resource_use, task_durations
from slidedp.model.bounds import resource_bound
from slidedp.model.critical_path import longest_path
from slidedp.model.predict import agent_busy_s, predict, step_saving_s
from slidedp.model.traffic import deliveries_per_iteration, graph_traffic_bytes, layer_traffic_bytes
from slidedp.spec.hardware import hardware_presets, load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import GradRoute, GradWiden, ParamRoute, Plan, default_plan
from slidedp.spec.workload import Workload

# the flat reading of h200x2 (one socket, one switch: graph/flat_host.py's resources, host.dram
# and the rest), whose formulas these tests check by hand; the topology's machine has its own
# (test_topology_host.py)
H200 = dataclasses.replace(load_hardware("h200x2"), explicit_topology=None)


def scaled(hw, factor: float, *, cores: int | None = None):
    """Every rate of the hardware multiplied by `factor` (and optionally more cores)."""
    pcie = dataclasses.replace(hw.pcie, **{f: getattr(hw.pcie, f) * factor for f in
                                           ("h2d_bps", "d2h_bps", "duplex_bps", "all_h2d_bps",
                                            "all_d2h_bps", "all_total_bps")})
    host = dataclasses.replace(hw.host, dram_bps=hw.host.dram_bps * factor,
                               cast_elems_per_s=hw.host.cast_elems_per_s.scaled(factor),
                               adam_params_per_s=hw.host.adam_params_per_s.scaled(factor),
                               cores=cores or hw.host.cores, ram_bytes=hw.host.ram_bytes * 100)
    gpu = dataclasses.replace(hw.gpu, count=8, hbm_bps=hw.gpu.hbm_bps * factor, layer_times=(),
                              achieved=tuple((h, t, r * factor) for h, t, r in hw.gpu.achieved),
                              peak_bf16_flops=hw.gpu.peak_bf16_flops * factor)
    fabric = dataclasses.replace(hw.fabric, link_bps=hw.fabric.link_bps * factor,
                                 cross_pair_bps=hw.fabric.cross_pair_bps * factor)
    return dataclasses.replace(hw, pcie=pcie, host=host, gpu=gpu, fabric=fabric)


@pytest.mark.parametrize("route", list(ParamRoute))
@pytest.mark.parametrize("grad", list(GradRoute))
@pytest.mark.parametrize("ranks", [1, 2, 3])
@pytest.mark.parametrize("widen", list(GradWiden))
def test_traffic_matches_method_section_3(route, grad, ranks, widen):
    m = load_model("tiny-qwen3")
    wl = Workload(m, 32, 2 * ranks, 2, ranks)
    plan = Plan(param_route=route, grad_route=grad, h2d_chunk_mib=0.01, d2h_chunk_mib=0.01,
                grad_widen=widen)
    g = build_graph(wl, plan, cores=8, iterations=1)
    for u, p in enumerate(g.unit_params):
        got = graph_traffic_bytes(g, 0, u)
        n = deliveries_per_iteration(g, 0, u)
        want = layer_traffic_bytes(p, ranks, plan)
        # BF16 up; back BF16 (widened by the update) or FP32 (widened on the GPU; the host sum
        # of the cpu route adds FP32)
        summed = grad == "cpu" and ranks > 1
        q, grad_b = 2 * p, (2 if widen == "host" and not summed else 4) * p
        # the closed forms of method.md section 3, written out
        assert want["h2d"] == (q if (route == "sharded" and ranks > 1) else ranks * q)
        assert want["d2h"] == (grad_b if (grad == "gpu" or ranks == 1) else ranks * grad_b)
        assert got["h2d"] == n * want["h2d"]
        assert got["allgather"] == n * want["allgather"]
        assert got["d2h"] == want["d2h"]
        assert got["reduce"] == want["reduce"]


@given(small_workloads(), small_plans())
def test_lower_bound_below_critical_path(wl, plan):
    g = build_graph(wl, plan, cores=16, iterations=2)
    d = task_durations(g, H200, wl)
    sched = longest_path(g, d)
    it1 = g.iteration == 1
    # any single iteration's span is at least its busiest serial agent (all its work lies inside
    # it, one task at a time). Not so for the shared resources of resource_bound (host.dram, ...):
    # the recurrence does not share them, which is why predict takes max(lower bound, path).
    span = sched.finish_s[it1].max() - sched.start_s[it1].min()
    assert max(agent_busy_s(g, d, 1).values()) <= span * (1 + 1e-9) + 1e-12
    rb = resource_bound(g, resource_use(g, H200, d), 1)
    assert rb.lower_bound_s >= max(agent_busy_s(g, d, 1)[f"agent:gpu{r}.compute"]
                                   for r in range(wl.gpus)) * (1 - 1e-9)


@given(small_workloads(), small_plans(), st.sampled_from([1.5, 2.0, 10.0]))
def test_more_bandwidth_or_cores_never_slower(wl, plan, factor):
    base = scaled(H200, 1.0)
    faster = scaled(H200, factor, cores=64)
    a = predict(base, wl, plan).step_time_s
    b = predict(faster, wl, plan).step_time_s
    assert b <= a * (1 + 1e-9)


def test_gpu_bound_exact_case():
    """Host rates x1e6: the step is exactly the compute stream's work, hand-summed."""
    wl = Workload(load_model("tiny-qwen3"), 64, 2, 1, 1)
    hw = scaled(H200, 1.0)
    fast = dataclasses.replace(scaled(hw, 1e6), gpu=hw.gpu)
    pred = predict(fast, wl, Plan(window_slots=2))
    m = wl.model
    rate = hw.gpu.achieved_flops(m.hidden, wl.tokens_per_micro_batch)
    f, hf = m.layer_flops_per_token(64), m.head_flops_per_token()
    tok = wl.tokens_per_gpu_step
    compute = (m.n_layers * (f["fwd"] + f["recompute"] + f["bwd"]) + hf["fwd"] + hf["bwd"]) * tok / rate
    compute += 2 * tok * m.hidden * 2 / hw.gpu.hbm_bps  # embedding fwd + bwd, memory-bound
    assert pred.compute_s == pytest.approx(compute, rel=1e-12)
    assert pred.step_time_s == pytest.approx(compute, rel=1e-3)
    assert pred.bound_by == "gpu"


@pytest.mark.parametrize("widen, wire", [(GradWiden.HOST, 2), (GradWiden.GPU, 4)])
def test_host_dram_work_hand_computed(widen, wire):
    """W(host.dram) = DMA bytes + cast 6 B/elem per delivery + Adam 24 B/param + its gradient
    read (2 B BF16, 4 B FP32), summed by hand."""
    m = load_model("tiny-qwen3")
    wl = Workload(m, 64, 1, 1, 1)
    plan = Plan(window_slots=2, grad_widen=widen)
    g = build_graph(wl, plan, cores=8, iterations=1)
    d = task_durations(g, H200, wl)
    rb = resource_bound(g, resource_use(g, H200, d), 0)
    n = m.total_params()
    L, W = m.n_layers, 2
    layers_again = max(0, L - W) * m.layer_params()  # re-uploaded in backward
    uploads = n + layers_again
    dram = uploads * 2 + n * wire + uploads * 6 + n * (24 + wire)
    # the DRAM rate the graph's 6-thread teams reach (cores 8 - 8 // 4): the measured kernels'
    # traffic at 6 threads, below the host's peak
    h = H200.host
    team_bps = max(h.adam_rate(6) * 28, h.cast_rate(6) * 6)
    assert team_bps < h.dram_bps
    assert rb.busy_s["host.dram"] == pytest.approx(dram / team_bps, rel=1e-12)


def test_team_dram_rate_is_the_peak_for_large_teams():
    """Teams of every core reach the host's measured peak (the cap never exceeds dram_bps)."""
    h = H200.host
    assert h.team_dram_bps(h.cores) == h.dram_bps
    assert h.team_dram_bps(1) == pytest.approx(max(h.adam_rate(1) * 28, h.cast_rate(1) * 6))


def test_saving_rule():
    assert step_saving_s(0.5, host_s=2.0, compute_s=1.0) == 0.5
    assert step_saving_s(3.0, host_s=2.0, compute_s=1.0) == 1.0
    assert step_saving_s(1.0, host_s=1.0, compute_s=2.0) == 0.0


@pytest.mark.parametrize("widen, wire", [(GradWiden.HOST, 2), (GradWiden.GPU, 4)])
def test_deferred_update_costs_memory_and_exposes_the_update(widen, wire):
    """defer_update (exact clipping): +~2 (BF16) or ~4 (FP32) B/param of host memory, and the CPU
    update, no longer hidden under backward, adds most of its time to a host-heavy step."""
    wl = Workload(load_model("qwen3-4b"), 4096, 4, 4, 1)
    plain = predict(H200, wl, Plan(grad_widen=widen))
    deferred = predict(H200, wl, Plan(defer_update=True, grad_widen=widen, clip_schedule="joined"))
    n, chunk = wl.model.total_params(), 64 * 2**20  # the gradient in whole 64 MiB chunks
    grown = deferred.memory["host_bytes"] - plain.memory["host_bytes"]
    assert wire * n <= grown + 4 * chunk <= wire * n + len(wl.model.unit_params()) * chunk
    update_s = plain.busy_s["agent:cpu.update0"]
    assert deferred.step_time_s - plain.step_time_s >= 0.7 * update_s
    assert deferred.lower_bound_s == plain.lower_bound_s  # same work, less overlap


def test_strong_scaling_turns_host_bound_near_r_cross():
    m = load_model("qwen3-8b")
    hw = load_hardware("h100x8")
    preds = {R: predict(hw, Workload(m, 4096, 8, 1, R), default_plan("nvswitch")) for R in (1, 2, 4, 8)}
    r_cross = preds[1].r_cross
    for R, p in preds.items():
        assert p.compute_s == pytest.approx(preds[1].compute_s / R, rel=1e-9)
        if r_cross * 0.8 > R:
            assert p.bound_by == "gpu"
        if r_cross * 1.25 < R:
            assert p.bound_by == "host"


@pytest.mark.parametrize("name", hardware_presets())
def test_predict_fast_for_every_preset(name):
    hw = load_hardware(name)
    m = load_model("qwen3-8b" if hw.gpu.hbm_bytes > 30 * 2**30 else "qwen3-1.7b")
    wl = Workload(m, 4096, hw.gpu.count, 1, hw.gpu.count)
    t = time.process_time()
    pred = predict(hw, wl, default_plan(hw.fabric.kind))
    assert time.process_time() - t < 2.0
    assert pred.lower_bound_s <= pred.step_time_s


def test_analytic_model_imports_no_torch_simpy_ortools():
    out = run_without(("torch", "simpy", "ortools"),
                      "import slidedp.model, slidedp.model.predict, slidedp.graph\n"
                      "from slidedp.commands import predict\n")
    assert out.returncode == 0, out.stderr


def test_step_join_costs_what_pipelining_across_steps_would_save():
    """With the executor's join the step is never shorter than under the version gates alone."""
    wl = Workload(load_model("qwen3-4b"), 4096, 4, 4, 1)
    hw = load_hardware("h200x1")
    split = {"cast_threads": 4, "update_threads": 12}  # a slow update: host-heavy
    joined = predict(hw, wl, Plan(step_join=True, **split))
    gated = predict(hw, wl, Plan(step_join=False, **split))
    assert joined.step_time_s >= gated.step_time_s
    assert joined.step_time_s > gated.step_time_s * 1.02  # the join is exposed
