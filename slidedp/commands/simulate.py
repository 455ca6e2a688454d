"""`slidedp simulate`: the discrete-event simulator's answer for one (hardware, workload, plan)."""

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
from slidedp.sim.engine import SimConfig
from slidedp.sim.report import format_table, to_json
from slidedp.sim.simulator import check_routes, simulate
from slidedp.spec.errors import SpecError

# plan options whose explicit use is checked against the topology (check_routes)
ROUTE_OPTIONS = ("param_route", "update_sharding")


def register(sub) -> None:
    p = sub.add_parser("simulate", help="discrete-event simulation of the task graph",
                       description="Simulate the task graph with contention, bounded buffers and "
                       "version gates; report the steady-state step and where the GPUs wait.",
                       epilog=EXPOSURE_HELP)
    add_workload_options(p)
    add_plan_options(p)
    add_clip_option(p)
    g = p.add_argument_group("simulation")
    g.add_argument("--iterations", type=int, default=3, help="iterations simulated, >= 3 (default %(default)s)")
    g.add_argument("--no-contention", action="store_true",
                   help="every task at its uncontended duration (gives the analytic critical path)")
    g.add_argument("--no-buffer-limits", action="store_true", help="drop BUFFER edges")
    g.add_argument("--trace", metavar="FILE", help="write a Chrome trace JSON (Perfetto)")
    g.add_argument("--plot", metavar="FILE", help="write a Gantt PNG of the last step")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--verbose", action="store_true", help="print events and events per second")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    r = resolve(args)
    if args.iterations < 3:
        raise SpecError("command line", "--iterations", f"an integer >= 3, got {args.iterations}")
    check_routes(r.workload, r.plan, {k for k in ROUTE_OPTIONS if getattr(args, k)})
    cfg = SimConfig(iterations=args.iterations, contention=not args.no_contention,
                    buffers=not args.no_buffer_limits)
    res = simulate(r.hardware, r.workload, r.plan, cfg)
    d = to_json(res, r.workload, r.plan)
    if args.json:
        print(json.dumps(with_choice(d, r), indent=1, sort_keys=True))
    else:
        print(describe(r))
        print_choice(r)
        print(format_table(d))
    if args.verbose:
        print(f"simulated {res.graph.n_tasks} tasks, {res.run.events} events in {res.run.wall_s:.3f} s: "
              f"{res.events_per_s:,.0f} events/s")
    if args.trace:
        res.timeline().save_chrome_trace(args.trace)
    if args.plot:
        from slidedp.sim.plot import gantt

        gantt(res, args.plot)
    return 0
