"""Task kinds, channels, edge kinds and the compact TaskGraph container (struct of arrays).

A task is (iteration, kind, unit, rank, chunk) with an agent (a serial server: a CUDA stream or
a CPU worker) and its work in natural units:
    compute kinds        FLOPs                 copies and collectives   bytes
    CAST, ADAM,          parameters            HOST_SUM                 bytes read from DRAM
    UPDATE_CAST
Units are the streamed pieces of the model: 0 = embedding, 1..L = decoder layers, L+1 = final
norm + LM head. Fields that do not apply are -1. Edges are typed: DATA (reads what the
predecessor wrote; the version gate I3 is a DATA edge flagged `gate`), ORDER (program order on
one agent), BUFFER (a slot or staging buffer is reused) and JOIN (plan.step_join: the executor's
join of every agent between steps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class Channel(IntEnum):
    """The six logical channels of method.md section 4."""

    UPLOAD = 1  # parameter preparation (cast) + H2D (+ all-gather)
    ACTIVATION = 2  # activation offload / reload
    COMPUTE = 3
    REDUCTION = 4
    DOWNLOAD = 5  # gradient D2H
    UPDATE = 6  # CPU Adam (and host-side sum)


class Kind(IntEnum):
    """Task kinds; their rules (channel, agent, duration, resources) are graph/kinds.py KINDS."""

    CAST = 0
    H2D = 1
    ALLGATHER = 2
    ACT_OFFLOAD = 3
    ACT_RELOAD = 4
    EMBED_FWD = 5
    FWD = 6
    HEAD_LOSS = 7
    RECOMPUTE = 8
    BWD = 9
    EMBED_BWD = 10
    REDUCE = 11
    HOST_SUM = 12
    D2H = 13
    ADAM = 14
    UPDATE_CAST = 15  # a pending update's BF16 result into the staging ring (features/split_update.py)
    NODE_REDUCE = 16  # a node's aggregated gradient chunk, reduced across nodes (NIC)
    NODE_GATHER = 17  # the new BF16 weights of a chunk, all-gathered across nodes (NIC)


class EdgeKind(IntEnum):
    DATA = 0
    ORDER = 1
    BUFFER = 2
    JOIN = 3  # the step boundary: the last task of every agent in t before the first ones of t+1


# agent name prefixes: gpu{r}.compute, gpu{r}.h2d, gpu{r}.d2h, fabric, cpu.cast{w}, cpu.update{w},
# nic{w} (update worker w's inter-node collectives: graph/features/internode.py)
AGENT_KINDS = ("compute", "h2d", "d2h", "fabric", "cast", "update", "nic")


@dataclass(frozen=True)
class GraphMeta:
    """What the builder decided beyond the tasks, read by the cost model, the simulator and the
    executor. Defaults describe a sketch graph (sim/microbench.py) built without a plan."""

    cast_threads: float | None = None  # threads of the cast team (None: no team sizes)
    update_threads: float | None = None  # threads of all update workers together
    teams_chunk_bytes: float | None = None  # layout.teams_chunk_bytes (None: whole buffers)
    update_workers: int = 1  # update workers in all (per process times processes when scattered)
    sharded_upload: bool = False  # each rank uploads its 1/R shard, then ALLGATHER
    scatter_update: bool = False  # the update is sharded over the ranks' processes
    cast_share: float = 1.0  # sizes.team_share of the cast team
    update_share: float = 1.0  # sizes.team_share of one update worker's team
    grad_ring_chunks: dict = field(default_factory=dict)  # (rank, worker) -> ring slots
    recompute_hbm_bytes: dict = field(default_factory=dict)  # layer -> recompute's HBM bytes
    adam_writes_copy: bool = False  # each ADAM also writes the BF16 copy (host_bf16_copy)
    embedding_rows_elems: int = 0  # elements of the compact looked-up rows buffer (0: none)
    grad_wire_bytes: int = 4  # bytes per element of a downloaded gradient chunk
    embedding_grad_align: int = 1  # the embedding's gradient chunks are multiples of this
    kernels: str = "eager"  # the layers' kernels (plan.kernels): which measured layer times apply
    nodes: int = 1  # nodes the job spans (workload.nodes): > 1 adds the inter-node tasks
    moments: str = "fp32"  # the Adam moments' format (plan.moments): the update's rate and bytes


@dataclass
class TaskGraph:
    """Struct-of-arrays task graph; task ids are row indices, in issue order per agent."""

    kind: np.ndarray  # int8
    iteration: np.ndarray  # int32
    unit: np.ndarray  # int32
    rank: np.ndarray  # int32, -1 for host/fabric tasks
    chunk: np.ndarray  # int32
    agent: np.ndarray  # int32, index into agents
    work: np.ndarray  # float64, natural units (see module docstring)
    elem_lo: np.ndarray  # int64, first parameter of the unit this task touches (-1: n/a)
    elem_hi: np.ndarray  # int64, one past the last
    threads: np.ndarray  # float64, CPU threads a CPU task uses (0 for GPU tasks)
    op: np.ndarray  # int8, collective op index into COLLECTIVE_OPS (-1: n/a)
    # int32, the buffer a task writes or reads, by kind (-1: n/a): CAST the staging-ring slot
    # it writes; H2D / ALLGATHER the GPU slot (layers 0..W-1, embedding W, head W+1); D2H,
    # HOST_SUM, ADAM the slot of the host gradient ring (ring_rank, ring_worker); BWD the GPU
    # gradient buffer; ACT_RELOAD the reload buffer
    buffer: np.ndarray
    edge_src: np.ndarray
    edge_dst: np.ndarray
    edge_kind: np.ndarray  # int8 EdgeKind
    edge_gate: np.ndarray  # bool: version-gate (I3) edge
    agents: list[str]
    agent_tasks: list[np.ndarray]  # per agent, task ids in issue order
    n_iterations: int
    n_ranks: int
    unit_params: list[int]
    meta: GraphMeta = field(default_factory=GraphMeta)
    # bool per task: a task of the embedding's looked-up rows (plan.embedding_rows), whose
    # elem_lo / elem_hi index the compact rows x hidden buffer, not the embedding (None: none)
    rows: np.ndarray | None = None
    # int32, H2D: the staging-ring slot it copies from (its CAST's buffer; -1: it reads the
    # host's BF16 copy, or not an H2D)
    staging_slot: np.ndarray | None = None
    # int32, D2H, HOST_SUM, ADAM: the host gradient ring (rank, update worker) of its `buffer`
    # slot: the ring a D2H writes, the source rank's ring whose chunk an ADAM reads (rank 0's
    # after a HOST_SUM, which adds the ranks' chunks there); -1: n/a
    ring_rank: np.ndarray | None = None
    ring_worker: np.ndarray | None = None
    # int64, D2H and HOST_SUM: the task that reads the gradient chunk it produced, on the
    # chunk's own path (its HOST_SUM, or its ADAM); -1: n/a
    grad_reader: np.ndarray | None = None

    def __post_init__(self):
        n = len(self.kind)
        if self.rows is None:
            self.rows = np.zeros(n, bool)
        for name, dtype in (("staging_slot", np.int32), ("ring_rank", np.int32),
                            ("ring_worker", np.int32), ("grad_reader", np.int64)):
            if getattr(self, name) is None:
                setattr(self, name, np.full(n, -1, dtype))

    @property
    def n_tasks(self) -> int:
        return len(self.kind)

    @property
    def n_edges(self) -> int:
        return len(self.edge_src)

    def label(self, v: int) -> str:
        parts = [Kind(int(self.kind[v])).name, f"t{self.iteration[v]}", f"u{self.unit[v]}"]
        if self.rank[v] >= 0:
            parts.append(f"r{self.rank[v]}")
        if self.chunk[v] >= 0:
            parts.append(f"c{self.chunk[v]}")
        if self.rows[v]:
            parts.append("rows")
        return ":".join(parts)

    def to_networkx(self):
        """A networkx DiGraph for analysis and tests on small graphs (not for the hot path)."""
        import networkx as nx

        g = nx.DiGraph()
        g.add_nodes_from(range(self.n_tasks))
        for s, d, k, gt in zip(self.edge_src.tolist(), self.edge_dst.tolist(),
                               self.edge_kind.tolist(), self.edge_gate.tolist(), strict=True):
            g.add_edge(s, d, kind=EdgeKind(k), gate=gt)
        return g


COLLECTIVE_OPS = ("all_gather", "reduce_scatter", "reduce", "all_reduce")
