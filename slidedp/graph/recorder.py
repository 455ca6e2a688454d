"""The graph builder's data: append-only task and edge lists, converted once into a TaskGraph;
FIFO rings of host buffers; the gradient paths and chunks that go through them.

A task gets an ORDER edge from the previous task of its agent when it is appended, so each
agent's tasks are in issue order and task ids are a topological order as long as every other
edge runs from an older task to a newer one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from slidedp.graph.tasks import EdgeKind, GraphMeta, TaskGraph

# the task columns of a TaskGraph and their dtypes
COLUMNS = {"kind": np.int8, "iteration": np.int32, "unit": np.int32, "rank": np.int32,
           "chunk": np.int32, "agent": np.int32, "work": np.float64, "elem_lo": np.int64,
           "elem_hi": np.int64, "threads": np.float64, "op": np.int8, "buffer": np.int32,
           "rows": bool, "staging_slot": np.int32, "ring_rank": np.int32, "ring_worker": np.int32,
           "grad_reader": np.int64}


class Recorder:
    """Appends tasks and edges into flat lists; TaskGraph arrays are made once, by graph()."""

    def __init__(self):
        self.cols: dict[str, list] = {name: [] for name in COLUMNS}
        self.es, self.ed, self.ek, self.eg = [], [], [], []
        self.agents: list[str] = []
        self.agent_id: dict[str, int] = {}
        self.agent_tasks: list[list[int]] = []
        self.n = 0

    def agent(self, name: str) -> int:
        """The id of agent `name`, made on first use (agent ids in order of first use)."""
        a = self.agent_id.get(name)
        if a is None:
            a = self.agent_id[name] = len(self.agents)
            self.agents.append(name)
            self.agent_tasks.append([])
        return a

    def task(self, kind, it, unit, rank, chunk, agent, work, lo=-1, hi=-1, threads=0.0, op=-1,
             buffer=-1, rows=False, staging_slot=-1, ring=(-1, -1)) -> int:
        """Append a task on `agent` after the agent's previous one (ORDER); its id. The
        TaskGraph fields say what buffer, staging_slot and ring = (ring_rank, ring_worker) are."""
        c = self.cols
        c["buffer"].append(buffer)
        c["rows"].append(rows)
        c["staging_slot"].append(staging_slot)
        c["ring_rank"].append(ring[0])
        c["ring_worker"].append(ring[1])
        c["grad_reader"].append(-1)
        c["kind"].append(int(kind))
        c["iteration"].append(it)
        c["unit"].append(unit)
        c["rank"].append(rank)
        c["chunk"].append(chunk)
        c["agent"].append(agent)
        c["work"].append(float(work))
        c["elem_lo"].append(lo)
        c["elem_hi"].append(hi)
        c["threads"].append(threads)
        c["op"].append(op)
        v = self.n
        self.n += 1
        tasks = self.agent_tasks[agent]
        if tasks:
            self.edge(tasks[-1], v, EdgeKind.ORDER)
        tasks.append(v)
        return v

    def kind_of(self, v: int) -> int:
        return self.cols["kind"][v]

    def read_by(self, producer: int, reader: int) -> None:
        """`reader` reads the gradient chunk `producer` wrote (TaskGraph.grad_reader)."""
        self.cols["grad_reader"][producer] = reader

    def edge(self, src: int, dst: int, kind: EdgeKind, gate: bool = False):
        self.es.append(src)
        self.ed.append(dst)
        self.ek.append(int(kind))
        self.eg.append(gate)

    def edges(self, srcs, dst: int, kind: EdgeKind):
        for s in srcs:
            self.edge(s, dst, kind)

    def join_steps(self, iterations: int) -> None:
        """JOIN edges from each agent's last task of step t to each agent's first of step t+1."""
        its = self.cols["iteration"]
        for t in range(1, iterations):
            last = [max((v for v in tasks if its[v] == t - 1), default=-1)
                    for tasks in self.agent_tasks]
            first = [min((v for v in tasks if its[v] == t), default=-1)
                     for tasks in self.agent_tasks]
            for f in first:
                for lt in last:
                    if f >= 0 and lt >= 0:
                        self.edge(lt, f, EdgeKind.JOIN)

    def graph(self, iterations: int, ranks: int, unit_params: list[int],
              meta: GraphMeta) -> TaskGraph:
        cols = {name: np.asarray(self.cols[name], dtype) for name, dtype in COLUMNS.items()}
        return TaskGraph(
            **cols, edge_src=np.asarray(self.es, np.int64), edge_dst=np.asarray(self.ed, np.int64),
            edge_kind=np.asarray(self.ek, np.int8), edge_gate=np.asarray(self.eg, bool),
            agents=self.agents, agent_tasks=[np.asarray(x, np.int64) for x in self.agent_tasks],
            n_iterations=iterations, n_ranks=ranks, unit_params=list(unit_params), meta=meta)


class Ring:
    """A FIFO ring of host staging buffers: a writer waits for the previous occupant's readers."""

    def __init__(self, size: int):
        self.size, self.next = size, 0
        self.readers: list[list[int]] = [[] for _ in range(size)]

    def take(self) -> tuple[int, list[int]]:
        """The next slot and the readers of its previous occupant (the writer's BUFFER edges)."""
        i = self.next
        self.next = (i + 1) % self.size
        prev = self.readers[i]
        self.readers[i] = []
        return i, prev


@dataclass(frozen=True)
class GradPath:
    """A gradient that one path downloads and updates: a unit's, by default."""

    chunks: list[tuple[int, int, int]]  # (update worker, lo, hi): one D2H / ADAM each
    elems: int  # elements the REDUCE moves
    first_chunk: int = 0  # chunk number of the first chunk
    scale: float = 1.0  # copied bytes and summed elements per element of a chunk
    rows: bool = False  # its tasks are flagged `rows` (TaskGraph.rows)
    extra: float = 0.0  # ADAM work per element beyond the chunk's own


@dataclass
class GradChunk:
    """A gradient chunk on the host, ready for its ADAM."""

    t: int
    unit: int
    k: int  # chunk number
    worker: int  # update worker
    lo: int
    hi: int
    src: int  # its D2H or HOST_SUM (-1: no gradient comes, the ADAM reads zeros)
    ring: tuple[int, int]  # the host ring (rank, worker) that holds it (the source rank's)
    slot: int  # its slot in that ring (-1: none)
    rows: bool = False
    extra: int = 0  # ADAM work beyond the chunk's elements
    after: list[int] = field(default_factory=list)  # tasks between src and the ADAM (DATA)
