"""The per-iteration task template one rank process interprets, precomputed once per engine.

From the graph of one iteration and the task owners (dist/ownership.py) it derives, for the
process of rank `rank`:
    local[v]        the process runs task v (it owns it, or v is a collective)
    local_tasks[a]  agent a's local tasks in issue order (what its worker thread walks)
    preds[v]        predecessors run by this process on another agent: waited on locally
    remote[v]       predecessors run by another process: waited on through the shared
                    completion counters. A collective does not wait for the other ranks' GPU
                    tasks feeding it: the collective itself joins them.
    publish[v]      a task of this process that another process waits on: its completion is
                    published in the shared counters
    grad_src[v]     HOST_SUM / ADAM: the gradient chunks it reads, as (ring key (rank, worker),
                    ring slot), in rank order; for ADAM after a HOST_SUM, rank 0's chunk, where
                    the sum is with defer_update (else it reads HOST_SUM's accumulator: summed[v])
    h2d_src[v]      H2D: the staging-ring slot its CAST wrote (-1: it reads the host copy)
    worker[v]       D2H, HOST_SUM, ADAM: the update worker whose ring / accumulator it uses
    norm_slot[v]    a producer of an aggregated gradient chunk (a D2H read by ADAM directly, or
                    by none in this step: its ADAM is a later step's; or a HOST_SUM): its index
                    among them, in id order (where its squared norm goes)
The roles come from the tasks' own fields (TaskGraph.staging_slot, ring_rank, ring_worker,
buffer, grad_reader). ORDER edges are the walk itself; a DATA or BUFFER edge between two local
tasks of one agent is too.
"""

from __future__ import annotations

import numpy as np

from slidedp.exec.dist.ownership import EVERY
from slidedp.graph.kinds import COLLECTIVE_KINDS
from slidedp.graph.tasks import EdgeKind, Kind, TaskGraph

STREAM_AGENTS = ("gpu", "fabric")  # agents with a CUDA stream: the GPUs' and the comm stream


class Template:
    def __init__(self, g: TaskGraph, owner: np.ndarray, rank: int):
        if g.n_edges and not bool(np.all(g.edge_src < g.edge_dst)):
            raise AssertionError("task ids are not a topological order")
        self.g, self.rank, self.n = g, rank, g.n_tasks
        self.owner = owner
        self.kind = [Kind(int(k)) for k in g.kind]
        self.agent_names = list(g.agents)
        self.is_gpu_agent = [a.startswith(STREAM_AGENTS) for a in g.agents]
        self.local = [int(o) in (rank, EVERY) for o in owner.tolist()]
        self.local_tasks = [[v for v in ts.tolist() if self.local[v]] for ts in g.agent_tasks]
        self.preds: list[list[int]] = [[] for _ in range(self.n)]
        self.remote: list[list[int]] = [[] for _ in range(self.n)]
        self.publish = [False] * self.n
        self.grad_src: list[list[tuple[tuple[int, int], int]]] = [[] for _ in range(self.n)]
        self.summed = [False] * self.n  # ADAM after a HOST_SUM
        self.h2d_src = [-1] * self.n  # H2D: the staging slot its CAST wrote
        self.worker = [-1] * self.n
        worker_of_agent = {a: int(n.removeprefix("cpu.update")) for a, n in enumerate(g.agents)
                           if n.startswith("cpu.update")}
        for v in range(self.n):
            self.worker[v] = worker_of_agent.get(int(g.agent[v]), -1)
        producer = [k == Kind.HOST_SUM for k in self.kind]
        self._chunk_roles(producer)
        edges = zip(g.edge_src.tolist(), g.edge_dst.tolist(), g.edge_kind.tolist(), strict=True)
        for s, d, k in edges:
            if k == EdgeKind.ORDER:
                continue
            if self.local[s] and not self.local[d]:
                self.publish[s] = True
            if not self.local[d]:
                continue
            if self.local[s]:
                if g.agent[s] != g.agent[d]:
                    self.preds[d].append(s)
            elif not (self.kind[d] in COLLECTIVE_KINDS and self.on_gpu(s)):
                self.remote[d].append(s)
        for srcs in self.grad_src:
            srcs.sort()
        self.norm_slot = [-1] * self.n
        for j, v in enumerate(v for v in range(self.n) if producer[v]):
            self.norm_slot[v] = j
        self.n_norm = sum(producer)

    def _chunk_roles(self, producer: list[bool]) -> None:
        """h2d_src, the D2Hs' workers, grad_src and summed, from the tasks' buffer fields."""
        g = self.g
        staging, slot = g.staging_slot.tolist(), g.buffer.tolist()
        ring_rank, ring_worker, reader = (g.ring_rank.tolist(), g.ring_worker.tolist(),
                                          g.grad_reader.tolist())
        for v, k in enumerate(self.kind):
            if k == Kind.H2D:
                self.h2d_src[v] = staging[v]
            elif k == Kind.D2H:
                self.worker[v] = ring_worker[v]
                if reader[v] < 0:  # its chunk's ADAM runs in a later step: it feeds it directly
                    producer[v] = True
                    continue
                self.grad_src[reader[v]].append(((ring_rank[v], ring_worker[v]), slot[v]))
                producer[v] = self.kind[reader[v]] == Kind.ADAM
            elif k == Kind.HOST_SUM and reader[v] >= 0:
                a = reader[v]
                self.summed[a] = True
                self.grad_src[a].append(((ring_rank[a], ring_worker[a]), slot[a]))

    def on_gpu(self, v: int) -> bool:
        return self.is_gpu_agent[int(self.g.agent[v])]

    def largest(self, kind: Kind) -> int:
        """The largest element range a task of `kind` covers (0 if there is none)."""
        sel = self.g.kind == int(kind)
        span = self.g.elem_hi - self.g.elem_lo
        return int(span[sel].max()) if sel.any() else 0
