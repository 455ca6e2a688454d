"""`slidedp validate`: measure configurations with the executor and put them beside the analytic
and simulated predictions (slidedp/validate/).

    slidedp validate --hardware PROFILE.toml --cases CASES.toml [--out validation] [--device cuda]
                     [--iters 15 --discard 8 --runs 2] [--machine NAME] [--select 'h200m-4b-*']
    slidedp validate --predict-only [--hardware NEW.toml] [--select 'h200x2-*'] [--out validation]
    slidedp validate --import-results validation/imports.toml [--out validation]
    slidedp validate --cross-kind [FILE] [--json] [--out validation] [--select GLOB]

Each run ends by rewriting SUMMARY.md and summary.csv over every stored case under --out, except
--cross-kind, which reads the stored cases and writes nothing (slidedp/validate/cross_kind.py).
"""

from __future__ import annotations

import argparse
import json
from fnmatch import fnmatch
from pathlib import Path

from slidedp.spec.errors import SpecError


def register(sub) -> None:
    p = sub.add_parser("validate", help="measured against predicted step times, stored as data",
                       description="Run the executor on the configurations of a cases file and "
                       "store, per case, the measured figures beside the analytic and simulated "
                       "predictions for a hardware file; or re-predict / import stored cases.")
    p.add_argument("--hardware", help="hardware preset or TOML (from `slidedp profile`); with "
                   "--predict-only, replaces each case's stored hardware")
    p.add_argument("--cases", help="cases TOML ([[case]] tables; see slidedp/validate/cases.py)")
    p.add_argument("--out", default="validation", help="validation root (default %(default)s)")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                   help="where the executor runs (cpu: a plumbing check; default %(default)s)")
    p.add_argument("--iters", type=int, default=15, help="steps per case (default %(default)s: "
                   "method.md section 10)")
    p.add_argument("--discard", type=int, default=8,
                   help="first steps left out of the mean (default %(default)s)")
    p.add_argument("--runs", type=int, default=2, help="runs per case, each on a host state of "
                   "its own; the step time is their mean (default %(default)s)")
    p.add_argument("--machine", default="", help="the machine's name in measured.json "
                   "(e.g. the lent kind, nvidia-h200-x2; default the hostname)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--predict-only", action="store_true",
                      help="recompute the predictions of stored cases; run nothing")
    mode.add_argument("--import-results", metavar="PROVENANCE.toml",
                      help="turn earlier benchmark results into stored cases (slidedp/validate/importer.py)")
    mode.add_argument("--cross-kind", nargs="?", const="", metavar="FILE",
                      help="predict the stored cases of the larger kinds from one one-GPU "
                      "profile and each kind's machine file (cores, sockets, links), beside the "
                      "same-kind error of that profile; FILE: a cross-kind file (default: the "
                      "package's, slidedp/presets/cross-kind/cross-kind.toml); writes nothing")
    p.add_argument("--json", action="store_true", help="with --cross-kind: print only the result "
                   "as JSON (errors in percent of the measured step)")
    p.add_argument("--select", default="*", help="only the cases whose names match this glob (of "
                   "the cases file; with --predict-only or --cross-kind, of the stored case folders)")
    p.set_defaults(func=run)


def command_line(a: argparse.Namespace) -> str:
    line = (f"slidedp validate --hardware {a.hardware} --cases {a.cases} --out {a.out} --device "
            f"{a.device} --iters {a.iters} --discard {a.discard} --runs {a.runs}")
    line += f" --machine {a.machine}" if a.machine else ""
    return line + (f" --select '{a.select}'" if a.select != "*" else "")


def print_summary(root: Path, rows: list[dict]) -> None:
    from slidedp.validate.summary import error_stats

    for model in ("analytic", "simulated"):
        s = error_stats(rows, model)
        if s["n"]:
            print(f"{model}: {s['n']} cases, MAPE {100 * s['mape']:.1f}%, max {100 * s['max']:.1f}% "
                  f"({s['max_case']})")
    print(f"summary: {root / 'SUMMARY.md'}, {root / 'summary.csv'}")


def predict_only(a: argparse.Namespace, root: Path) -> None:
    from slidedp.validate.predict import stored_hardware, write_predictions
    from slidedp.validate.store import stored_cases

    folders = stored_cases(root, a.select)
    if not folders:
        raise SpecError("--select", a.select, f"a glob matching stored cases under {root}")
    for folder in folders:
        hw, notes = (a.hardware, []) if a.hardware else stored_hardware(folder)
        pred = write_predictions(folder, hw, notes)
        print(f"{folder.name}: analytic {pred['analytic']['step_time_s']:.3f} s, simulated "
              f"{pred['simulated']['step_time_s']:.3f} s ({pred['hardware']['name']})")


def measure(a: argparse.Namespace, root: Path) -> list[str]:
    """Check, measure, predict; the names of the cases whose measurement failed."""
    from slidedp.model.memory import check_fits
    from slidedp.spec.hardware import load_hardware
    from slidedp.validate.cases import load_cases
    from slidedp.validate.measure import check_devices, measure_cases
    from slidedp.validate.predict import write_predictions

    for opt in ("hardware", "cases"):
        if not getattr(a, opt):
            raise SpecError("command line", f"--{opt}", "required to measure (or --predict-only, "
                            "--import-results)")
    if a.iters < 1 or not 0 <= a.discard < a.iters:
        raise SpecError("command line", "--discard", f"0 <= discard < iters, got {a.discard} of {a.iters}")
    if a.runs < 1:
        raise SpecError("command line", "--runs", f"a positive integer, got {a.runs}")
    hw, cases = load_hardware(a.hardware), load_cases(a.cases)
    cases = [c for c in cases if fnmatch(c.name, a.select)]
    if not cases:
        raise SpecError("--select", a.select, f"a glob matching case names of {a.cases}")
    check_devices(cases, a.device, a.cases)
    for i, c in enumerate(cases):  # a case the hardware cannot hold fails here, before any run
        try:
            check_fits(hw, c.workload(), c.plan)
        except SpecError as e:
            raise SpecError(a.cases, f"case[{i}].{e.field}", e.expected) from None
    cmd = command_line(a)
    print(cmd, flush=True)
    print(f"{len(cases)} case(s), {a.runs} run(s) each: {', '.join(c.name for c in cases)}",
          flush=True)
    # each group's cases predicted as soon as it is done (a failed group's too, where a run of
    # it completed): a validation stopped by a time limit keeps them predicted
    return measure_cases(cases, root, device=a.device, iters=a.iters, discard=a.discard,
                         machine=a.machine, command=cmd, runs=a.runs,
                         stored=lambda name: write_predictions(root / name, a.hardware, []))


def cross_kind(a: argparse.Namespace) -> int:
    """--cross-kind: the result as JSON (--json) or a few lines; nothing is written."""
    from slidedp.validate.cross_kind import run as run_cross_kind

    r = run_cross_kind(Path(a.out), a.cross_kind or None, a.select)
    if a.json:
        print(json.dumps(r, indent=1))
        return 0
    print(f"profile {r['profile']} ({r['profile_file']})")
    for key in ("same_kind", "cross_kind"):
        s = r[key]
        fig = (f"{s['mean_pct']:.1f}% mean, {s['max_pct']:.1f}% max (analytic "
               f"{s['analytic_mean_pct']:.1f}% / {s['analytic_max_pct']:.1f}%), worst "
               f"{s['worst']}" if s["cases"] else "no case")
        print(f"{key}: {s['cases']} cases, simulated {fig}")
    for m, s in r["cross_kind"]["by_machine"].items():
        print(f"  {m}: {s['cases']} cases, {s['mean_pct']:.1f}% mean, {s['max_pct']:.1f}% max")
    for e in r["excluded"]:
        print(f"excluded {e['case']}: {e['reason']}")
    return 0


def run(a: argparse.Namespace) -> int:
    from slidedp.validate.importer import import_results
    from slidedp.validate.summary import write_summary

    if a.json and a.cross_kind is None:
        raise SpecError("command line", "--json", "used with --cross-kind")
    if a.cross_kind is not None:
        return cross_kind(a)
    root = Path(a.out)
    failed: list[str] = []
    if a.import_results:
        for folder in import_results(a.import_results, root):
            print(f"imported {folder}")
    elif a.predict_only:
        predict_only(a, root)
    else:
        failed = measure(a, root)
    print_summary(root, write_summary(root))
    if failed:
        print(f"slidedp validate: measuring failed for: {', '.join(failed)}")
    return 1 if failed else 0
