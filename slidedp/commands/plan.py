"""`slidedp plan`: AutoPolicy chooses routes, chunks and per-layer activation policies under a GPU
memory cap, says why (per the simulator) and how long it took, and writes the plan TOML that
`slidedp simulate --plan FILE`, `predict --plan FILE` and `train --plan FILE` read."""

from __future__ import annotations

import argparse
from dataclasses import asdict
from enum import Enum
from pathlib import Path

from slidedp.commands.common import add_workload_options, positive
from slidedp.policy.auto import GIB, auto_plan
from slidedp.profile.tomlw import dumps
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="choose a plan automatically (AutoPolicy)",
        description="Rank route and chunk candidates with the simulator, cost the "
        "activation policies, solve the layer-count MILP under the GPU memory cap "
        "and write the chosen plan.",
    )
    add_workload_options(p)
    p.add_argument(
        "--gpu-memory-cap-gib",
        type=float,
        help="GPU memory per GPU the plan may use (default: the whole HBM)",
    )
    p.add_argument("--out", metavar="FILE", help="write the plan TOML ([plan] table) here")
    p.set_defaults(func=run)


def plan_toml(plan: Plan, comment: str) -> str:
    """The [plan] table of every Plan field, as parse_plan reads it back."""
    table = {
        k: (v.value if isinstance(v, Enum) else list(v) if isinstance(v, tuple) else v)
        for k, v in asdict(plan).items()
    }
    return dumps({"plan": table}, comment)


def run(args: argparse.Namespace) -> int:
    hw = load_hardware(args.hardware)
    gpus = positive(args.gpus, "--gpus") or hw.gpu.count
    mb = positive(args.micro_batch, "--micro-batch")
    gb = positive(args.global_batch, "--global-batch") or mb * gpus
    positive(args.seq, "--seq")
    wl = Workload(load_model(args.model), args.seq, gb, mb, gpus, where="command line")
    cap = hw.gpu.hbm_bytes
    if args.gpu_memory_cap_gib is not None:
        if args.gpu_memory_cap_gib <= 0:
            raise SpecError(
                "command line",
                "--gpu-memory-cap-gib",
                f"a positive number, got {args.gpu_memory_cap_gib}",
            )
        cap = args.gpu_memory_cap_gib * GIB
    print(
        f"{hw.name} | {wl.model.name} seq {wl.seq_len} | {wl.gpus} GPU x micro-batch "
        f"{wl.micro_batch} x accum {wl.accum_steps} = global batch {wl.global_batch}"
    )
    plan, report = auto_plan(hw, wl, cap)
    lines = report.lines()
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(plan_toml(plan, "written by slidedp plan\n" + "\n".join(lines)))
        print(f"wrote {args.out}")
    return 0
