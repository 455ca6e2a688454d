"""`slidedp predict`: the analytic model's answer for one (hardware, workload, plan)."""

from __future__ import annotations

import argparse
import json

from slidedp.commands.common import (
    add_clip_option,
    add_plan_options,
    add_workload_options,
    describe,
    print_choice,
    resolve,
    with_choice,
)
from slidedp.model.idle import EXPOSURE_HELP
from slidedp.model.predict import Prediction, predict
from slidedp.model.state_tier import TIERS, describe_tiers, host_bytes_by_tier
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.units import GIB


def register(sub) -> None:
    p = sub.add_parser("predict", help="analytic step-time prediction",
                       description="Predict the steady-state step time of a workload and plan "
                       "with the analytic model (resource bounds + critical path).",
                       epilog=EXPOSURE_HELP)
    add_workload_options(p)
    add_plan_options(p)
    add_clip_option(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def format_table(pred: Prediction, host_by_moments: str | None = None) -> str:
    """The prediction as aligned rows, the limiter's sentence last; `host_by_moments`: the host
    memory with each moments format, in the row after the plan's own."""
    rows = [
        ("step time (predicted)", f"{pred.step_time_s:.3f} s"),
        ("  resource lower bound", f"{pred.lower_bound_s:.3f} s"),
        ("  critical path", f"{pred.critical_path_s:.3f} s"),
        ("tokens/s", f"{pred.tokens_per_s:,.0f}"),
        ("bottleneck", f"{pred.bottleneck} ({100 * pred.bottleneck_utilization:.0f}% busy)"),
        ("C  GPU compute / step", f"{pred.compute_s:.3f} s"),
        ("H  host work / step", f"{pred.host_s:.3f} s ({pred.host_resource})"),
        ("E  exposed", f"{pred.exposed_s:.3f} s"),
        ("R_cross", f"{pred.r_cross:.2f} GPUs"),
    ]
    for k, v in pred.traffic_bytes.items():
        if v:
            rows.append((f"traffic {k} / step", f"{v / GIB:.2f} GiB"))
    rows.append(("GPU memory peak / GPU", f"{pred.memory['gpu_peak_bytes'] / GIB:.2f} GiB"))
    rows.append(("host memory", f"{pred.memory['host_bytes'] / GIB:.2f} GiB"))
    if host_by_moments is not None:
        rows.append(("host memory by moments", host_by_moments))
    cp = ", ".join(f"{k.lower()} {v:.3f}" for k, v in sorted(
        pred.critical_path_by_channel_s.items(), key=lambda kv: -kv[1]))
    rows.append(("critical path by channel (s)", cp))
    w = max(len(a) for a, _ in rows)
    return "\n".join(f"{a:<{w}}  {b}" for a, b in rows) + "\n" + pred.limiter()


def run(args: argparse.Namespace) -> int:
    r = resolve(args)
    tiers = host_bytes_by_tier(r.workload, r.plan)
    try:
        pred = predict(r.hardware, r.workload, r.plan)
    except InfeasiblePlan as e:
        if e.what != "host memory":
            raise
        fits = [m for m in TIERS if tiers[m] <= r.hardware.host.ram_bytes]
        hint = f"--moments {fits[0]} fits" if fits else "no moments format fits"
        detail = str(e).partition("; ")[2]  # what check_fits said beyond the sizes
        raise InfeasiblePlan(e.what, e.need_bytes, e.have_bytes, f"{detail}; host memory by "
                             f"moments: {describe_tiers(r.hardware, tiers)}: {hint}") from None
    if args.json:
        print(json.dumps(with_choice(pred.to_json(), r), indent=1, sort_keys=True))
    else:
        print(describe(r))
        print_choice(r)
        print(format_table(pred, describe_tiers(r.hardware, tiers)))
    return 0
