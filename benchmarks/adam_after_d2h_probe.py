"""Does the executor's update of a chunk read its gradient from the CPU's last-level cache?
(issues 6 and 8: on nvidia-h200, 2026-12-01 08:36, Qwen3-8B at micro-batch 4 with every layer in
the window, the executor's update channel was busy 1.83 s a step with 64 MiB chunks and 2.06 s
with 256 MiB, against 2.39 s simulated: 125 GB/s at 28 B a parameter with 64 MiB chunks, above
the profile's largest DRAM rate, 111 GB/s.)

    python3 benchmarks/adam_after_d2h_probe.py OUT.json [--chunk-mib 16 64 256]
        [--update-threads 12] [--chunks 24] [--device cuda|cpu]

Per chunk size (FP32 gradient MiB, as the plan's d2h_chunk_mib), the fused AdamW of one chunk
(slidedp.exec.adamw.adamw_chunk, a thread with its own OpenMP team of --update-threads, as the
executor's update agent), on p, m, v slices rotating through a state larger than any cache, with
its gradient:
  cold       from a pinned ring slot written long before (a rotating 2 GiB ring: from DRAM)
  after_d2h  from a pinned ring slot the GPU has just written (a D2H copy of the chunk, waited
             for, then the update: the executor's D2H -> ADAM edge); on the CPU (`--device cpu`)
             a copy_ from a source buffer stands in for the DMA (kinder than a DMA: the cores
             that then run Adam wrote the slot, so it can sit in their own caches)
Each row: mean and median ms per chunk over --chunks chunks (two untimed first), and the state
traffic rate at 28 B a parameter. If after_d2h is faster than cold by about the gradient's 4 of
the 28 B, the model should count the gradient read of a chunk that fits the cache as cache
traffic (slidedp/graph/costs.py), as for the host sum's accumulator (benchmarks/RESULTS.md,
"2026-12-01 06:04 onwards").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.host_state import cuda_host_register, cuda_host_unregister

sys.path.insert(0, os.path.dirname(__file__))
from chunk_cost_probe import team_chunks_ms  # noqa: E402

MIB = 1 << 20
STATE_BYTES_PER_PARAM = 28  # read p, m, v, g and write p, m, v, FP32
COLD_RING_BYTES = 2 << 30  # gradient slots cycled by the cold condition: well beyond any LLC


def update_ms(p: torch.Tensor, m: torch.Tensor, v: torch.Tensor, grads: list[torch.Tensor],
              refresh, n: int, chunks: int, threads: int) -> list[float]:
    """Per-chunk ms of adamw_chunk in a thread of its own; refresh(i) (untimed) prepares the
    gradient slot grads[i % len(grads)] first."""
    slices, cfg = p.numel() // n, AdamWConfig()

    def update(i: int) -> None:
        k = i % slices
        adamw_chunk(p[k * n:(k + 1) * n], grads[i % len(grads)], m[k * n:(k + 1) * n],
                    v[k * n:(k + 1) * n], 1, cfg, cfg.lr)

    return team_chunks_ms(threads, chunks, update, refresh)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[16.0, 64.0, 256.0],
                    help="FP32 gradient chunk sizes in MiB, as the plan's d2h_chunk_mib")
    ap.add_argument("--update-threads", type=int, default=12)
    ap.add_argument("--chunks", type=int, default=24)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    a = ap.parse_args()
    sizes = [int(c * MIB) // 4 for c in a.chunk_mib]
    big = max(sizes)
    state = max(8 * big, 1 << 28)  # >= 1 GiB per array: p, m, v come from DRAM
    p, m, v = torch.full((state,), 0.5), torch.zeros(state), torch.zeros(state)
    rows = []
    for n in sizes:
        ring = [torch.full((n,), 1e-3) for _ in range(max(2, COLD_RING_BYTES // (4 * n)))]
        registered: list[torch.Tensor] = []
        try:
            for g in ring if a.device == "cuda" else []:
                cuda_host_register(g)
                registered.append(g)
            src = (torch.full((n,), 1e-3, device="cuda") if a.device == "cuda"
                   else torch.full((n,), 1e-3))
            for cond in ("cold", "after_d2h", "cold", "after_d2h"):  # interleaved, twice
                if cond == "cold":
                    def refresh(_i: int) -> None:
                        pass
                    grads = ring
                else:
                    grads = ring[:4]  # the executor's d2h_staging_chunks ring

                    def refresh(i: int, grads=grads, n=n, src=src) -> None:
                        grads[i % len(grads)].copy_(src, non_blocking=a.device == "cuda")
                        if a.device == "cuda":
                            torch.cuda.synchronize()
                ms = update_ms(p, m, v, grads, refresh, n, a.chunks, a.update_threads)
                mean = statistics.mean(ms)
                row = {"chunk_mib": n * 4 / MIB, "condition": cond, "threads": a.update_threads,
                       "mean_ms": mean, "median_ms": statistics.median(ms), "max_ms": max(ms),
                       "chunks": len(ms), "state_gbps": STATE_BYTES_PER_PARAM * n / mean / 1e6}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            for g in registered:
                cuda_host_unregister(g)
    with open(a.out, "w") as f:
        json.dump({"device": a.device, "machine_threads": torch.get_num_threads(), "rows": rows},
                  f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
