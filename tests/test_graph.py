"""Task-graph structure: acyclic, one Adam per chunk, version gates, buffers, deferred update, scale."""

import dataclasses
import time
from collections import Counter
from dataclasses import replace

import networkx as nx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from strategies import small_plans, small_workloads

from slidedp.graph import EdgeKind, Kind, build_graph
from slidedp.graph.layout import grad_ring_sizes
from slidedp.graph.sizes import chunk_ranges, shard_ranges
from slidedp.spec.errors import SpecError
from slidedp.spec.model import load_model
from slidedp.spec.plan import ClipSchedule, GradRoute, ParamRoute, Plan
from slidedp.spec.workload import Workload


@given(small_workloads(), small_plans())
def test_graph_invariants(wl, plan):
    g = build_graph(wl, plan, cores=8, iterations=2)
    # acyclic, and task ids are a topological order
    assert np.all(g.edge_src < g.edge_dst)
    assert nx.is_directed_acyclic_graph(g.to_networkx())
    L = wl.model.n_layers
    units = range(L + 2)
    # exactly one ADAM per (iteration, unit, chunk); the chunks of a unit tile its parameters
    adam = g.kind == Kind.ADAM
    keys = Counter(zip(g.iteration[adam].tolist(), g.unit[adam].tolist(), g.chunk[adam].tolist(), strict=True))
    assert max(keys.values()) == 1
    for t in [1] if plan.splits_update else range(2):  # split: step t's update runs in t + 1
        for u in units:
            m = adam & (g.iteration == t) & (g.unit == u)
            lo, hi = np.sort(g.elem_lo[m]), np.sort(g.elem_hi[m])
            assert lo[0] == 0 and hi[-1] == g.unit_params[u]
            assert np.all(lo[1:] == hi[:-1])
    if not plan.splits_update:  # split: tests/test_split_update.py checks its gates
        _check_version_gates(g, plan, units)
    # ORDER edges follow each agent's issue order
    order = g.edge_kind == EdgeKind.ORDER
    assert np.all(g.agent[g.edge_src[order]] == g.agent[g.edge_dst[order]])
    assert order.sum() == sum(max(len(a) - 1, 0) for a in g.agent_tasks)


def _check_version_gates(g, plan, units):
    # a version-gate edge from each unit's update in t=0 to its first delivery in t=1
    gate = g.edge_gate
    src, dst = g.edge_src[gate], g.edge_dst[gate]
    assert np.all(g.kind[src] == Kind.ADAM)
    assert np.all(g.iteration[src] == 0) and np.all(g.iteration[dst] == 1)
    assert np.all(g.unit[src] == g.unit[dst])
    assert np.all(np.isin(g.kind[dst], [Kind.CAST, Kind.H2D]))
    assert set(g.unit[dst].tolist()) == set(units)
    # every parameter of every unit is gated: gated ranges cover each delivery chunk
    for v in np.flatnonzero(np.isin(g.kind, [Kind.CAST, Kind.H2D]) & (g.iteration == 1)):
        if plan.host_bf16_copy == (g.kind[v] == Kind.CAST):
            continue
        first_fwd = _is_forward_delivery(g, v)
        if first_fwd:
            assert np.any(dst == v), g.label(v)


def _is_forward_delivery(g, v) -> bool:
    """The first delivery of a unit in its iteration (the forward one)."""
    same = np.flatnonzero((g.iteration == g.iteration[v]) & (g.unit == g.unit[v]) & (g.kind == g.kind[v])
                          & (g.rank == g.rank[v]) & (g.elem_lo == g.elem_lo[v]))
    return v == same[0]


@given(small_workloads(), small_plans())
def test_compute_order_and_deliveries(wl, plan):
    g = build_graph(wl, plan, cores=4, iterations=1)
    L, R, W = wl.model.n_layers, wl.gpus, plan.window_slots
    for r in range(R):
        seq = [(Kind(int(g.kind[v])), int(g.unit[v])) for v in g.agent_tasks[g.agents.index(f"gpu{r}.compute")]]
        expect = [(Kind.EMBED_FWD, 0)] + [(Kind.FWD, u) for u in range(1, L + 1)] + [(Kind.HEAD_LOSS, L + 1)]
        for u in range(L, 0, -1):
            expect += [(Kind.RECOMPUTE, u), (Kind.BWD, u)]
        expect.append((Kind.EMBED_BWD, 0))
        assert seq == expect
        # layers still in the window are not uploaded again in backward
        for u in range(1, L + 1):
            first_chunks = (g.kind == Kind.H2D) & (g.unit == u) & (g.rank == r) & (g.chunk == 0)
            assert first_chunks.sum() == (1 if u > L - W else 2)


@given(small_workloads(), small_plans())
def test_deferred_update_waits_for_every_download(wl, plan):
    """defer_update, joined: every ADAM of iteration t has every D2H of t among its ancestors;
    without it, some ADAM starts before the last D2H (when there are two gradient chunks or
    more)."""
    plan = replace(plan, clip_schedule=ClipSchedule.JOINED)
    g = build_graph(wl, replace(plan, defer_update=True), cores=8, iterations=2)
    g0 = build_graph(wl, replace(plan, defer_update=False), cores=8, iterations=2)
    assert np.array_equal(np.sort(g.kind), np.sort(g0.kind))  # same tasks, one ADAM per chunk
    for t in range(2):
        d2h = np.flatnonzero((g.kind == Kind.D2H) & (g.iteration == t))
        anc = _d2h_ancestors(g, d2h)
        full = (1 << len(d2h)) - 1
        adams = np.flatnonzero((g.kind == Kind.ADAM) & (g.iteration == t))
        assert all(anc[v] == full for v in adams.tolist())
        assert adams.min() > d2h.max()
    d2h0 = np.flatnonzero((g0.kind == Kind.D2H) & (g0.iteration == 0))
    anc0 = _d2h_ancestors(g0, d2h0)
    adams0 = np.flatnonzero((g0.kind == Kind.ADAM) & (g0.iteration == 0))
    if len(adams0) > 1:
        assert anc0[int(adams0[0])] != (1 << len(d2h0)) - 1
    # the rings the ADAMs read hold an iteration's chunks of their worker
    sizes = grad_ring_sizes(wl, replace(plan, defer_update=True))
    chunks = Counter(int(w) for w in _adam_workers(g, 0))
    summed = plan.grad_route == GradRoute.CPU and wl.gpus > 1
    for (r, w), n in sizes.items():
        assert n == (chunks[w] if r == 0 or not summed else plan.d2h_staging_chunks)


def _d2h_ancestors(g, d2h: np.ndarray) -> list[int]:
    """Per task, a bitset of the tasks in `d2h` among its ancestors (or itself)."""
    bit = dict(zip(d2h.tolist(), range(len(d2h)), strict=True))
    anc = [0] * g.n_tasks
    for v in bit:
        anc[v] = 1 << bit[v]
    order = np.argsort(g.edge_dst, kind="stable")
    for s, d in zip(g.edge_src[order].tolist(), g.edge_dst[order].tolist(), strict=True):
        anc[d] |= anc[s]  # ids are a topological order: every source is final before its target
    return anc


def _adam_workers(g, t: int) -> list[int]:
    names = [int(n.removeprefix("cpu.update")) if n.startswith("cpu.update") else -1 for n in g.agents]
    return [names[a] for a in g.agent[(g.kind == Kind.ADAM) & (g.iteration == t)].tolist()]


@given(small_workloads(), small_plans(), st.booleans())
def test_buffer_fields_name_each_chunks_path(wl, plan, rows):
    """The explicit buffer fields agree with the edges: an H2D copies from the staging slot its
    CAST wrote, a D2H or HOST_SUM names the task reading its chunk (a DATA successor over the
    same range), ring keys exist and slots fit their rings."""
    plan = replace(plan, embedding_rows=rows)
    g = build_graph(wl, plan, cores=8, iterations=2)
    data = g.edge_kind == EdgeKind.DATA
    succ = {(s, d) for s, d in zip(g.edge_src[data].tolist(), g.edge_dst[data].tolist(), strict=True)}
    cast_of = {d: s for s, d in succ if g.kind[s] == Kind.CAST and g.kind[d] == Kind.H2D}
    rings = g.meta.grad_ring_chunks
    for v in np.flatnonzero(g.kind == Kind.H2D).tolist():
        casts = [cast_of[v]] if v in cast_of else []
        assert g.staging_slot[v] == (g.buffer[casts[0]] if casts else -1), g.label(v)
    for v in np.flatnonzero(np.isin(g.kind, [Kind.D2H, Kind.HOST_SUM])).tolist():
        a = int(g.grad_reader[v])
        if a < 0:  # split: the last step's update stays pending, its reader in no graph
            assert plan.splits_update and g.iteration[v] == 1, g.label(v)
            continue
        assert (v, a) in succ and g.kind[a] in (Kind.HOST_SUM, Kind.ADAM), g.label(v)
        assert (g.unit[a], g.elem_lo[a], g.elem_hi[a], g.rows[a]) == (
            g.unit[v], g.elem_lo[v], g.elem_hi[v], g.rows[v])
    for v in np.flatnonzero(np.isin(g.kind, [Kind.D2H, Kind.HOST_SUM, Kind.ADAM])).tolist():
        key = (int(g.ring_rank[v]), int(g.ring_worker[v]))
        if g.buffer[v] >= 0:
            assert 0 <= g.buffer[v] < rings[key], g.label(v)
        if g.kind[v] == Kind.D2H:
            assert key[0] == g.rank[v]
    assert (g.grad_reader[~np.isin(g.kind, [Kind.D2H, Kind.HOST_SUM])] == -1).all()


def test_chunk_and_shard_ranges():
    assert chunk_ranges(0, 10, 4) == [(0, 4), (4, 8), (8, 10)]
    assert shard_ranges(10, 3) == [(0, 3), (3, 6), (6, 10)]


def _big():
    m = load_model("qwen2.5-72b")
    chunk_mib = m.layer_params() * 2 / 16 / 2**20 * 1.0001  # 16 chunks per layer
    return m, chunk_mib


@pytest.mark.parametrize("route", list(ParamRoute))
@pytest.mark.parametrize("grad", list(GradRoute))
def test_scale_8x80x16x2_under_2s(route, grad):
    m, chunk = _big()
    assert m.n_layers == 80
    wl = Workload(m, 4096, 8, 1, 8)
    plan = Plan(param_route=route, grad_route=grad, h2d_chunk_mib=chunk, d2h_chunk_mib=chunk)
    t = time.process_time()
    g = build_graph(wl, plan, cores=64, iterations=2)
    elapsed = time.process_time() - t
    layer1 = (g.kind == Kind.H2D) & (g.unit == 1) & (g.iteration == 0) & (g.rank == 0)
    expect = 16 * 2 if route == ParamRoute.REPLICATED else 2 * 2  # fwd + bwd delivery
    assert layer1.sum() == expect
    assert elapsed < 2.0, f"{elapsed:.2f} s for {g.n_tasks} tasks"


def test_per_layer_policies():
    m = load_model("tiny-qwen3")  # 2 layers
    wl = Workload(m, 32, 1, 1, 1)
    plan = Plan(layer_policies=("none", "layer"), offload_ratio=0.5)
    g = build_graph(wl, plan, cores=4, iterations=1)
    rec = g.unit[g.kind == Kind.RECOMPUTE].tolist()
    assert rec == [2]
    off = {int(u): w for u, w in zip(g.unit[g.kind == Kind.ACT_OFFLOAD], g.work[g.kind == Kind.ACT_OFFLOAD], strict=True)}
    tok = wl.tokens_per_gpu_step
    assert off[1] == 0.5 * tok * m.activation_bytes_per_token("none")
    assert off[2] == 0.5 * tok * m.hidden * 2
    with pytest.raises(SpecError, match="layer_policies"):
        build_graph(wl, Plan(layer_policies=("none",)), cores=4)


@given(small_workloads(), small_plans())
def test_step_join_orders_every_task_of_the_next_step(wl, plan):
    g = build_graph(wl, plan, cores=4, iterations=2)
    join = g.edge_kind == EdgeKind.JOIN
    assert np.all(g.iteration[g.edge_src[join]] == 0) and np.all(g.iteration[g.edge_dst[join]] == 1)
    last0 = max(np.flatnonzero(g.iteration == 0))
    # every agent's first task of step 1 waits (through JOIN) on every agent's last task of step 0
    # agents busy in a step: no cast agent with a host BF16 copy, no ADAM in the split's step 0
    busy = [[tasks for tasks in g.agent_tasks if any(g.iteration[tasks] == t)] for t in (0, 1)]
    for tasks in busy[1]:
        first1 = min(v for v in tasks if g.iteration[v] == 1)
        preds = set(g.edge_src[join & (g.edge_dst == first1)].tolist())
        assert preds == {max(v for v in other if g.iteration[v] == 0) for other in busy[0]}
        assert max(preds) <= last0
    free = build_graph(wl, dataclasses.replace(plan, step_join=False), cores=4, iterations=2)
    assert not np.any(free.edge_kind == EdgeKind.JOIN)


def test_compute_idle_is_the_span_minus_each_ranks_compute_union():
    from slidedp.graph.timeline import Record, Timeline

    def rec(kind, rank, s, e, agent="a"):
        return Record(0, kind, 1, rank, 0, agent, s, e)

    tl = Timeline([rec("CAST", -1, 0.0, 0.5, "cast"), rec("FWD", 0, 0.5, 1.0),
                   rec("BWD", 0, 0.8, 1.5),  # overlaps the FWD: counted once
                   rec("FWD", 1, 0.5, 0.7), rec("ADAM", -1, 1.5, 2.0, "update")])
    assert tl.compute_idle_s() == pytest.approx({0: 1.0, 1: 1.8})  # span 0..2 s
    assert Timeline().compute_idle_s() == {}
