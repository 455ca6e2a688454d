"""The CPU Adam on a BF16 gradient (plan.grad_widen = host) against an FP32 one, by widening
block size and thread count: is the BF16 path's extra time the widening or the per-block calls?

    python3 benchmarks/probes/widen_block_probe.py OUT.json [--elems N] [--threads 12 24]
Writes, per thread count, params/s of adamw_chunk on an FP32 gradient and on a BF16 one with
each block size (exec/adamw.WIDEN_BLOCK patched), median of 5 after a warm-up.
"""

from __future__ import annotations

import argparse
import json

import torch

from slidedp.exec import adamw
from slidedp.profile.timing import wall_median_s


def rate(fn, elems: int) -> float:
    return elems / wall_median_s(fn, warmup=1, repeats=5)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--elems", type=int, default=64 << 20)
    ap.add_argument("--threads", type=int, nargs="+", default=[12])
    ap.add_argument("--blocks", type=int, nargs="+", default=[1 << 18, 1 << 20, 1 << 22, 1 << 24])
    a = ap.parse_args()
    n, cfg = a.elems, adamw.AdamWConfig()
    p, m, v = torch.full((n,), 0.5), torch.zeros(n), torch.zeros(n)
    g32, g16 = torch.full((n,), 1e-3), torch.full((n,), 1e-3, dtype=torch.bfloat16)
    out = []
    for t in a.threads:
        torch.set_num_threads(t)
        row = {"threads": t, "fp32_params_per_s": rate(
            lambda: adamw.adamw_chunk(p, g32, m, v, 1, cfg, cfg.lr), n)}
        for b in a.blocks:
            adamw.WIDEN_BLOCK, adamw._scratch.block = b, None
            row[f"bf16_block_{b}"] = rate(lambda: adamw.adamw_chunk(p, g16, m, v, 1, cfg, cfg.lr), n)
        out.append(row)
        print(json.dumps(row))
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
