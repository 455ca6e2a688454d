"""The host topology's machine (slidedp/graph/topology.py): every copy, CPU kernel and collective
draws along its path of spec/topology.py, host work follows the host state, a lone flow takes its
tightest link's time; and, in the simulator on random small topologies (hypothesis), adding
capacity to a link never slows a step, no flow exceeds the smallest link on its path, bytes are
conserved per link, and the flat spec equals the one-switch topology."""

from __future__ import annotations

import copy
import json
import tomllib
from dataclasses import replace

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import SRC, small_plans, small_workloads, topologies

from slidedp.cli import main
from slidedp.graph import build_graph
from slidedp.graph.costs import machine_of, resource_use, task_durations
from slidedp.graph.flat_host import FlatHost
from slidedp.graph.kinds import MOVING_KINDS
from slidedp.graph.tasks import COLLECTIVE_OPS, Kind
from slidedp.graph.topology import TopologyHost, hop_fraction, ring_hops
from slidedp.sim import engine
from slidedp.sim.engine import FluidShare, SimConfig
from slidedp.sim.resources import Flow
from slidedp.sim.simulator import simulate_graph
from slidedp.spec.hardware import parse_hardware, preset_dir
from slidedp.spec.model import load_model
from slidedp.spec.plan import GradRoute, ParamRoute, Plan
from slidedp.spec.units import GB
from slidedp.spec.workload import Workload

WL = Workload(load_model("tiny-qwen3"), 64, 4, 1, 4)


def _hardware(memory: str = "interleave", p2p: str = "switch"):
    """Four PCIe GPUs on two sockets: GPUs 0 and 1 under switch 0, GPU 2 under switch 1 (both
    on socket 0), GPU 3 under switch 2 on socket 1; socket DMA caps of 20 GB/s below the 25 GB/s
    links, so a lone copy runs at 20."""
    raw = tomllib.loads((preset_dir() / "h200x2.toml").read_text())
    raw["gpu"]["count"] = 4
    raw["host"] |= {"cores": 16, "ram_gib": 512.0}
    raw["pcie"] |= {"h2d_gbps": 25.0, "d2h_gbps": 25.0, "duplex_gbps": 46.0}
    raw["fabric"] |= {"kind": "pcie", "link_gbps": 22.0, "latency_us": 0.0}
    sock = {"cores": 8, "ram_gib": 256.0, "dram_gbps": 100.0, "dma_h2d_gbps": 20.0,
            "dma_d2h_gbps": 20.0, "dma_duplex_gbps": 30.0, "source": SRC}
    switch = {"h2d_gbps": 25.0, "d2h_gbps": 25.0, "duplex_gbps": 46.0, "source": SRC}
    raw["topology"] = {
        "memory": memory, "socket_link_gbps": 30.0, "source": SRC,
        "socket": [dict(sock), dict(sock)],
        "switch": [switch | {"socket": 0}, switch | {"socket": 0}, switch | {"socket": 1}],
        "gpus": {"switch": [0, 0, 1, 2], "p2p": p2p, "p2p_gbps": 22.0, "source": SRC}}
    return parse_hardware(raw, "four.toml")


def _draws(g, use, v) -> dict[str, float]:
    sl = slice(use.ptr[v], use.ptr[v + 1])
    return {use.names[r]: a for r, a in zip(use.res[sl].tolist(), use.amount[sl].tolist(),
                                            strict=True)}


def _first(g, kind: Kind, **where) -> int:
    m = g.kind == int(kind)
    for field, value in where.items():
        m &= getattr(g, field) == value
    return int(np.flatnonzero(m)[0])


def _use(hw, wl=WL, plan=None):
    g = build_graph(wl, plan or Plan(), hw.host.cores, iterations=1)
    d = task_durations(g, hw, wl)
    return g, d, resource_use(g, hw, d)


def test_the_topology_machine_takes_files_with_a_topology_table():
    hw = _hardware()
    g = build_graph(WL, Plan(), hw.host.cores, iterations=1)
    assert isinstance(machine_of(hw, g), TopologyHost)
    assert isinstance(machine_of(replace(hw, explicit_topology=None), g), FlatHost)


def test_an_upload_crosses_its_path_from_the_units_staging():
    """Rank 3 (socket 1) uploads unit 2, its staging interleaved: half of the bytes from each
    socket's memory, socket 0's half over the socket link, socket 1's DMA cap, switch 2, the
    GPU's link; socket 0's DMA cap not at all."""
    hw = _hardware()
    g, _, use = _use(hw)
    v = _first(g, Kind.H2D, rank=3, unit=2)
    w = g.work[v]
    expect = {h.resource: w * h.share for h in hw.topology.h2d(3, {0: 0.5, 1: 0.5})}
    assert _draws(g, use, v) == pytest.approx(expect, rel=1e-12)
    assert expect["socket0.to1"] == pytest.approx(w / 2) and "socket0.h2d" not in expect
    assert expect["socket1.h2d"] == expect["gpu3.h2d"] == expect["switch2.h2d"] == w


@pytest.mark.parametrize("memory", ["interleave", "shard", "local"])
def test_host_work_runs_where_the_units_state_lies(memory):
    """A CAST of unit u draws cores and memory on the sockets holding u: both halves
    (interleave), socket u mod 2 (shard), socket 0 (local); a CPU kernel never crosses the
    socket link; a D2H writes the gradient ring on the same sockets."""
    hw = _hardware(memory)
    g, _, use = _use(hw)
    for u in (1, 2):
        cast = _draws(g, use, _first(g, Kind.CAST, unit=u))
        where = {"interleave": {0: 0.5, 1: 0.5}, "shard": {u % 2: 1.0}, "local": {0: 1.0}}[memory]
        total = sum(a for n, a in cast.items() if n.endswith(".cores"))
        for k in (0, 1):
            assert cast.get(f"socket{k}.cores", 0.0) == pytest.approx(total * where.get(k, 0.0))
        assert not any(".to" in n for n in cast)
        down = _draws(g, use, _first(g, Kind.D2H, unit=u, rank=0))
        w = down["gpu0.d2h"]
        for k in (0, 1):
            assert down.get(f"socket{k}.dram", 0.0) == pytest.approx(w * where.get(k, 0.0))


def test_a_ring_crosses_nvlink_switches_and_host_memory_where_p2p_stops():
    """All-gather of B bytes over four ranks, (R-1)/R B a hop: 0 -> 1 peer-to-peer below
    switch 0; 1 -> 2 and 2 -> 3 beyond the switch level, staged through the source's socket
    memory (its DRAM twice, 2 -> 3 also the socket link); 3 -> 0 likewise through socket 1."""
    hw = _hardware()
    g, _, use = _use(hw, plan=Plan(param_route=ParamRoute.SHARDED))
    v = _first(g, Kind.ALLGATHER)
    b, f = g.work[v], hop_fraction("all_gather", 4)
    d = _draws(g, use, v)
    assert d["p2p0.to1"] == pytest.approx(f * b) and "p2p1.to2" not in d
    assert d["socket0.to1"] == pytest.approx(f * b) and d["socket1.to0"] == pytest.approx(f * b)
    assert d["socket0.dram"] == pytest.approx(2 * 2 * f * b)  # 1 -> 2 and 2 -> 3, twice each
    assert d["socket1.dram"] == pytest.approx(2 * f * b)
    for r in range(4):  # every GPU sends one hop and receives one
        assert d[f"gpu{r}.h2d"] == pytest.approx(f * b) == d[f"gpu{r}.d2h"]
    assert ring_hops("reduce", 4) == [(1, 2), (2, 3), (3, 0)]


def test_a_reduce_is_a_chain_into_rank_0():
    hw = _hardware()
    g, _, use = _use(hw, plan=Plan(grad_route=GradRoute.GPU))
    v = _first(g, Kind.REDUCE)
    d = _draws(g, use, v)
    assert "gpu0.d2h" not in d and "gpu1.h2d" not in d and "p2p0.to1" not in d
    assert d["gpu0.h2d"] == pytest.approx(g.work[v]) == d["gpu1.d2h"]


def test_a_lone_copy_takes_its_tightest_links_time():
    """An upload alone runs at the socket's 20 GB/s DMA cap, not the 25 GB/s link; a ring with
    hops staged through host memory at most at what socket 0's DMA caps give it."""
    hw = _hardware()
    g, d, use = _use(hw, plan=Plan(param_route=ParamRoute.SHARDED))
    v = _first(g, Kind.H2D, rank=0)
    assert d[v] == pytest.approx(g.work[v] / 20e9, rel=1e-12)
    a = _first(g, Kind.ALLGATHER)
    links = {n: x / use.capacity[use.index(n)] for n, x in _draws(g, use, a).items()
             if n != "fabric"}
    assert max(links, key=links.get) == "socket0.duplex"  # 2 x 2 staged hops' bytes at 30 GB/s
    ring = hw.fabric.collective_s("all_gather", g.work[a], 4)
    assert links["socket0.duplex"] > ring and d[a] == pytest.approx(links["socket0.duplex"])


def test_copies_slow_only_the_kernels_of_their_own_memory():
    """Two memories (ResourceUse.slowdowns): a copy on memory 1 slows the CPU flow on memory 1
    to S / (S + D) and leaves the one on memory 0 at full speed."""
    dram0, dram1, mem0, mem1, cores = range(5)
    env = simpy.Environment()
    share = FluidShare(env, [100.0, 100.0, 400.0, 400.0, 16.0], {cores: 16.0},
                       ((140.0, mem0, dram0), (140.0, mem1, dram1)))
    flows = [Flow(0, 1.0, [(dram0, 10.0), (mem0, 10.0)], threads=4, pool=cores),
             Flow(1, 1.0, [(dram1, 10.0), (mem1, 10.0)], threads=4, pool=cores),
             Flow(2, 1.0, [(mem1, 60.0)])]
    for f in flows:
        f.done = env.event()
        share.start(f)
    assert flows[0].speed == 1.0 and flows[2].speed == 1.0
    assert flows[1].speed == pytest.approx(140.0 / 200.0)


# ---- properties in the simulator, on random small topologies -----------------------------------


def _random(raw, wl):
    """The random topology's hardware with the workload's GPUs (at least)."""
    hw = parse_hardware(raw, "random.toml")
    return hw if hw.gpu.count >= wl.gpus else None


def _simulate(hw, wl, plan):
    g = build_graph(wl, plan, hw.host.cores, iterations=3)
    d = task_durations(g, hw, wl)
    return g, d, simulate_graph(g, hw, d, SimConfig(), wl.tokens_per_step)


LINK_FIELDS = {  # what a link's capacity is, per part of the topology
    "socket": ("dram_bps", "dma_h2d_bps", "dma_d2h_bps", "dma_duplex_bps", "p2p_bps"),
    "switch": ("h2d_bps", "d2h_bps", "duplex_bps", "p2p_bps"),
    "gpus": ("h2d_bps", "d2h_bps", "duplex_bps", "p2p_bps", "nvlink_bps", "nvswitch_bps"),
}


def _more_capacity(hw, data):
    """hw with one link of its topology (or the socket link) at twice its capacity."""
    topo = hw.explicit_topology
    part = data.draw(st.sampled_from(["socket", "switch", "gpus", "link"]))
    if part == "link":
        if topo.socket_link_bps is None:
            return hw
        return replace(hw, explicit_topology=replace(topo, socket_link_bps=2 * topo.socket_link_bps))
    items = {"socket": topo.sockets, "switch": topo.switches, "gpus": (topo.gpus,)}[part]
    i = data.draw(st.integers(0, len(items) - 1))
    field = data.draw(st.sampled_from([f for f in LINK_FIELDS[part]
                                       if getattr(items[i], f) is not None]))
    bigger = replace(items[i], **{field: 2 * getattr(items[i], field)})
    if part == "gpus":
        return replace(hw, explicit_topology=replace(topo, gpus=bigger))
    new = tuple(bigger if j == i else x for j, x in enumerate(items))
    field_of = {"socket": "sockets", "switch": "switches"}
    return replace(hw, explicit_topology=replace(topo, **{field_of[part]: new}))


@settings(max_examples=20)
@given(topologies(), small_workloads(max_gpus=3), small_plans(), st.data())
def test_more_capacity_on_any_link_never_slows_a_step(raw, wl, plan, data):
    hw = _random(raw, wl)
    if hw is None:
        return
    _, _, base = _simulate(hw, wl, plan)
    _, _, more = _simulate(_more_capacity(hw, data), wl, plan)
    assert more.run.finish_s.max() <= base.run.finish_s.max() * (1 + 1e-9)


@settings(max_examples=15)
@given(topologies(), small_workloads(max_gpus=3), small_plans())
def test_no_flow_exceeds_the_smallest_link_on_its_path(raw, wl, plan):
    """Over its simulated interval every copy and collective moves its bytes on each link at
    most at that link's capacity: bytes x share / elapsed <= capacity."""
    hw = _random(raw, wl)
    if hw is None:
        return
    g, _, res = _simulate(hw, wl, plan)
    use, run = res.use, res.run
    moving = np.flatnonzero(np.isin(g.kind, [int(k) for k in MOVING_KINDS]))
    for v in moving.tolist():
        elapsed = run.finish_s[v] - run.start_s[v]
        for j, a in zip(use.res[use.ptr[v]:use.ptr[v + 1]].tolist(),
                        use.amount[use.ptr[v]:use.ptr[v + 1]].tolist(), strict=True):
            if not use.names[j].endswith((".compute", "fabric")):
                assert a <= use.capacity[j] * elapsed * (1 + 1e-9), (g.label(v), use.names[j])


@settings(max_examples=15)
@given(topologies(), small_workloads(max_gpus=3), small_plans())
def test_bytes_are_conserved_per_link(raw, wl, plan):
    """The bytes the simulator serves on each link (its flows' demand x speed, integrated over
    the run) equal the bytes of the flows routed over it, and those equal the topology's paths
    of every copy and collective, routed by hand here: H2D / D2H from the unit's staging,
    activations from the GPU's socket, rings hop by hop."""
    hw = _random(raw, wl)
    if hw is None:
        return
    served: dict[int, float] = {}
    advance = FluidShare._advance

    def counting(self):
        dt = self.env.now - self.t_last
        for f in self.flows:
            for j, d in f.uses:
                served[j] = served.get(j, 0.0) + d * f.speed * max(dt, 0.0)
        advance(self)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine.FluidShare, "_advance", counting)
        g, _, res = _simulate(hw, wl, plan)
    use, topo = res.use, hw.topology
    drawn = np.bincount(use.res, weights=use.amount, minlength=len(use.names))
    routed = dict.fromkeys(use.names, 0.0)
    for v in np.flatnonzero(np.isin(g.kind, [int(k) for k in MOVING_KINDS])).tolist():
        k, w, r = Kind(int(g.kind[v])), float(g.work[v]), int(g.rank[v])
        split = topo.memory_split(part=int(g.unit[v]))
        if k in (Kind.H2D, Kind.ACT_RELOAD):
            paths = [topo.h2d(r, split if k == Kind.H2D else None)]
        elif k in (Kind.D2H, Kind.ACT_OFFLOAD):
            paths = [topo.d2h(r, split if k == Kind.D2H else None)]
        else:
            op = COLLECTIVE_OPS[int(g.op[v])]
            w *= hop_fraction(op, g.n_ranks)
            paths = [topo.p2p(a, b) for a, b in ring_hops(op, g.n_ranks)]
        for path in paths:
            for hop in path:
                if not hop.resource.endswith(".dram"):
                    routed[hop.resource] += w * hop.share
    for j, name in enumerate(use.names):
        if name in topo.resources() and not name.endswith(".dram"):
            assert drawn[j] == pytest.approx(routed[name], rel=1e-9, abs=1e-6), name
        if drawn[j] > 0 and not name.endswith((".cores", ".compute")):
            assert served.get(j, 0.0) == pytest.approx(drawn[j], rel=1e-6), name


def _one_switch(hw):
    """hw with its flat reading written as an explicit [topology] (one socket, one switch)."""
    return replace(hw, explicit_topology=hw.topology)


@st.composite
def flat_hardware(draw):
    """A flat file's hardware (h200x1, NVSwitch fabric), its rates and cores varied, with 1-8
    GPUs; or a PCIe / NVLink-pairs fabric with one GPU, or NVLink pairs with two."""
    raw = tomllib.loads((preset_dir() / "h200x1.toml").read_text())
    raw = copy.deepcopy(raw)
    raw.pop("topology", None)
    kind = draw(st.sampled_from(["nvswitch", "nvswitch", "pcie", "nvlink-pairs"]))
    raw["gpu"]["count"] = {"nvswitch": draw(st.integers(1, 8)), "pcie": 1,
                           "nvlink-pairs": draw(st.integers(1, 2))}[kind]
    raw["fabric"]["kind"] = kind
    for key in ("all_h2d_gbps", "all_d2h_gbps", "all_total_gbps", "h2d_gbps"):
        raw["pcie"][key] *= draw(st.sampled_from([0.3, 1.0, 2.0]))
    raw["host"]["dram_gbps"] *= draw(st.sampled_from([0.2, 1.0]))
    return parse_hardware(raw, "flat.toml")


@settings(max_examples=15)
@given(flat_hardware(), small_workloads(max_gpus=3), small_plans())
def test_the_flat_spec_equals_the_one_switch_topology(hw, wl, plan):
    """The flat machine (flat_host.py) and the topology machine on the flat spec's one socket and
    one switch give the same simulated step and the same bound, every flow crossing the same
    caps under other names. Outside: a PCIe ring or NVLink pairs beyond one pair, where the flat
    machine charges peer traffic on host.pcie (or not on PCIe at all) and the topology routes it
    (a switch's own peer-forwarding cap, the hops between pairs over PCIe): docs/simulator.md."""
    if wl.gpus > hw.gpu.count:
        return
    _, _, flat = _simulate(hw, wl, plan)
    _, _, topo = _simulate(_one_switch(hw), wl, plan)
    assert topo.step_time_s == pytest.approx(flat.step_time_s, rel=1e-12)
    assert topo.analytic["lower_bound_s"] == pytest.approx(flat.analytic["lower_bound_s"],
                                                           rel=1e-12)
    assert np.allclose(topo.run.finish_s, flat.run.finish_s, rtol=1e-12, atol=0)


def test_more_capacity_check_scales_what_it_names():
    hw = _hardware()

    class Data:
        def __init__(self, picks):
            self.picks = iter(picks)

        def draw(self, _strategy):
            return next(self.picks)

    more = _more_capacity(hw, Data(["switch", 2, "h2d_bps"]))
    assert more.explicit_topology.switches[2].h2d_bps == 2 * 25 * GB
    assert more.explicit_topology.switches[1].h2d_bps == 25 * GB
    more = _more_capacity(hw, Data(["link"]))
    assert more.explicit_topology.socket_link_bps == 60 * GB


# ---- the routes on a PCIe-only machine, through the CLI -----------------------------------------


def test_replicated_beats_sharded_on_four_a800_without_bridges(capsys):
    """method.md section 9: on 4x A800 without NVLink bridges the replicated route is faster.
    The uploads tie on the root complex: replicated sends 4 P per layer down through it, sharded
    P plus the all-gather's two hops between the switches, each 3/4 P staged through host memory
    (NCCL's P2P stops at a PCIe switch on Intel hosts), a D2H and an H2D: 4 P again, so the
    bound ties. What the sharded route adds is each layer's all-gather between its upload and
    its compute, one collective at a time beside the reductions, each at the root complex's
    rate: the critical path (predict) and, with the uploads contending there, the simulator
    put it behind."""
    args = ["--hardware", "a800x4-nobridge", "--model", "qwen3-14b", "--seq", "1024",
            "--global-batch", "64", "--gpus", "4", "--micro-batch", "16", "--grad-route", "gpu",
            "--chunk-mib", "64", "--json"]
    for verb in ("predict", "simulate"):
        step = {}
        for route in ("replicated", "sharded"):
            assert main([verb, *args, "--param-route", route]) == 0
            step[route] = json.loads(capsys.readouterr().out)["step_time_s"]
        assert step["sharded"] >= 1.02 * step["replicated"], (verb, step)
