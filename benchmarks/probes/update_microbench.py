"""CPU update microbenchmark: where the time of one gradient chunk's AdamW goes, and whether
processing it in cache-sized sub-blocks (convert -> norm -> fused AdamW -> BF16 copy per block)
beats whole-chunk passes. Reports Gparam/s and the DRAM floor at 28 B/param.

usage: python3 benchmarks/probes/update_microbench.py [CHUNK_MELEMS] [THREADS]
"""

import sys
import time

import torch

from slidedp.exec.adamw import AdamWConfig, adamw_chunk


def timed(fn, reps=5):
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main():
    n = int(float(sys.argv[1]) * 2**20) if len(sys.argv) > 1 else 32 * 2**20
    threads = int(sys.argv[2]) if len(sys.argv) > 2 else torch.get_num_threads()
    torch.set_num_threads(threads)
    units = 8  # rotate over several chunks' state so that nothing stays in cache between reps
    p = [torch.randn(n) * 0.02 for _ in range(units)]
    m = [torch.zeros(n) for _ in range(units)]
    v = [torch.zeros(n) for _ in range(units)]
    copy = [torch.empty(n, dtype=torch.bfloat16) for _ in range(units)]
    g16 = [torch.randn(n).bfloat16() for _ in range(units)]
    g32 = torch.empty(n)
    cfg = AdamWConfig(lr=1e-5, weight_decay=0.0)
    k = [0]

    def nxt():
        k[0] = (k[0] + 1) % units
        return k[0]

    def whole():
        i = nxt()
        g32.copy_(g16[i])
        float(torch.dot(g32, g32))
        adamw_chunk(p[i], g32, m[i], v[i], 1, cfg, 1e-5)
        copy[i].copy_(p[i])

    parts = {
        "convert": lambda: g32.copy_(g16[nxt()]),
        "dot": lambda: float(torch.dot(g32, g32)),
        "adamw": lambda: adamw_chunk(p[(i := nxt())], g32, m[i], v[i], 1, cfg, 1e-5),
        "bf16 copy": lambda: copy[(i := nxt())].copy_(p[i]),
        "whole chunk, 4 passes": whole,
    }

    def blocked(block):
        def run():
            i = nxt()
            for lo in range(0, n, block):
                hi = min(n, lo + block)
                gb = g32[:hi - lo]
                gb.copy_(g16[i][lo:hi])
                float(torch.dot(gb, gb))
                adamw_chunk(p[i][lo:hi], gb, m[i][lo:hi], v[i][lo:hi], 1, cfg, 1e-5)
                copy[i][lo:hi].copy_(p[i][lo:hi])
        return run

    for b in (2**18, 2**20, 2**22):
        parts[f"blocked {b >> 10}K"] = blocked(b)
    print(f"chunk {n / 2**20:.0f}M params, {threads} threads")
    for name, fn in parts.items():
        t = timed(fn)
        print(f"{name:<24}{t * 1e3:8.1f} ms {n / t / 1e9:6.2f} Gparam/s")


if __name__ == "__main__":
    main()
