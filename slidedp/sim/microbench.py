"""Host microbenchmarks as tiny synthetic task graphs, so the simulator can be checked against the
measured figures (method.md section 9, shared/data/h200x2-probe.md) through its resource models.

Each function builds a graph with GraphSketch, simulates it with contention and returns the rate
the benchmark reports:
  dma_gbps            pinned copies of `nbytes`, per GPU, in the given directions at once
  cast_h2d_gbps       chunked cast+H2D of a layer: per GPU its own cast worker (threads) and DMA
                      engine, staging ring of 2 chunks; steady per-GPU rate in BF16 GB/s
  cpu_rate            one CAST (Gelem/s) or ADAM (Gparam/s) over `elems` with `threads` threads
  adam_workers_gparam_per_s   `workers` concurrent Adam workers of `threads` each: total Gparam/s
"""

from __future__ import annotations

from dataclasses import replace
from types import MappingProxyType

import numpy as np

from slidedp.graph.costs import task_durations
from slidedp.graph.tasks import EdgeKind, Kind, TaskGraph
from slidedp.sim.engine import SimConfig
from slidedp.sim.simulator import simulate_graph
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.model import load_model
from slidedp.spec.units import MIB
from slidedp.spec.workload import Workload


class GraphSketch:
    """Builds a TaskGraph by hand: tasks in issue order per agent (ORDER edges added), edges
    from lower to higher ids. For tests and microbenchmarks."""

    def __init__(self, n_ranks: int):
        self.n_ranks = n_ranks
        self.rows: list[tuple] = []
        self.edges: list[tuple[int, int, int, bool]] = []
        self.agents: list[str] = []
        self.last: dict[str, int] = {}

    def task(self, kind: Kind, agent: str, work: float, rank: int = -1, threads: float = 0.0,
             after=(), buffer_after=(), gate_after=(), iteration: int = 0, unit: int = 1,
             chunk: int = -1, op: int = -1) -> int:
        v = len(self.rows)
        if agent not in self.agents:
            self.agents.append(agent)
        self.rows.append((int(kind), iteration, unit, rank, chunk, self.agents.index(agent), work,
                          threads, op))
        if agent in self.last:
            self.edges.append((self.last[agent], v, int(EdgeKind.ORDER), False))
        self.last[agent] = v
        self.edges += [(u, v, int(EdgeKind.DATA), False) for u in after]
        self.edges += [(u, v, int(EdgeKind.BUFFER), False) for u in buffer_after]
        self.edges += [(u, v, int(EdgeKind.DATA), True) for u in gate_after]
        return v

    def graph(self, iterations: int = 1) -> TaskGraph:
        cols = list(zip(*self.rows, strict=True))
        n = len(self.rows)
        es = sorted(self.edges)
        e = list(zip(*es, strict=True)) if es else [[], [], [], []]
        agent = np.asarray(cols[5], np.int32)
        return TaskGraph(
            kind=np.asarray(cols[0], np.int8), iteration=np.asarray(cols[1], np.int32),
            unit=np.asarray(cols[2], np.int32), rank=np.asarray(cols[3], np.int32),
            chunk=np.asarray(cols[4], np.int32), agent=agent, work=np.asarray(cols[6], float),
            elem_lo=np.full(n, -1, np.int64), elem_hi=np.full(n, -1, np.int64),
            threads=np.asarray(cols[7], float), op=np.asarray(cols[8], np.int8),
            buffer=np.full(n, -1, np.int32), edge_src=np.asarray(e[0], np.int64),
            edge_dst=np.asarray(e[1], np.int64), edge_kind=np.asarray(e[2], np.int8),
            edge_gate=np.asarray(e[3], bool), agents=list(self.agents),
            agent_tasks=[np.flatnonzero(agent == a) for a in range(len(self.agents))],
            n_iterations=iterations, n_ranks=self.n_ranks, unit_params=[0, 0, 0])


def placeholder_workload(gpus: int) -> Workload:
    """Durations of copy and CPU kinds do not depend on the workload; compute kinds are unused."""
    return Workload(load_model("tiny-qwen3"), 64, gpus, 1, gpus)


def run_sketch(sk: GraphSketch, hw: HardwareSpec, cfg: SimConfig | None = None):
    """The sketch simulated as the profile's bare kernels run: no executor dispatch cost."""
    g = sk.graph()
    hw = replace(hw, host=replace(hw.host, task_gap_s=MappingProxyType({})))
    d = task_durations(g, hw, placeholder_workload(sk.n_ranks))
    return simulate_graph(g, hw, d, cfg or SimConfig(iterations=3)).run


def dma_gbps(hw: HardwareSpec, gpus: int, directions=("h2d",), nbytes: float = 512 * MIB) -> float:
    """Per-stream GB/s of `gpus` GPUs copying `nbytes` at once in each of `directions`."""
    sk = GraphSketch(hw.gpu.count)
    kinds = {"h2d": Kind.H2D, "d2h": Kind.D2H}
    for r in range(gpus):
        for dname in directions:
            sk.task(kinds[dname], f"gpu{r}.{dname}", nbytes, rank=r)
    run = run_sketch(sk, hw)
    return nbytes / float(np.mean(run.finish_s - run.start_s)) / 1e9


def cast_h2d_gbps(hw: HardwareSpec, gpus: int, threads: float, layer_params: float = 800e6,
                  chunk_mib: float = 64.0) -> float:
    """Steady per-GPU BF16 GB/s of chunked cast+H2D pipelines running on `gpus` GPUs at once."""
    sk = GraphSketch(hw.gpu.count)
    elems = chunk_mib * MIB / 2
    n = int(layer_params // elems)
    h2d_tasks = []
    for r in range(gpus):
        mine = []
        for k in range(n):
            c = sk.task(Kind.CAST, f"cpu.cast{r}", elems, threads=threads,
                        buffer_after=[mine[k - 2]] if k >= 2 else [])
            mine.append(sk.task(Kind.H2D, f"gpu{r}.h2d", 2 * elems, rank=r, after=[c]))
        h2d_tasks.append(mine)
    run = run_sketch(sk, hw)
    rates = [2 * elems * (n - 1) / (run.finish_s[m[-1]] - run.finish_s[m[0]]) for m in h2d_tasks]
    return float(np.mean(rates)) / 1e9


def cpu_rate(hw: HardwareSpec, kind: Kind, threads: float, elems: float = 128e6) -> float:
    """Elements (CAST) or parameters (ADAM) per second, in G/s, of one task alone."""
    sk = GraphSketch(1)
    sk.task(kind, "cpu.update0", elems, threads=threads)
    run = run_sketch(sk, hw)
    return elems / float(run.finish_s[0] - run.start_s[0]) / 1e9


def adam_workers_gparam_per_s(hw: HardwareSpec, workers: int, threads: float,
                              elems: float = 128e6) -> float:
    """Total Gparam/s of `workers` Adam workers of `threads` threads each running at once."""
    sk = GraphSketch(1)
    for w in range(workers):
        sk.task(Kind.ADAM, f"cpu.update{w}", elems, threads=threads)
    run = run_sketch(sk, hw)
    return workers * elems / float(run.finish_s.max()) / 1e9
