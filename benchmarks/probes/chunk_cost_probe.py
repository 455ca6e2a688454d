"""Why does the executor's CAST of a chunk take ~1 ms longer than the profile's back-to-back cast?
(issue 6: the 4B host-bound cases under-predicted by 13-19% on nvidia-h200-x2.)

    python3 benchmarks/probes/chunk_cost_probe.py OUT.json [--chunk-mib 64 256] [--cast-threads 24]
        [--update-threads 24] [--chunks 48] [--device cuda|cpu]

The cast of one chunk, `staging[i % 4][:n].copy_(master[k n:(k + 1) n])` (FP32 -> BF16 into a
pinned ring, as engine._run_cast), run by a thread of its own with its own OpenMP team
(interpreter.own_omp_team), under each condition the executor adds to the profile's clean loop:
  b2b         chunks back to back (the profile's CastChunkBench)
  gap         a 1 ms idle wait before each chunk (the agent waiting for a predecessor: do the
              OpenMP threads fall asleep and take long to wake?)
  gil         back to back while the main thread launches small CUDA kernels in a Python loop,
              holding the GIL between them as the compute agent does at micro-batch 1
  gil-0.5ms   the same with sys.setswitchinterval(0.0005) (Python's default is 5 ms)
  adam        back to back while an update thread runs the fused AdamW on chunks of its own
              (the DRAM share the model already takes from the profile's teams)
  all         gap + gil + adam
Each condition times `--chunks` chunks on the perf_counter around the copy_ call alone (as the
executor's Timeline records a CAST) and writes the mean and median ms per chunk. On the CPU
(`--device cpu`) the gil load is a Python loop of small CPU tensor ops.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time

import torch

from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.host_state import cuda_host_register, cuda_host_unregister
from slidedp.exec.interpreter import own_omp_team

MIB = 1 << 20
RING = 4
CONDITIONS = ("b2b", "gap", "gil", "gil-0.5ms", "adam", "all")


class Load:
    """A background load in a thread of its own, running until stop(); stop() raises the
    load's error, if it failed (its condition was then measured without it)."""

    def __init__(self, body):
        self.halt = threading.Event()
        self.error: BaseException | None = None

        def run() -> None:
            try:
                body(self.halt)
            except BaseException as e:  # noqa: BLE001 - re-raised by stop()
                self.error = e
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()
        if self.error is not None:
            raise RuntimeError("a background load failed") from self.error


def gil_load(device: str):
    """The compute agent at micro-batch 1: many short kernel launches from Python."""
    x = torch.ones(256, device=device)

    def body(halt: threading.Event) -> None:
        while not halt.is_set():
            for _ in range(64):
                x.mul_(1.0).add_(0.0)
            if device == "cuda":
                torch.cuda.synchronize()  # keep the queue short, so launches are not stalled
    return body


def adam_load(elems: int, threads: int):
    p, g = torch.full((elems,), 0.5), torch.full((elems,), 1e-3)
    m, v = torch.zeros(elems), torch.zeros(elems)
    cfg = AdamWConfig()

    def body(halt: threading.Event) -> None:
        own_omp_team(threads)
        while not halt.is_set():
            adamw_chunk(p, g, m, v, 1, cfg, cfg.lr)
    return body


def team_chunks_ms(threads: int, chunks: int, run, before=None) -> list[float]:
    """Per-chunk ms of run(i), timed alone, in a thread of its own with its own OpenMP team of
    `threads` (as an executor agent), for chunks + 2 chunks, the first two untimed; before(i),
    untimed, runs first each time."""
    out: list[float] = []

    def body() -> None:
        own_omp_team(threads)
        for i in range(chunks + 2):
            if before is not None:
                before(i)
            t0 = time.perf_counter()
            run(i)
            if i >= 2:
                out.append((time.perf_counter() - t0) * 1e3)

    t = threading.Thread(target=body)
    t.start()
    t.join()
    return out


def cast_chunks_ms(master: torch.Tensor, ring: torch.Tensor, n: int, chunks: int, threads: int,
                   gap_s: float) -> list[float]:
    """Per-chunk ms of the cast thread's copy_ calls (after two untimed chunks)."""
    slices = master.numel() // n
    idle = threading.Event()

    def cast(i: int) -> None:
        ring[i % RING][:n].copy_(master[(i % slices) * n:(i % slices + 1) * n])

    return team_chunks_ms(threads, chunks, cast, (lambda _i: idle.wait(gap_s)) if gap_s else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--chunk-mib", type=float, nargs="+", default=[64.0, 256.0],
                    help="chunk sizes in BF16 MiB, as the plan's h2d_chunk_mib")
    ap.add_argument("--cast-threads", type=int, default=24)
    ap.add_argument("--update-threads", type=int, default=24)
    ap.add_argument("--chunks", type=int, default=48)
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    sizes = [int(c * MIB) // 2 for c in a.chunk_mib]
    big = max(sizes)
    master = torch.full((max(8 * big, 1 << 28),), 0.5)  # >= 1 GiB of FP32: read from DRAM
    ring = torch.zeros(RING, big, dtype=torch.bfloat16)
    if a.device == "cuda":
        cuda_host_register(ring)
    rows = []
    try:
        for n in sizes:
            for cond in CONDITIONS:
                loads = []
                if cond in ("gil", "gil-0.5ms", "all"):
                    loads.append(Load(gil_load(a.device)))
                if cond in ("adam", "all"):
                    loads.append(Load(adam_load(big, a.update_threads)))
                sys.setswitchinterval(0.0005 if cond == "gil-0.5ms" else 0.005)
                ms = cast_chunks_ms(master, ring, n, a.chunks, a.cast_threads,
                                    1e-3 if cond in ("gap", "all") else 0.0)
                for load in loads:
                    load.stop()
                row = {"chunk_mib": n * 2 / MIB, "condition": cond, "cast_threads": a.cast_threads,
                       "mean_ms": statistics.mean(ms), "median_ms": statistics.median(ms),
                       "max_ms": max(ms), "chunks": len(ms)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        sys.setswitchinterval(0.005)
        if a.device == "cuda":
            cuda_host_unregister(ring)
    with open(a.out, "w") as f:
        json.dump({"machine_threads": torch.get_num_threads(), "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
