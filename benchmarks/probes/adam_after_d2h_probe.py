"""Do the executor's update and host sum read what the D2H has just written from the CPU's
last-level cache? (issues 6 and 8: on nvidia-h200, 2026-12-01 08:36, Qwen3-8B at micro-batch 4
with every layer in the window, the executor's update channel was busy 1.83 s a step with 64 MiB
chunks and 2.06 s with 256 MiB, against 2.39 s simulated: 125 GB/s at 28 B a parameter with 64
MiB chunks, above the profile's largest DRAM rate, 111 GB/s; on nvidia-h200-x4, 2026-11-30 21:42,
the cpu reduction of 4 ranks' chunks ran at ~217 GB/s of the traffic the model counts, above
that host's 177.5: benchmarks/results/2026-12-01-0604-cpu-probe-state-dispatch-cost.md.)

    python3 benchmarks/probes/adam_after_d2h_probe.py OUT.json [--chunk-mib 16 64 256]
        [--update-threads 12] [--chunks 24] [--sum-ranks 2 4] [--device cuda|cpu]
        [--state-gib 1] [--cold-ring-gib 2]   (smaller only for a smoke run: they must exceed the LLC)
        [--state-memory process|shm] [--adam-only] [--repeats 2]

Per chunk size (FP32 gradient MiB, as the plan's d2h_chunk_mib), in a thread with its own OpenMP
team of --update-threads (as the executor's update agent), each timed per chunk:
  reused          the fused AdamW of one chunk on the same rotating p, m, v slices, its gradient
                  one unpinned chunk reused for every chunk (as validate/hostcheck.state_adam_rate
                  timed the executor's state until 2026-12-01 20:10: does it stay in the LLC?)
  cold            the fused AdamW of one chunk (slidedp.exec.adamw.adamw_chunk) on p, m, v slices
                  rotating through a state larger than any cache, its gradient from a pinned ring
                  slot written long before (a rotating 2 GiB ring: from DRAM)
  after_d2h       the same with a gradient slot the GPU has just written (a D2H copy of the
                  chunk, waited for, then the update: the executor's D2H -> ADAM edge)
  cold_gil        cold while another thread launches small CUDA kernels from Python, holding the
                  GIL between them (chunk_cost_probe.gil_load: the compute agent in the backward)
  cold_dma        cold while another thread copies chunks GPU -> pinned host back to back into
                  a ring of its own (D2H_RING slots: DMA writes into host memory at full speed)
  cold_dma_paced  the same, each copy followed by a 5 ms pause: the executor's D2H beside its
                  update (one 64 MiB chunk's D2H, ~1.5 ms, per ~5-6 ms update of one)
  sum_cold R      the cpu reduction's HOST_SUM of R chunks (slidedp.exec.staging.add_chunks into
                  a reused accumulator, then the squares for the gradient norm) from cold slots
  sum_after_d2h R the same from R slots the GPU has just written
  adam_after_sum R the AdamW of the chunk reading the accumulator a HOST_SUM has just written
                  (untimed before it, from just-downloaded slots): the cpu route's HOST_SUM ->
                  ADAM edge on one update worker
--state-memory shm maps p, m, v as the executor's host state (host_state.private_shared);
--adam-only leaves out the sums. The conditions run interleaved, --repeats times.
On the CPU (`--device cpu`) a copy_ from a source buffer stands in for the DMA (kinder than a DMA:
the cores that then run the kernel wrote the slot, so it can sit in their own caches).
Each row: mean and median ms per chunk over --chunks chunks (two untimed first) and the rate of
the traffic graph/build.py counts (28 B a parameter for AdamW; (3 (R - 1) + 1) x 4 B an element
for the sum). A condition faster than its cold one by more than noise reads from the cache what
the model counts as DRAM traffic (slidedp/graph/costs.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading

import torch

from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.host_state import cuda_host_register, cuda_host_unregister, private_shared
from slidedp.exec.staging import add_chunks
from slidedp.graph.sizes import host_sum_bytes_per_elem
from slidedp.profile.host import ADAM_DRAM_BYTES_PER_PARAM

sys.path.insert(0, os.path.dirname(__file__))
from chunk_cost_probe import Load, gil_load, team_chunks_ms  # noqa: E402

MIB = 1 << 20
D2H_RING = 4  # the executor's d2h_staging_chunks ring, per rank
ADAM_CONDITIONS = ("reused", "cold", "after_d2h", "cold_gil", "cold_dma", "cold_dma_paced")


class Probe:
    """The state, the rings and the timed kernels of one chunk size (module docstring)."""

    def __init__(self, p, m, v, n: int, device: str, threads: int, chunks: int, ranks: int,
                 cold_ring_bytes: int):
        self.p, self.m, self.v, self.n, self.device = p, m, v, n, device
        self.threads, self.chunks = threads, chunks
        self.ring = [torch.full((n,), 1e-3)
                     for _ in range(ranks * D2H_RING + max(ranks * D2H_RING,
                                                           cold_ring_bytes // (4 * n)))]
        self.fresh = ranks * D2H_RING  # the D2H rings' slots: ring[:fresh]; cold: the rest
        self.cold_next = 0  # cold slots continue where the previous cold run stopped
        self.acc = torch.empty(n)
        self.reused = torch.full((n,), 1e-3)
        self.src = torch.full((n,), 1e-3, device="cuda" if device == "cuda" else "cpu")
        self.registered: list[torch.Tensor] = []
        self.dma_ring: list[torch.Tensor] | None = None  # the cold_dma loads' own D2H ring

    def __enter__(self) -> Probe:
        for g in self.ring if self.device == "cuda" else []:
            cuda_host_register(g)
            self.registered.append(g)
        return self

    def __exit__(self, *exc) -> None:
        for g in self.registered:
            cuda_host_unregister(g)

    def download(self, slots: list[torch.Tensor]) -> None:
        for g in slots:
            g.copy_(self.src, non_blocking=self.device == "cuda")
        if self.device == "cuda":
            torch.cuda.synchronize()

    def dma_load(self, pause_s: float):
        """A background D2H stream into a ring of its own (the cold_dma conditions)."""
        if self.dma_ring is None:
            self.dma_ring = [torch.empty_like(self.acc) for _ in range(D2H_RING)]
            for g in self.dma_ring if self.device == "cuda" else []:
                cuda_host_register(g)
                self.registered.append(g)
        ring = self.dma_ring

        def body(halt: threading.Event) -> None:
            k = 0
            while not halt.is_set():
                self.download([ring[k % D2H_RING]])
                k += 1
                if pause_s:
                    halt.wait(pause_s)
        return body

    def slots(self, i: int, ranks: int, fresh: bool) -> list[torch.Tensor]:
        """The ranks' slots of chunk i: in the D2H rings (fresh) or the next ones of the cold
        part of the ring, never written by a D2H and last touched a whole cold ring ago."""
        if fresh:
            return [self.ring[(i * ranks + r) % (ranks * D2H_RING)] for r in range(ranks)]
        cold = len(self.ring) - self.fresh
        out = [self.ring[self.fresh + (self.cold_next + r) % cold] for r in range(ranks)]
        self.cold_next += ranks
        return out

    def adam(self, i: int, g: torch.Tensor) -> None:
        n, cfg = self.n, AdamWConfig()
        k = i % (self.p.numel() // n)
        adamw_chunk(self.p[k * n:(k + 1) * n], g, self.m[k * n:(k + 1) * n],
                    self.v[k * n:(k + 1) * n], 1, cfg, cfg.lr)

    def host_sum(self, i: int, ranks: int, fresh: bool) -> None:
        acc = add_chunks(self.slots(i, ranks, fresh), self.acc)
        torch.dot(acc, acc)

    def run(self, condition: str, ranks: int) -> list[float]:
        """Per-chunk ms of one condition."""
        def fresh_slots(i: int) -> None:
            self.download(self.slots(i, ranks, True))

        def sum_first(i: int) -> None:
            fresh_slots(i)
            self.host_sum(i, ranks, True)

        def cold(i: int) -> None:
            self.adam(i, self.slots(i, 1, False)[0])

        timed, before = {
            "reused": (lambda i: self.adam(i, self.reused), None),
            "cold": (cold, None), "cold_gil": (cold, None), "cold_dma": (cold, None),
            "cold_dma_paced": (cold, None),
            "after_d2h": (lambda i: self.adam(i, self.slots(i, 1, True)[0]), fresh_slots),
            "sum_cold": (lambda i: self.host_sum(i, ranks, False), None),
            "sum_after_d2h": (lambda i: self.host_sum(i, ranks, True), fresh_slots),
            "adam_after_sum": (lambda i: self.adam(i, self.acc), sum_first),
        }[condition]
        beside = {"cold_gil": lambda: gil_load(self.device), "cold_dma": lambda: self.dma_load(0.0),
                  "cold_dma_paced": lambda: self.dma_load(0.005)}.get(condition)
        load = None if beside is None else Load(beside())
        ms = team_chunks_ms(self.threads, self.chunks, timed, before)
        if load is not None:
            load.stop()  # raises the load's error: the condition was then measured without it
        return ms


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[16.0, 64.0, 256.0],
                    help="FP32 gradient chunk sizes in MiB, as the plan's d2h_chunk_mib")
    ap.add_argument("--update-threads", type=int, default=12)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--sum-ranks", type=int, nargs="*", default=[2, 4],
                    help="ranks whose chunks a HOST_SUM adds (the cpu reduction); none: no sums")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--state-gib", type=float, default=1.0,
                    help="at least this much per array of p, m, v (and 8 chunks)")
    ap.add_argument("--cold-ring-gib", type=float, default=2.0,
                    help="the cold conditions' gradient slots, cycled")
    ap.add_argument("--state-memory", choices=("process", "shm"), default="process",
                    help="p, m, v in the process's memory or mapped as the executor's host state")
    ap.add_argument("--adam-only", action="store_true", help="no host sums")
    ap.add_argument("--repeats", type=int, default=2, help="times each condition runs, interleaved")
    a = ap.parse_args()
    if a.repeats < 1:
        ap.error(f"--repeats: 1 or more, got {a.repeats}")
    if any(r < 2 for r in a.sum_ranks):
        ap.error(f"--sum-ranks: 2 or more ranks, got {a.sum_ranks}")
    sizes = [int(c * MIB) // 4 for c in a.chunk_mib]
    state = max(8 * max(sizes), int(a.state_gib * (1 << 30)) // 4)  # p, m, v come from DRAM
    memory = private_shared if a.state_memory == "shm" else \
        (lambda numel, dtype: torch.empty(numel, dtype=dtype))
    p, m, v = (memory(state, torch.float32).fill_(x) for x in (0.5, 0.0, 0.0))
    conditions = [(c, 1) for c in ADAM_CONDITIONS] + [
        (c, r) for r in ([] if a.adam_only else a.sum_ranks)
        for c in ("sum_cold", "sum_after_d2h", "adam_after_sum")]
    rows = []
    for n in sizes:
        with Probe(p, m, v, n, a.device, a.update_threads, a.chunks,
                   max(a.sum_ranks, default=1), int(a.cold_ring_gib * (1 << 30))) as probe:
            for cond, ranks in conditions * a.repeats:  # interleaved
                ms = probe.run(cond, ranks)
                mean = statistics.mean(ms)
                counted = host_sum_bytes_per_elem(ranks) if cond.startswith("sum") \
                    else ADAM_DRAM_BYTES_PER_PARAM
                row = {"chunk_mib": n * 4 / MIB, "condition": cond, "ranks": ranks,
                       "threads": a.update_threads, "mean_ms": mean,
                       "median_ms": statistics.median(ms), "max_ms": max(ms), "chunks": len(ms),
                       "counted_gbps": counted * n / mean / 1e6}
                rows.append(row)
                print(json.dumps(row), flush=True)
    with open(a.out, "w") as f:
        json.dump({"device": a.device, "state_memory": a.state_memory,
                   "machine_threads": torch.get_num_threads(), "rows": rows},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
