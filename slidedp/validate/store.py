"""The stored validation set: one folder per case under a root (default `validation/`).

File names are fixed here (see the package docstring for what each holds). A hardware reference
in predicted.json names a preset (`{"preset": "h200x1"}`) or a file by its path relative to the
case folder (`{"file": "../../benchmarks/results/...toml"}`), so the set stays readable from
anywhere, and carries the file's sha256, so a changed file is noticed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
from pathlib import Path

from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec, load_hardware, preset_dir
from slidedp.validate.cases import Case, case_toml, load_cases

CASE, MEASURED, PREDICTED = "case.toml", "measured.json", "predicted.json"
# traces gzip-compressed; a plain measured_trace.json (an older store) is read too (traces.find_trace)
MEASURED_TRACE, SIMULATED_TRACE = "measured_trace.json.gz", "simulated_trace.json.gz"
OVERLAY = "overlay.png"
SUMMARY_MD, SUMMARY_CSV = "SUMMARY.md", "summary.csv"


RUNS = ".runs"  # ROOT/.runs/run<K>/<case>/: one run's case folder until measure.py adopts it


def write_json(path: Path, data: dict) -> None:
    """Written whole or not at all (a temporary file renamed over it): a validation stopped
    while rewriting measured.json keeps the figures it held."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def adopt_run(staged: Path, folder: Path, measured: dict) -> None:
    """A run's case folder `staged` (case.toml, trace) made the stored case `folder`, with
    `measured` as its measured.json: whole folders are swapped by renames, so the stored case is
    always one measurement's files (the one before, with its prediction, or this one, not yet
    predicted). A stop between the two renames leaves no stored case of that name, and both
    measurements under ROOT/.runs."""
    write_json(staged / MEASURED, measured)
    before = staged.with_name(staged.name + ".before")
    if before.exists():  # left by an earlier stop
        shutil.rmtree(before)
    if folder.exists():
        os.replace(folder, before)
    os.replace(staged, folder)
    if before.exists():
        shutil.rmtree(before)


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise SpecError(str(path), "<file>", f"a readable JSON file ({e})") from None


def write_case(folder: Path, case: Case, comment: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CASE).write_text(case_toml(case, comment))


def read_case(folder: Path) -> Case:
    return load_cases(folder / CASE)[0]


def stored_cases(root: Path, pattern: str = "*") -> list[Path]:
    """Case folders under root (those holding a case.toml) whose name matches the glob, sorted."""
    return sorted(p.parent for p in Path(root).glob(f"{pattern}/{CASE}"))


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def hardware_ref(arg: str, folder: Path) -> tuple[HardwareSpec, dict]:
    """The hardware named on the command line (preset or file) and its reference for `folder`."""
    hw = load_hardware(arg)
    preset = preset_dir() / f"{arg}.toml"
    if not Path(arg).exists() and preset.is_file():
        return hw, {"preset": arg, "name": hw.name, "sha256": sha256(preset)}
    rel = os.path.relpath(Path(arg).resolve(), Path(folder).resolve())
    return hw, {"file": rel, "name": hw.name, "sha256": sha256(Path(arg))}


def hardware_arg(ref: dict, folder: Path) -> str:
    """The preset name or a loadable path of a stored hardware reference."""
    if "preset" in ref:
        return ref["preset"]
    return os.path.relpath((Path(folder) / ref["file"]).resolve())


def merged_runs(runs: list[dict], asked: int) -> dict:
    """One measured figures dict from several runs' (in order) of the `asked`: the step time is
    their mean, everything else the last run's."""
    last = runs[-1]
    step = statistics.fmean(r["step_time_s"] for r in runs)
    note = (f"step_time_s: the mean of {len(runs)} run{'s' * (len(runs) != 1)} "
            "(run_step_times_s); channel_s, the trace, GPU peak and host PSS: the last run")
    if len(runs) < asked:
        note += f"; {asked - len(runs)} of the {asked} runs did not complete (failed or stopped)"
    return last | {
        "step_time_s": step,
        "tokens_per_s": last["tokens_per_s"] * last["step_time_s"] / step,
        "run_step_times_s": [r["step_time_s"] for r in runs],
        "run_all_steps_s": [r["all_steps_s"] for r in runs],
        "run_host_checks": [r.get("host_check") for r in runs],
        "notes": last["notes"] + [note]}
