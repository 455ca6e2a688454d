"""Confirm a screening sweep by the measurement protocol (method.md section 10).

benchmarks/autopolicy_vs_sweep.sh screens AutoPolicy's choice against a grid with one short run
per plan (6 steps), whose spread on the nvidia-h200 hosts is ~5% (2026-12-01 04:28: one plan
measured 1.957 and 1.857 s in one run), as large as the 2% the comparison is about. This script
measures again the rows that decide it: the chosen plan (the case with `plan=`), the default plan
(the grid's first row, as autopolicy_vs_sweep.sh lists it) and the --top fastest other rows (not
the chosen plan itself where the grid holds it; within --cap-gib where AutoPolicy had a cap), each
--iters steps with the mean of those after --discard (the protocol: 15 and 8), --runs times,
the runs interleaved (A B C A B C) so that a drift of the host hits every row alike. It runs
benchmarks/multi_gpu.py (one process, one host state) and prints a table: each row's runs and
their mean, the chosen plan against the fastest other row and against the default.

usage: python3 benchmarks/confirm_sweep.py SWEEP.jsonl OUT.jsonl [--plan PLAN.toml] [--top 2]
           [--iters 15] [--discard 8] [--runs 2] [--device cuda] [--cap-gib G]
--plan: the chosen plan's TOML where the sweep's path is gone (a new device call).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
from slidedp.spec.plan import plan_dict  # noqa: E402
from slidedp.validate.cases import parse_case_spec  # noqa: E402


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


ROUTE_FIELDS = ("param_route", "grad_route", "update_sharding")  # one route on one GPU
POLICY_FIELDS = ("activation_policy", "layer_policies")


def _comparable(plan: dict, one_gpu: bool) -> dict:
    """A row's plan as the executor runs it: without the route fields on one GPU, and with its
    activation policies as one tuple (every layer on one policy reads the same whether the plan
    names it once in activation_policy or once per layer in layer_policies)."""
    drop = (ROUTE_FIELDS if one_gpu else ()) + POLICY_FIELDS
    out = {k: v for k, v in plan.items() if k not in drop}
    per_layer = plan.get("layer_policies") or [plan.get("activation_policy", "layer")]
    out["policies"] = (per_layer[0],) if len(set(per_layer)) == 1 else tuple(per_layer)
    return out


def same_plan(a: dict, b: dict) -> bool:
    """Two rows run one plan (on one GPU the route fields make no difference)."""
    one_gpu = a.get("ranks", 1) == 1
    return _comparable(a["plan"], one_gpu) == _comparable(b["plan"], one_gpu)


def pick_cases(rows: list[dict], top: int, plan: str | None,
               cap_gib: float | None = None) -> tuple[str, str, list[str], list[str]]:
    """(chosen, default, the `top` fastest other cases, the grid cases that are the chosen plan
    itself) of a sweep's measured rows; with cap_gib, grid rows whose GPU peak exceeded it are
    left out (the grid is run uncapped)."""
    measured = [r for r in rows if "step_s" in r]
    chosen = [r for r in measured if "plan=" in r["case"]]
    if len(chosen) != 1:
        raise SystemExit(f"expected one chosen row (a case with plan=), found {len(chosen)}")
    grid = [r for r in measured if r is not chosen[0]]
    if not grid:
        raise SystemExit("no grid rows besides the chosen plan")
    case = chosen[0]["case"]
    if plan is not None:  # a new choice: the plan the case now runs decides its twins
        case = re.sub(r"plan=[^:]+", lambda _: f"plan={plan}", case)
        chosen = [chosen[0] | {"plan": plan_dict(parse_case_spec(case)[2])}]
    twins = [r for r in grid[1:] if same_plan(r, chosen[0])]
    fits = [r for r in grid[1:] if r not in twins
            and (cap_gib is None or (r.get("gpu_peak_gib") or 0.0) <= cap_gib)]
    others = sorted(fits, key=lambda r: r["step_s"])[:top]
    return case, grid[0]["case"], [r["case"] for r in others], [r["case"] for r in twins]


def summary(rows: list[dict], chosen: str, default: str) -> list[str]:
    """Markdown lines: per case its runs and mean; the chosen plan's ratios."""
    by_case: dict[str, list[float]] = {}
    for r in rows:
        by_case.setdefault(r["case"], []).append(r["step_s"])
    mean = {c: sum(v) / len(v) for c, v in by_case.items()}
    out = ["| case | runs s | mean s |", "| --- | --- | --- |"]
    for c, v in by_case.items():
        tag = " (chosen)" if c == chosen else " (default)" if c == default else ""
        out.append(f"| {c}{tag} | {' / '.join(f'{x:.3f}' for x in v)} | {mean[c]:.3f} |")
    best = min(m for c, m in mean.items() if c != chosen)
    out.append(f"chosen against the fastest other row: {best / mean[chosen]:.3f}; "
               f"against the default: {mean[default] / mean[chosen]:.2f}x")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweep", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--plan")
    ap.add_argument("--top", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--discard", type=int, default=8)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--cap-gib", type=float, help="AutoPolicy's --gpu-memory-cap-gib, if any")
    a = ap.parse_args()
    rows = _rows(a.sweep)
    chosen, default, others, twins = pick_cases(rows, a.top, a.plan, a.cap_gib)
    for t in twins:
        print(f"grid row {t} is the chosen plan itself: not measured again as an 'other' row")
    first = next(r for r in rows if "step_s" in r)
    cases = [chosen, default, *others] * a.runs
    cmd = [sys.executable, str(HERE / "multi_gpu.py"), str(a.out), first["model"],
           "--seq", str(first["seq"]), "--device", a.device, "--iters", str(a.iters),
           "--discard", str(a.discard), *cases]
    print(" ".join(cmd), flush=True)
    a.out.unlink(missing_ok=True)
    subprocess.run(cmd, check=True)
    print("\n".join(summary(_rows(a.out), chosen, default)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
