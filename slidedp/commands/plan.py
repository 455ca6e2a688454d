"""`slidedp plan`: AutoPolicy chooses routes, chunks and per-layer activation policies under a GPU
memory cap, says why (per the simulator) and how long it took, and writes the plan TOML that
`slidedp simulate --plan FILE`, `predict --plan FILE` and `train --plan FILE` read."""

from __future__ import annotations

import argparse
from pathlib import Path

from slidedp.commands.common import add_workload_options, describe_workload, resolve_workload
from slidedp.policy.auto import GIB, auto_plan
from slidedp.profile.tomlw import dumps
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import load_hardware
from slidedp.spec.plan import Plan, plan_dict


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
    return dumps({"plan": plan_dict(plan)}, comment)


def run(args: argparse.Namespace) -> int:
    hw = load_hardware(args.hardware)
    wl = resolve_workload(args, hw)
    cap = hw.gpu.hbm_bytes
    if args.gpu_memory_cap_gib is not None:
        if args.gpu_memory_cap_gib <= 0:
            raise SpecError(
                "command line",
                "--gpu-memory-cap-gib",
                f"a positive number, got {args.gpu_memory_cap_gib}",
            )
        cap = args.gpu_memory_cap_gib * GIB
    print(describe_workload(hw, wl))
    plan, report = auto_plan(hw, wl, cap)
    lines = report.lines()
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text(plan_toml(plan, "written by slidedp plan\n" + "\n".join(lines)))
        print(f"wrote {args.out}")
    return 0
