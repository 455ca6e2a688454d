"""Who runs what with R rank processes, and which graph edges cross processes (no processes here)."""

import json
from pathlib import Path

import numpy as np
import pytest

from slidedp.exec.dist.ownership import EVERY, RANK_THREADS, process_threads, task_owners
from slidedp.exec.template import Template
from slidedp.graph.build import build_graph
from slidedp.graph.sizes import shard_ranges
from slidedp.graph.tasks import Kind
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

CFG = json.loads((Path(__file__).parents[1] / "slidedp/presets/models/tiny-qwen3.json").read_text())
MIB = 2**20


def _graph(plan: Plan, R: int = 2):
    wl = Workload(parse_hf_config(CFG, "test"), seq_len=16, global_batch=2 * R, micro_batch=1,
                  gpus=R)
    return build_graph(wl, plan, cores=8, iterations=1)


def _small_chunks(**kw) -> Plan:
    return Plan(h2d_chunk_mib=4000 * 2 / MIB, d2h_chunk_mib=3000 * 2 / MIB, **kw)


def _of(g, owner, kind):
    return owner[g.kind == int(kind)]


@pytest.mark.parametrize("R", [2, 3])
def test_rank0_design_runs_every_host_task_in_process_0(R):
    g = _graph(_small_chunks(param_route="replicated", grad_route="cpu"), R)
    owner = task_owners(g, _small_chunks())
    for kind in (Kind.CAST, Kind.ADAM, Kind.HOST_SUM):
        assert set(_of(g, owner, kind).tolist()) == {0}
    gpu = g.rank >= 0
    assert np.array_equal(owner[gpu], g.rank[gpu])


@pytest.mark.parametrize("R", [2, 3])
def test_sharded_update_casts_and_updates_each_share_in_its_rank(R):
    plan = _small_chunks(param_route="sharded", grad_route="gpu", update_sharding="sharded")
    g = _graph(plan, R)
    owner = task_owners(g, plan)
    assert set(_of(g, owner, Kind.REDUCE).tolist()) == {EVERY}
    assert set(_of(g, owner, Kind.ALLGATHER).tolist()) == {EVERY}
    for v in np.flatnonzero(np.isin(g.kind, [Kind.CAST, Kind.ADAM])).tolist():
        shards = shard_ranges(g.unit_params[int(g.unit[v])], R)
        lo, hi = shards[int(owner[v])]
        assert lo <= g.elem_lo[v] < hi, g.label(v)
    assert set(_of(g, owner, Kind.ADAM).tolist()) == set(range(R))


def test_cross_process_edges_are_waited_on_and_published():
    """rank0 design, cpu route: rank 1's H2Ds wait on process 0's CASTs, process 0's HOST_SUMs
    wait on rank 1's D2Hs; a collective never waits on another rank's task."""
    plan = _small_chunks(param_route="replicated", grad_route="cpu", staging_chunks=1)
    g = _graph(plan)
    owner = task_owners(g, plan)
    t0, t1 = Template(g, owner, 0), Template(g, owner, 1)
    kinds = {(Kind(int(g.kind[u])), Kind(int(g.kind[v]))) for v in range(g.n_tasks)
             for u in t1.remote[v]}
    assert (Kind.CAST, Kind.H2D) in kinds
    assert all(t1.local[v] and not t1.local[u] for v in range(g.n_tasks) for u in t1.remote[v])
    sums = [v for v in range(g.n_tasks) if g.kind[v] == Kind.HOST_SUM]
    assert sums and all({int(g.rank[u]) for u in t0.remote[v]} == {1} for v in sums)
    assert all(t1.publish[u] for v in sums for u in t0.remote[v])  # rank 1 publishes its D2Hs
    assert all(len(t0.grad_src[v]) == 2 for v in sums)
    # the step-1 staging chunk is reused: process 0's CAST waits on rank 1's H2D (BUFFER)
    assert any(g.kind[u] == Kind.H2D for v in range(g.n_tasks) if g.kind[v] == Kind.CAST
               for u in t0.remote[v])


def test_collectives_wait_only_on_local_tasks():
    plan = _small_chunks(param_route="sharded", grad_route="gpu", update_sharding="sharded")
    g = _graph(plan)
    owner = task_owners(g, plan)
    for rank in (0, 1):
        tpl = Template(g, owner, rank)
        for v in range(g.n_tasks):
            if g.kind[v] in (Kind.ALLGATHER, Kind.REDUCE):
                assert not tpl.remote[v] and tpl.preds[v]


def test_threads_split_between_processes():
    plan = Plan(cast_threads=4, update_threads=12)
    assert process_threads(plan, 16, 2, 0, scatter=False) == 16
    assert process_threads(plan, 16, 2, 1, scatter=False) == RANK_THREADS
    assert [process_threads(plan, 16, 2, r, scatter=True) for r in (0, 1)] == [8, 8]
