"""The inter-node tasks in the graph, their NIC in the cost model and the simulator, and the
network's spec and options (graph/features/internode.py, graph/nic.py, spec/network.py)."""

import re
from dataclasses import replace

import numpy as np
import pytest

from slidedp import cli
from slidedp.graph.build import build_graph
from slidedp.graph.costs import resource_use, task_durations
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.model.predict import predict
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import load_hardware, parse_hardware, preset_dir
from slidedp.spec.model import load_model
from slidedp.spec.network import NetworkSpec
from slidedp.spec.plan import Plan
from slidedp.spec.tomlio import read_toml
from slidedp.spec.units import GB
from slidedp.spec.workload import Workload

HW = load_hardware("h200x8")


def wl(nodes: int, gpus: int = 2) -> Workload:
    return Workload(load_model("qwen3-0.6b"), 512, 2 * gpus * nodes, 2, gpus, nodes=nodes)


def on(hw, nodes: int, gbps: float = 50.0, latency_us: float = 5.0):
    return replace(hw, network=NetworkSpec(nodes=nodes, nic_bps=gbps * GB,
                                           nic_latency_s=latency_us * 1e-6))


def edges_into(g, v, kind=EdgeKind.DATA):
    return set(g.edge_src[(g.edge_dst == v) & (g.edge_kind == int(kind))].tolist())


def test_one_node_adds_nothing():
    g = build_graph(wl(1), Plan(), 64)
    assert not np.isin(g.kind, [int(Kind.NODE_REDUCE), int(Kind.NODE_GATHER)]).any()
    assert not any(a.startswith("nic") for a in g.agents)
    assert "nic" not in resource_use(g, HW, task_durations(g, HW, wl(1))).names


@pytest.mark.parametrize("plan", [Plan(), Plan(grad_route="cpu", update_sharding="sharded"),
                                  Plan(defer_update=True, clip_schedule="joined")],
                         ids=["gpu", "cpu-sharded", "defer"])
def test_all_reduce_puts_one_node_reduce_between_each_chunk_and_its_adam(plan):
    g = build_graph(wl(2), plan, 64)
    adams = np.flatnonzero(g.kind == int(Kind.ADAM))
    nrs = np.flatnonzero(g.kind == int(Kind.NODE_REDUCE))
    assert len(adams) == len(nrs) > 0
    wire = g.meta.grad_wire_bytes
    for a in adams.tolist():
        mine = [v for v in edges_into(g, a) if g.kind[v] == Kind.NODE_REDUCE
                and (g.elem_lo[v], g.elem_hi[v], g.unit[v]) == (g.elem_lo[a], g.elem_hi[a],
                                                               g.unit[a])]
        assert len(mine) == 1, g.label(a)
        v = mine[0]
        assert g.work[v] == (g.elem_hi[v] - g.elem_lo[v]) * wire
        assert g.agents[g.agent[v]].startswith("nic")
        producers = {int(g.kind[p]) for p in edges_into(g, v)}
        assert producers <= {int(Kind.D2H), int(Kind.HOST_SUM)} and producers
    if plan.defer_update:  # the first ADAM reads the norm of every reduced chunk
        first = int(adams[0])
        of_t0 = set(nrs[g.iteration[nrs] == g.iteration[first]].tolist())
        assert of_t0 and of_t0 <= edges_into(g, first)


def test_reduce_scatter_updates_a_kth_and_gathers_the_weights_before_the_next_delivery():
    plan = Plan(internode_reduce="reduce_scatter")
    g2, g1 = build_graph(wl(2), plan, 64), build_graph(wl(1), plan, 64)
    work = {n: float(g.work[g.kind == int(Kind.ADAM)].sum()) for n, g in ((2, g2), (1, g1))}
    assert work[2] == pytest.approx(work[1] / 2, rel=1e-3)
    gathers = np.flatnonzero(g2.kind == int(Kind.NODE_GATHER))
    assert len(gathers) == (g2.kind == int(Kind.ADAM)).sum()
    assert all(g2.work[v] == (g2.elem_hi[v] - g2.elem_lo[v]) * 2 for v in gathers)
    gated = g2.edge_gate & np.isin(g2.edge_src, gathers)
    assert gated.any() and not (g2.edge_gate & (g2.kind[g2.edge_src] == int(Kind.ADAM))).any()


def test_node_collective_time_is_the_ring_formula_and_loads_the_nic():
    hw = on(HW, 4, gbps=10.0, latency_us=20.0)
    w = wl(4)
    g = build_graph(w, Plan(), 64)
    d = task_durations(g, hw, w)
    use = resource_use(g, hw, d)
    nic = use.index("nic")
    for v in np.flatnonzero(g.kind == int(Kind.NODE_REDUCE))[:5].tolist():
        want = 2 * 3 * 20e-6 + g.work[v] * 2 * 3 / 4 / (10.0 * GB)
        assert d[v] == pytest.approx(want, rel=1e-12)
        lo, hi = use.ptr[v], use.ptr[v + 1]
        assert list(use.res[lo:hi]) == [nic] and use.amount[lo] == pytest.approx(d[v])


def test_a_slow_nic_is_exposed_and_a_fast_one_hidden():
    w = Workload(load_model("qwen3-8b"), 4096, 4 * 8 * 2, 4, 8, nodes=2)
    one = predict(HW, replace(w, nodes=1, global_batch=32), Plan())
    fast = predict(on(HW, 2, 50.0), w, Plan())
    slow = predict(on(HW, 2, 2.0), w, Plan())
    assert fast.step_time_s == pytest.approx(one.step_time_s, rel=0.02)
    assert slow.step_time_s > 1.5 * one.step_time_s
    res = simulate(on(HW, 2, 2.0), w, Plan())
    assert res.step_time_s == pytest.approx(slow.step_time_s, rel=0.15)
    assert res.utilization["nic"] > 0.9


def test_network_table_and_options_are_checked():
    data = read_toml(preset_dir() / "h200x8.toml")
    for bad, field in (({"nic_gbps": "fast"}, "network.nic_gbps"),
                       ({"nic_gbps": -50.0}, "network.nic_gbps"),
                       ({"nic_kind": "carrier-pigeon"}, "network.nic_kind"),
                       ({"nodes": 0}, "network.nodes"),
                       ({"nic_latency_us": "1"}, "network.nic_latency_us")):
        d = data | {"network": data["network"] | bad}
        with pytest.raises(SpecError) as e:
            parse_hardware(d, "x.toml")
        assert e.value.field == field
    net = HW.network
    for kw, option in (({"nic_gbps": -1.0}, "--nic-gbps"), ({"nic_gbps": 0.0}, "--nic-gbps"),
                       ({"nodes": 0}, "--nodes"), ({"nic_latency_us": -1.0}, "--nic-latency-us"),
                       ({"nic_kind": "udp"}, "--nic-kind")):
        with pytest.raises(SpecError) as e:
            net.with_options(**kw)
        assert e.value.field == option
    assert load_hardware("h200x8").network.nic_bps > 0 and "source" not in net.sources


@pytest.mark.parametrize("argv, want", [
    (["--nic-gbps", "-1"], "--nic-gbps"),
    (["--hardware", "h200x2", "--nodes", "2"], "network.nic_gbps"),
    (["--nodes", "2", "--global-batch", "12"], "global_batch"),
])
def test_bad_network_options_are_one_line_exit_2(argv, want, capsys):
    rc = cli.main(["predict", "--hardware", "h200x8", "--model", "qwen3-0.6b", "--seq", "512",
                   *argv])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and want in err[0], err


def test_predict_and_simulate_take_nodes():
    for verb in ("predict", "simulate"):
        assert cli.main([verb, "--hardware", "a800x8", "--model", "qwen3-0.6b", "--seq", "512",
                         "--nodes", "2", "--nic-gbps", "12.5"]) == 0


def test_presets_name_their_nic_source():
    for name in ("h200x8", "a800x8"):
        net = load_hardware(name).network
        assert net.nic_bps > 0 and re.search(r"\w", net.sources["nic_gbps"])


def test_the_split_clipping_schedule_is_refused_across_nodes():
    with pytest.raises(SpecError, match="clip_schedule"):
        build_graph(wl(2), Plan(defer_update=True), 64)
