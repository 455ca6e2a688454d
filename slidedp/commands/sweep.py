"""`slidedp sweep`: simulate a grid (GPUs x global batch x routes x chunk sizes); CSV + plot."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pandas as pd
from tqdm import tqdm

from slidedp.commands.common import MIN_CHUNK_MIB
from slidedp.sim.sweep import SweepSpec, load_sweep, run_sweep
from slidedp.spec.errors import SpecError


def register(sub) -> None:
    p = sub.add_parser("sweep", help="simulate a grid of workloads and plans",
                       description="Simulate every point of a grid (from a [sweep] TOML file, "
                       "overridden by options) and write a CSV and a plot.")
    p.add_argument("file", nargs="?", help="sweep TOML file ([sweep] table)")
    p.add_argument("--hardware")
    p.add_argument("--model")
    p.add_argument("--seq", type=int)
    p.add_argument("--micro-batch", type=int)
    p.add_argument("--gpus", type=int, nargs="+")
    p.add_argument("--global-batch", type=int, nargs="+")
    p.add_argument("--param-route", nargs="+", choices=["replicated", "sharded"])
    p.add_argument("--grad-route", nargs="+", choices=["gpu", "cpu"])
    p.add_argument("--chunk-mib", type=float, nargs="+")
    p.add_argument("--update-workers", type=int)
    p.add_argument("--out", default="sweep.csv", help="CSV file (default %(default)s)")
    p.add_argument("--plot", default="sweep.png", help="PNG file (default %(default)s)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    spec = load_sweep(args.file) if args.file else SweepSpec()
    over = {k: getattr(args, k) for k in ("hardware", "model", "seq", "micro_batch", "update_workers",
                                          "gpus", "global_batch", "param_route", "grad_route",
                                          "chunk_mib")}
    for k in ("seq", "micro_batch", "update_workers"):
        if over[k] is not None and over[k] < 1:
            raise SpecError("command line", f"--{k.replace('_', '-')}", f"a positive integer, got {over[k]}")
    spec = replace(spec, **{k: tuple(v) if isinstance(v, list) else v
                            for k, v in over.items() if v is not None})
    for mib in spec.chunk_mib:
        if mib < MIN_CHUNK_MIB:
            where, name = (("command line", "--chunk-mib") if over["chunk_mib"] is not None
                           else (args.file, "chunk_mib"))
            raise SpecError(where, name, f"chunk sizes of at least {MIN_CHUNK_MIB:g} MiB, got "
                            f"{mib:g}")
    rows = run_sweep(spec, progress=lambda pts: tqdm(pts, desc="sweep", unit="point"))
    df = pd.DataFrame(rows)
    df.to_csv(args.out, index=False)
    plot(df, args.plot)
    ok = df[df["error"] == ""]
    print(f"{len(ok)} of {len(df)} points simulated -> {args.out}, {args.plot}")
    if len(ok):
        cols = ["gpus", "global_batch", "param_route", "grad_route", "chunk_mib", "step_time_s",
                "tokens_per_s", "gpu_idle_s"]
        print(ok[cols].to_string(index=False, float_format=lambda x: f"{x:.3f}"))
    for e in df.loc[df["error"] != "", "error"]:
        print(f"skipped: {e}")
    return 0


def plot(df: pd.DataFrame, path: str) -> None:
    """tokens/s against GPUs, one line per (routes, chunk, global batch)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    ok = df[df["error"] == ""] if "error" in df else df
    for key, part in ok.groupby(["param_route", "grad_route", "chunk_mib", "global_batch"]):
        part = part.sort_values("gpus")
        ax.plot(part["gpus"], part["tokens_per_s"], marker="o",
                label=f"{key[0]}/{key[1]}, {key[2]:g} MiB, batch {key[3]}")
    ax.set_xlabel("GPUs")
    ax.set_ylabel("tokens/s (simulated)")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
