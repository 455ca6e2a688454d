"""`slidedp plan`: AutoPolicy chooses routes, chunks, the window and per-layer activation policies
under a GPU memory cap, says why (per the simulator, and per real probes with --probe) and how
long it took, and writes the plan TOML that `slidedp simulate --plan FILE`, `predict --plan FILE`
and `train --plan FILE` read.

--probe confirms the finalists with a few real executor steps each on this machine's device
(--device; random weights; one rank only, see policy/probe.py). --grad-clip X plans for an
optimizer that clips (spec/plan.py plan_for_clipping; 0: no clipping)."""

from __future__ import annotations

import argparse
from pathlib import Path

from slidedp.commands.choose import (
    DEFAULT_TIME_LIMIT_S,
    cap_bytes,
    choose_plan,
    default_device,
    time_limit,
    write_plan,
)
from slidedp.commands.common import (
    add_clip_option,
    add_workload_options,
    describe_workload,
    grad_clip,
    resolve_workload,
    with_network,
)
from slidedp.spec.hardware import load_hardware
from slidedp.spec.plan import Moments, default_plan, plan_for_clipping


def register(sub) -> None:
    p = sub.add_parser(
        "plan",
        help="choose a plan automatically (AutoPolicy)",
        description="Rank route, chunk and window candidates with the simulator, cost the "
        "activation policies, solve the layer-count MILP under the GPU memory cap, "
        "optionally confirm the finalists with real probes, and write the chosen plan.",
    )
    add_workload_options(p)
    add_clip_option(p)
    p.add_argument(
        "--gpu-memory-cap-gib",
        type=float,
        help="GPU memory per GPU the plan may use (default: the whole HBM)",
    )
    p.add_argument("--probe", action="store_true",
                   help="confirm the finalists with short real runs of the executor on this "
                   "machine (one GPU only; random weights)")
    p.add_argument("--device", choices=("cpu", "cuda"),
                   help="where --probe runs (default: cuda when available, else cpu)")
    p.add_argument("--time-limit-s", type=float, default=DEFAULT_TIME_LIMIT_S,
                   help="with --probe: no probe starts that would end the selection past this "
                   f"(the best simulated finalist is always probed; default {DEFAULT_TIME_LIMIT_S:g})")
    p.add_argument("--moments", choices=[m.value for m in Moments],
                   help="the Adam moments' format (default: the cheapest that fits host RAM, "
                   "fp32 first; model/state_tier.py)")
    p.add_argument("--out", metavar="FILE", help="write the plan TOML ([plan] table) here")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    hw = with_network(load_hardware(args.hardware), args)
    wl = resolve_workload(args, hw)
    cap = cap_bytes(hw, args.gpu_memory_cap_gib)
    print(describe_workload(hw, wl))
    device = (args.device or default_device()) if args.probe else None
    clip = grad_clip(args.grad_clip)
    base = plan_for_clipping(default_plan(hw.fabric.kind), clip)
    if args.moments:
        base = base.with_overrides(moments=Moments(args.moments))
    plan, report = choose_plan(hw, wl, cap, base=base, probe_device=device,
                               time_limit_s=time_limit(args.time_limit_s),
                               choose_moments=not args.moments)
    print("\n".join(report.lines()))
    if args.out:
        write_plan(Path(args.out), plan, report, "slidedp plan")
        print(f"wrote {args.out}")
    return 0
