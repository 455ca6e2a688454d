"""Every stored case side by side: measured, analytic and simulated step time, busy seconds per
channel, and the error statistics, as SUMMARY.md and summary.csv under the validation root.

Error of a prediction p of a measured step m: (p - m) / m (signed; positive = predicted slower).
MAPE = mean of |error| over the cases, max = the largest |error| (and its case). Statistics are
given over every case and per (machine, hardware) group, since cases measured on different
machines are predicted with different hardware files, and per measurement run (the results file a
case was imported from: runs differ in executor version, see each run's notes).
"""

from __future__ import annotations

import csv
from pathlib import Path

from slidedp.validate import store
from slidedp.validate.hostcheck import KERNELS

CHANNELS = ("UPLOAD", "COMPUTE", "REDUCTION", "DOWNLOAD", "UPDATE")
MODELS = ("analytic", "simulated")
AT_STATE = "simulated_at_state_adam"  # predict.py: the simulation at the state check's AdamW


def case_row(folder: Path) -> dict:
    """One case's figures, flat (the CSV row)."""
    case = store.read_case(folder)
    meas = store.read_json(folder / store.MEASURED)
    pred = store.read_json(folder / store.PREDICTED) if (folder / store.PREDICTED).is_file() else {}
    p = case.plan
    row = {"case": case.name, "machine": meas["machine"], "date": meas["date"],
           "model": case.model, "gpus": case.gpus, "global_batch": case.global_batch,
           "micro_batch": case.micro_batch, "param_route": str(p.param_route),
           "grad_route": str(p.grad_route), "update_sharding": str(p.update_sharding),
           "chunk_mib": p.h2d_chunk_mib, "host_bf16_copy": p.host_bf16_copy,
           "measured_s": meas["step_time_s"], "measured_runs_spread": runs_spread(meas),
           "hardware": pred.get("hardware", {}).get("name", "")}
    # imported cases name their results file; a `slidedp validate` run, its date and profile
    row["source"] = (Path(meas.get("source") or "").name or f"slidedp validate {meas['date']} "
                     f"{meas['machine']} ({row['hardware'] or 'no prediction'})")
    for m in MODELS:
        s = pred.get(m, {}).get("step_time_s")
        row[f"{m}_s"] = s
        row[f"{m}_error"] = None if s is None else (s - meas["step_time_s"]) / meas["step_time_s"]
    lo, hi = pred.get("simulated", {}).get("step_time_range_s") or (None, None)  # host spread
    row["simulated_fast_s"], row["simulated_slow_s"] = lo, hi
    row["measured_in_range"] = None if lo is None else lo <= meas["step_time_s"] <= hi
    at = pred.get("simulated_at_state_adam", {}).get("step_time_s")  # the explanation
    row[f"{AT_STATE}_s"] = at
    row[f"{AT_STATE}_error"] = (None if at is None
                                else (at - meas["step_time_s"]) / meas["step_time_s"])
    for k in KERNELS:  # the host check's rates over the profile's, mean over the runs
        ratios = [x for x in pred.get("host_check_vs_profile", {}).get(k) or () if x is not None]
        row[f"host_check_{k}"] = sum(ratios) / len(ratios) if ratios else None
    sim = pred.get("simulated", {})
    row["simulated_bound_by"] = sim.get("bound_by", "")
    row["simulated_host_resource"] = sim.get("host_resource", "")
    for c in CHANNELS:
        row[f"measured_{c.lower()}_s"] = meas["channel_s"].get(c, 0.0)
        row[f"simulated_{c.lower()}_s"] = sim.get("channel_busy_s", {}).get(c)
    return row


def runs_spread(meas: dict) -> float | None:
    """How far a case's runs (each on a host state of its own) measured apart: max / min - 1 of
    their step times; None for one run. The measurement's own uncertainty, beside the errors."""
    runs = meas.get("run_step_times_s") or []
    return max(runs) / min(runs) - 1 if len(runs) >= 2 and min(runs) > 0 else None


def summary_rows(root: Path, pattern: str = "*") -> list[dict]:
    return [case_row(f) for f in store.stored_cases(root, pattern)]


def task_kind_rows(root: Path, pattern: str = "*") -> list[dict]:
    """Per stored case with a measured trace, per task kind: its tasks' summed seconds in the
    measured and the simulated step (predicted.json task_kind_s) and, for a GPU kind whose trace
    recorded it, the part of its span while its agent was still issuing it (measured_issue_s;
    None where not recorded): which kind of task the model gets wrong, and whether a GPU task
    waited on its issuing thread rather than on its work."""
    rows = []
    for f in store.stored_cases(root, pattern):
        pred = store.read_json(f / store.PREDICTED) if (f / store.PREDICTED).is_file() else {}
        issue = pred.get("measured_issue_s") or {}
        rows += [{"case": pred["case"], "kind": k, "measured_s": m, "simulated_s": s,
                  "issuing_s": issue[k][1] if k in issue else None}
                 for k, (m, s) in (pred.get("task_kind_s") or {}).items()]
    return rows


def error_stats(rows: list[dict], model: str) -> dict:
    """{'n', 'mape', 'max', 'max_case'} of one model's errors over rows (absolute fractions)."""
    errs = [(abs(r[f"{model}_error"]), r["case"]) for r in rows if r[f"{model}_error"] is not None]
    if not errs:
        return {"n": 0, "mape": None, "max": None, "max_case": None}
    worst = max(errs)
    return {"n": len(errs), "mape": sum(e for e, _ in errs) / len(errs), "max": worst[0],
            "max_case": worst[1]}


def _pct(x: float | None, signed: bool = False) -> str:
    return "" if x is None else f"{100 * x:+.1f}%" if signed else f"{100 * x:.1f}%"


def _notes(root: Path, folders: list[Path]) -> list[str]:
    """Distinct notes of the measured and predicted files, with how many cases each concerns."""
    count: dict[str, int] = {}
    for f in folders:
        notes = store.read_json(f / store.MEASURED).get("notes", [])
        if (f / store.PREDICTED).is_file():
            notes = notes + store.read_json(f / store.PREDICTED)["hardware"].get("notes", [])
        for n in notes:
            count[n] = count.get(n, 0) + 1
    return [f"{n} ({k} case{'s' if k > 1 else ''})" for n, k in count.items()]


def markdown(root: Path, rows: list[dict]) -> str:
    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        groups.setdefault((r["machine"], r["hardware"]), []).append(r)
    out = ["# Validation: measured against predicted", "",
           "Written by `slidedp validate` from the stored cases under this folder (one folder per "
           "case: case.toml, measured.json, predicted.json). Error = (predicted - measured) / "
           "measured; MAPE = mean |error|; max = largest |error|.", "",
           "| cases | machine | hardware | analytic MAPE | analytic max | simulated MAPE | simulated max |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for (machine, hw), part in [(("all", "-"), rows), *groups.items()]:
        a, s = error_stats(part, "analytic"), error_stats(part, "simulated")
        out.append(f"| {len(part)} | {machine} | {hw} | {_pct(a['mape'])} | {_pct(a['max'])} | "
                   f"{_pct(s['mape'])} | {_pct(s['max'])} |")
    by_source: dict[str, list[dict]] = {}
    for r in rows:
        by_source.setdefault(r["source"], []).append(r)
    out += ["", "By measurement run (the benchmark results file the cases were imported from, or the "
            "`slidedp validate` run by date, machine and profile; each run's executor version and "
            "conditions are in its notes below):", "",
            "| cases | source | machine | hardware | analytic MAPE | analytic max | simulated MAPE "
            "| simulated max | worst case (simulated) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for src, part in by_source.items():
        a, s = error_stats(part, "analytic"), error_stats(part, "simulated")
        machines = ", ".join(sorted({r["machine"] for r in part}))
        hws = ", ".join(sorted({r["hardware"] for r in part}))
        out.append(f"| {len(part)} | {src or '-'} | {machines} | {hws} | {_pct(a['mape'])} | "
                   f"{_pct(a['max'])} | {_pct(s['mape'])} | {_pct(s['max'])} | "
                   f"{s['max_case'] or ''} |")
    ranged = [r for r in rows if r["measured_in_range"] is not None]
    if ranged:
        inside = sum(r["measured_in_range"] for r in ranged)
        out += ["", f"The {len(ranged)} cases whose profile gives the host's spread "
                "(host.rate_range): measured within the step simulated at the profile's slowest "
                f"and fastest host rounds in {inside} of {len(ranged)}."]
    state_rows = [r for r in rows if r[f"{AT_STATE}_error"] is not None]
    if state_rows:
        sim, at = error_stats(state_rows, "simulated"), error_stats(state_rows, AT_STATE)
        out += ["", f"The {len(state_rows)} cases with a state check (validate/hostcheck.py): "
                f"simulated MAPE {_pct(sim['mape'])}, max {_pct(sim['max'])}; the same "
                "simulation at the AdamW rate the run's own host state read afterwards (not a "
                f"prediction: how much of the error the state's memory explains) "
                f"{_pct(at['mape'])}, max {_pct(at['max'])} ({at['max_case']})."]
    out += ["", "Measured s: the mean over the case's runs, each on a host state of its own, and "
            "how far apart they measured (max / min - 1) where there were two or more. Host check: "
            "AdamW, the cast and the teams at once sampled on fresh buffers before each run, and "
            "one AdamW pass over a one-GPU run's own host state after it (state adam), over the "
            "hardware file's rates (validate/hostcheck.py; cases whose runs took one): below 1, "
            "the machine or the state read slower than profiled. Simulated at the state's AdamW: "
            "the simulation with the profile's AdamW scaled by the state check's ratio (cases "
            "whose state check read its gradients cold, from a ring), an explanation, not a "
            "prediction.", "",
            "| case | R | gb:mb | routes (param/grad/update) | measured s (runs apart) | "
            "analytic s | simulated s | bound (sim): by (busiest host resource) | busy s "
            "measured / simulated: upload, compute, download, update | host check / profile: "
            + ", ".join(KERNELS) + " | simulated at the state's AdamW s | simulated s at the "
            "host's fastest-slowest rounds |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        busy = ", ".join(f"{r[f'measured_{c}_s']:.2f}/" + ("-" if r[f"simulated_{c}_s"] is None
                                                            else f"{r[f'simulated_{c}_s']:.2f}")
                         for c in ("upload", "compute", "download", "update"))
        an = "" if r["analytic_s"] is None else f"{r['analytic_s']:.3f} ({_pct(r['analytic_error'], True)})"
        si = "" if r["simulated_s"] is None else f"{r['simulated_s']:.3f} ({_pct(r['simulated_error'], True)})"
        runs = r["measured_runs_spread"]
        spread = "" if runs is None else f" ({_pct(runs)})"
        checked = ", ".join("-" if r[f"host_check_{k}"] is None else f"{r[f'host_check_{k}']:.2f}"
                            for k in KERNELS) if r["host_check_adam"] is not None else ""
        host_range = ("" if r["simulated_fast_s"] is None
                      else f"{r['simulated_fast_s']:.3f}-{r['simulated_slow_s']:.3f}")
        at_state = "" if r[f"{AT_STATE}_s"] is None else \
            f"{r[f'{AT_STATE}_s']:.3f} ({_pct(r[f'{AT_STATE}_error'], True)})"
        out.append(f"| {r['case']} | {r['gpus']} | {r['global_batch']}:{r['micro_batch']} | "
                   f"{r['param_route']}/{r['grad_route']}/{r['update_sharding']} | "
                   f"{r['measured_s']:.3f}{spread} | {an} | {si} | {r['simulated_bound_by']} "
                   f"({r['simulated_host_resource']}) | {busy} | {checked} | {at_state} | "
                   f"{host_range} |")
    notes = _notes(root, store.stored_cases(root))
    if notes:
        out += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(out) + "\n"


def write_summary(root: Path) -> list[dict]:
    """SUMMARY.md and summary.csv over every stored case; the rows."""
    rows = summary_rows(root)
    if not rows:
        return rows
    (root / store.SUMMARY_MD).write_text(markdown(root, rows))
    with open(root / store.SUMMARY_CSV, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    return rows
