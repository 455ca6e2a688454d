"""plan.embedding_rows in the task graph: the embedding's update split into a bulk during the
backward and the looked-up rows after EMBED_BWD (graph/features/embedding_rows.py)."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import small_plans, small_workloads

from slidedp.graph import Kind, build_graph
from slidedp.graph.features.embedding_rows import looked_up_rows, row_capacity
from slidedp.model.predict import predict
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload


def _tiles(g, mask, n):
    lo, hi = np.sort(g.elem_lo[mask]), np.sort(g.elem_hi[mask])
    return len(lo) > 0 and lo[0] == 0 and hi[-1] == n and np.all(lo[1:] == hi[:-1])


@settings(max_examples=40, deadline=None)
@given(small_workloads(), small_plans(), st.booleans())
def test_rows_split_orders_the_embedding_update(wl, plan, join):
    plan = replace(plan, embedding_rows=True, defer_update=False, step_join=join)
    g = build_graph(wl, plan, cores=8, iterations=2)
    assert np.all(g.edge_src < g.edge_dst)
    nxg = g.to_networkx()
    assert nx.is_directed_acyclic_graph(nxg)
    rows_n = row_capacity(wl) * wl.model.hidden
    assert g.meta.embedding_rows_elems == rows_n
    h = wl.model.hidden  # whole rows: the embedding's gradient chunks and the rows' chunks
    emb_grad = (g.unit == 0) & np.isin(g.kind, [Kind.D2H, Kind.ADAM])
    assert np.all(g.elem_lo[emb_grad] % h == 0) and np.all(g.elem_hi[emb_grad] % h == 0)
    tied = wl.model.tie_embeddings
    # rows tasks are numbered after the bulk's: one embedding task per (kind, rank, chunk) of an
    # iteration after the first (whose start also delivers the embedding for itself)
    emb = np.flatnonzero((g.unit == 0) & (g.chunk >= 0) & (g.iteration == 1))
    keys = {(int(g.iteration[v]), int(g.kind[v]), int(g.rank[v]), int(g.chunk[v])) for v in emb}
    assert len(keys) == len(emb)
    for t in range(2):
        it, emb = g.iteration == t, g.unit == 0
        adam = it & emb & (g.kind == Kind.ADAM)
        bulk, rows = adam & ~g.rows, adam & g.rows
        assert _tiles(g, bulk, g.unit_params[0]) and _tiles(g, rows, rows_n)
        anc = {int(v): nx.ancestors(nxg, int(v)) for v in np.flatnonzero(rows)}
        for v, before in anc.items():  # the rows update follows every bulk ADAM and bulk CAST
            assert set(np.flatnonzero(bulk).tolist()) <= before
            casts = it & emb & (g.kind == Kind.CAST) & ~g.rows
            assert set(np.flatnonzero(casts).tolist()) - set(range(v, g.n_tasks)) <= before
        bulk_before = set().union(*(nx.ancestors(nxg, int(v)) for v in np.flatnonzero(bulk)))
        downloads = np.flatnonzero(it & emb & (g.kind == Kind.D2H) & ~g.rows)
        if tied:  # the head's share comes back after HEAD_LOSS
            heads = np.flatnonzero(it & (g.kind == Kind.HEAD_LOSS))
            assert set(heads.tolist()) <= bulk_before and len(downloads) > 0
        else:  # a zero gradient: nothing comes back for the bulk
            assert len(downloads) == 0
    # the embedding slot: the next step's bulk delivery after this step's readers of it, the
    # rows after the rank's bulk delivery, the next EMBED_FWD after both (with or without the
    # step join)
    for r in range(wl.gpus):
        on_r = (g.iteration == 0) & (g.unit == 0) & (g.rank == r)
        fwd1 = int(np.flatnonzero((g.iteration == 1) & (g.kind == Kind.EMBED_FWD)
                                  & (g.rank == r))[0])
        reads = Kind.HEAD_LOSS if tied else Kind.EMBED_FWD  # the last reader of the weight
        reader = int(np.flatnonzero((g.iteration == 0) & (g.kind == reads) & (g.rank == r))[0])
        before_fwd1 = nx.ancestors(nxg, fwd1)
        first_fwd = int(np.flatnonzero(on_r & (g.kind == Kind.EMBED_FWD))[0])
        bulk_h2d = np.flatnonzero(on_r & (g.kind == Kind.H2D) & ~g.rows)
        next_bulk = [int(v) for v in bulk_h2d if v > first_fwd]
        rows_h2d = np.flatnonzero(on_r & (g.kind == Kind.H2D) & g.rows).tolist()
        assert next_bulk and rows_h2d
        for v in next_bulk:
            assert reader in nx.ancestors(nxg, v)
        for v in rows_h2d:
            assert set(next_bulk) <= nx.ancestors(nxg, v)
        assert set(next_bulk + rows_h2d) <= before_fwd1
    # the next step's bulk does not overtake this step's rows update or the rows' readers
    rows_casts = np.flatnonzero((g.iteration == 0) & (g.kind == Kind.CAST) & g.rows)
    for v in np.flatnonzero((g.iteration == 1) & (g.unit == 0) & (g.kind == Kind.ADAM) & ~g.rows):
        before = nx.ancestors(nxg, int(v))
        assert set(rows_casts.tolist()) <= before
        rows0 = np.flatnonzero((g.iteration == 0) & (g.kind == Kind.ADAM) & g.rows)
        assert set(rows0.tolist()) <= before


def test_the_template_graph_leaves_the_first_delivery_to_the_executor():
    wl = Workload(load_model("qwen3-0.6b"), 256, 2, 1, 1)
    g = build_graph(wl, Plan(embedding_rows=True), 8, iterations=1, first_delivery=False)
    first = np.flatnonzero(g.kind == Kind.EMBED_FWD)[0]
    assert not np.any((g.unit[:first] == 0) & np.isin(g.kind[:first], [Kind.CAST, Kind.H2D]))
    # one delivery of the embedding per step: the next step's, bulk and rows
    h2d = (g.kind == Kind.H2D) & (g.unit == 0)
    assert h2d.any() and np.all(np.flatnonzero(h2d) > first)


def test_rows_mode_is_ignored_when_the_update_is_deferred():
    wl = Workload(load_model("qwen3-0.6b"), 256, 2, 1, 1)
    whole = build_graph(wl, Plan(defer_update=True), 8)
    split = build_graph(wl, Plan(defer_update=True, embedding_rows=True), 8)
    assert split.n_tasks == whole.n_tasks and not split.rows.any()


def test_looked_up_rows_bounds():
    model = load_model("qwen3-8b")
    few = Workload(model, 64, 1, 1, 1)  # 64 tokens of 151,936 ids: nearly all distinct
    assert looked_up_rows(few) in (63, 64)
    many = Workload(model, 4096, 256, 4, 1)  # 1M tokens: nearly every id
    assert model.vocab_size * 0.99 < looked_up_rows(many) <= model.vocab_size


@pytest.mark.parametrize("gpus,gb", [(1, 16), (2, 16)])
def test_rows_shorten_a_gpu_bound_step(gpus, gb):
    """8B untied on the x2 preset, GPU-bound: the embedding's update leaves the boundary."""
    hw = load_hardware("h200x2")
    wl = Workload(load_model("qwen3-8b"), 4096, gb, 4, gpus)
    whole = predict(hw, wl, Plan(window_slots=36))
    split = predict(hw, wl, Plan(window_slots=36, embedding_rows=True))
    assert split.step_time_s < whole.step_time_s - 0.02


def test_tied_bulk_is_spread_over_the_backward():
    """Tied: the bulk's ADAMs are issued a few after each layer's, not all after HEAD_LOSS
    (all at once they stalled the backward on the download ring): in the update worker's issue
    order, every bulk ADAM has a decoder layer's ADAM before it, and the backward's ADAMs of
    the last layer (1) come after bulk ADAMs."""
    model = load_model("qwen3-4b")  # tied
    wl = Workload(model, 4096, 6, 6, 1)
    g = build_graph(wl, Plan(window_slots=36, embedding_rows=True), 16, iterations=1)
    adams = np.flatnonzero(g.kind == Kind.ADAM)
    bulk = [v for v in adams if g.unit[v] == 0 and not g.rows[v]]
    layers = [v for v in adams if 1 <= g.unit[v] <= model.n_layers]
    assert len(bulk) > 1
    first_layer_adam = min(layers)
    assert all(v > first_layer_adam for v in bulk)
    assert max(bulk) < max(layers)  # not all at the end either
    # 24 bulk chunks over 36 layers: one after each layer's, so between two consecutive bulk
    # ADAMs lie the ADAMs of exactly one layer
    for a, b in zip(bulk, bulk[1:], strict=False):
        assert len({int(g.unit[v]) for v in layers if a < v < b}) == 1
