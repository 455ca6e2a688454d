"""Update rate of the CPU AdamW with FP32, BF16 and int8 moments (plan.moments), against threads.

Each format updates N parameters of a host state of its own (HostState.create: the memory the
executor's state lives in) in chunks of --chunk-mib of FP32 gradient, as the executor's ADAM
tasks run them (HostState.moment_span(...).adamw), with an FP32 gradient (plan.grad_widen =
gpu). Rate = N / wall time of a whole pass, median of --repeats passes after one warm-up pass.
The state traffic printed beside it counts what the pass must move: p read + written (8 B), g
read (4 B), m and v read + written in their format (2 x 8, 2 x 4 or 2 x 2.03 B), the executor's
host-memory bytes per parameter. Where bitsandbytes imports, its CPU 8-bit blockwise AdamW
(bitsandbytes.functional.optimizer_update_8bit_blockwise, one call per chunk) is timed on the
same sizes for comparison (it allocates an FP32 copy of each chunk's state per call).

    python benchmarks/moments_rate.py --params 32e6 --threads 1,2
    python benchmarks/moments_rate.py --params 256e6 --threads 4,8,12,16 --json OUT.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from slidedp.exec import moments
from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.host_state import HostState
from slidedp.exec.moments import QBLOCK
from slidedp.spec.plan import Moments

MIB = 2**20


def state_bytes(fmt: str) -> float:
    """Host-memory bytes one parameter's update moves (module docstring); bnb: as int8."""
    return 8 + 4 + 2 * Moments("int8" if fmt == "bnb" else fmt).bytes_per_param


def ours(fmt: str, n: int, chunk: int, cfg: AdamWConfig):
    """A pass over n parameters: one callable, its state closed on (the host state)."""
    hs = HostState.create([n], moments=fmt)
    hs.unit_master(0).fill_(0.5)
    g = torch.full((n,), 1e-3)
    steps = [0]

    def one_pass():
        steps[0] += 1
        p = hs.unit_master(0)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            hs.moment_span(0, lo, hi).adamw(p[lo:hi], g[lo:hi], steps[0], cfg, cfg.lr)

    return one_pass, hs.close


def bnb(n: int, chunk: int, cfg: AdamWConfig):
    import bitsandbytes.functional as F

    p, g = torch.full((n,), 0.5), torch.full((n,), 1e-3)
    m, v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    am, av = torch.zeros(-(-n // QBLOCK)), torch.zeros(-(-n // QBLOCK))
    q1, q2 = F.create_dynamic_map(signed=True), F.create_dynamic_map(signed=False)
    steps = [0]

    def one_pass():
        steps[0] += 1
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            b0, b1 = lo // QBLOCK, -(-hi // QBLOCK)
            F.optimizer_update_8bit_blockwise(
                "adam", g[lo:hi], p[lo:hi], m[lo:hi], v[lo:hi], cfg.betas[0], cfg.betas[1],
                0.0, 0.0, cfg.eps, steps[0], cfg.lr, q1, q2, am[b0:b1], av[b0:b1],
                cfg.weight_decay, 1.0)

    return one_pass, lambda: None


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=32e6)
    ap.add_argument("--threads", default="1,2", help="comma-separated torch thread counts")
    ap.add_argument("--chunk-mib", type=float, default=64.0, help="FP32 gradient MiB per ADAM")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--formats", default="fp32,bf16,int8,bnb")
    ap.add_argument("--compact-block", type=int, help="exec.moments.COMPACT_BLOCK for bf16 and "
                    "int8 (default: the module's)")
    ap.add_argument("--json", help="write the rates here")
    a = ap.parse_args(argv)
    if a.compact_block:
        moments.COMPACT_BLOCK = a.compact_block
    n = int(a.params)
    chunk = max(QBLOCK, int(a.chunk_mib * MIB / 4) // QBLOCK * QBLOCK)
    cfg = AdamWConfig(lr=1e-4)
    formats = a.formats.split(",")
    if "bnb" in formats:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            print("bitsandbytes does not import: its CPU 8-bit AdamW is not timed", flush=True)
            formats.remove("bnb")
    out = {"params": n, "chunk_elems": chunk, "compact_block": moments.COMPACT_BLOCK, "rates": {}}
    print(f"{n / 1e6:.0f}M parameters, ADAM chunks of {chunk} parameters, compact blocks of "
          f"{moments.COMPACT_BLOCK}; Gparam/s (state GB/s)", flush=True)
    print("threads  " + "  ".join(f"{f:>16}" for f in formats), flush=True)
    for threads in (int(t) for t in a.threads.split(",")):
        torch.set_num_threads(threads)
        row = {}
        for fmt in formats:
            fn, close = bnb(n, chunk, cfg) if fmt == "bnb" else ours(fmt, n, chunk, cfg)
            try:
                row[fmt] = n / median_s(fn, a.repeats)
            finally:
                close()
        out["rates"][threads] = row
        cells = [f"{row[f] / 1e9:6.3f} ({row[f] * state_bytes(f) / 1e9:5.1f})" for f in formats]
        ratio = "  ".join(f"{f}/fp32 {row[f] / row['fp32']:.2f}" for f in formats
                          if f != "fp32" and "fp32" in row)
        print(f"{threads:7d}  " + "  ".join(f"{c:>16}" for c in cells) + f"   {ratio}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
