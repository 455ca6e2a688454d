"""Which rank process runs which task of the R-rank graph, and how many CPU threads it uses.

Every process interprets the same graph (build_graph of the workload with R = gpus) and runs
the tasks it owns:
    rank r's tasks      compute, H2D, D2H, activations (the graph's rank field): process r
    ALLGATHER, REDUCE   the fabric agent: EVERY process, each issuing the collective
    ADAM, HOST_SUM      update worker w (agent cpu.update{w}): process 0 with
                        update_sharding=rank0 (the published design: one update process);
                        process w // plan.update_workers with update_sharding=sharded, i.e. the
                        rank whose 1/R share of every unit (sizes.shard_ranges) the worker updates
    CAST, UPDATE_CAST   into the shared staging ring: process 0 with rank0; with sharded, the
                        process whose update share holds the chunk (the rank that updates a chunk
                        also casts it; the embedding's shares are whole rows when its update is
                        split, and its looked-up rows are cast by the process that updated them)
With update_sharding=sharded the graph's single cast agent cpu.cast0 is thus run by R processes,
each walking the subsequence of the casts it owns (the graph does not model R cast workers yet).

Threads (torch.set_num_threads, per process, from plan.threads(cores) = (cast, update)): with
rank0, process 0 gets cast + update threads and the others RANK_THREADS (they only issue GPU work
and copies); with sharded, each process gets (cast + update) / R.
"""

from __future__ import annotations

import numpy as np

from slidedp.graph.sizes import update_shards
from slidedp.graph.tasks import Kind, TaskGraph
from slidedp.spec.plan import Plan

EVERY = -2  # a collective: every process runs it
RANK_THREADS = 2


def task_owners(g: TaskGraph, plan: Plan) -> np.ndarray:
    """Per task, the rank of the process that runs it (EVERY for collectives)."""
    owner = g.rank.astype(np.int64)
    if g.n_ranks == 1:
        return np.zeros_like(owner)
    scatter = g.meta.scatter_update
    for a, name in enumerate(g.agents):
        if name.startswith("cpu.update"):
            w = int(name.removeprefix("cpu.update"))
            owner[g.agent_tasks[a]] = w // plan.update_workers if scatter else 0
    kind = g.kind
    owner[(kind == Kind.ALLGATHER) | (kind == Kind.REDUCE)] = EVERY
    for v in np.flatnonzero((kind == Kind.CAST) | (kind == Kind.UPDATE_CAST)).tolist():
        if not scatter:
            owner[v] = 0
            continue
        u, lo = int(g.unit[v]), int(g.elem_lo[v])
        if g.rows[v]:  # the looked-up rows: the process that updated them (the CAST's gate)
            gates = g.edge_src[(g.edge_dst == v) & g.edge_gate]
            owner[v] = owner[int(gates[0])]
            continue
        align = g.meta.embedding_grad_align if u == 0 else 1  # whole-row shares
        shards = update_shards(g.unit_params[u], g.n_ranks, align)
        owner[v] = next(p for p, (a, z) in enumerate(shards) if a <= lo < z)
    return owner


def process_threads(plan: Plan, cores: int, ranks: int, rank: int, scatter: bool) -> int:
    """torch.set_num_threads for rank `rank`'s process (see the module docstring)."""
    cast, update = plan.threads(cores)
    if scatter:
        return max(1, (cast + update) // ranks)
    return cast + update if rank == 0 else RANK_THREADS
