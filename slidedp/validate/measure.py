"""Measure a list of cases: one group per (model, GPU count, host BF16 copy), in this process for
one GPU, through torchrun (slidedp.exec.dist.launch running slidedp.validate.worker) for R.

A group shares one host state (built once with random weights, as the benchmarks do) and runs
its cases in the file's order. A group whose rank processes fail is reported and the others
still run. With `runs` > 1 the group runs that many times, each on a host state of its own
(method.md section 10: average over 2 runs): a case's step time is the mean of the runs' (each
run's in `run_step_times_s`, its steps in `run_all_steps_s`); its channel seconds, trace and
memory figures are the last completed run's. Each run starts with a host check
(validate/hostcheck.py), kept in the cases' measured.json (`host_check`; every run's in
`run_host_checks`). Each run writes its case folders under ROOT/.runs/run<K>/ (store.RUNS); as
soon as it has completed, each becomes the stored case, swapped in whole (store.adopt_run:
case.toml, the trace and a measured.json with every run completed so far). A validation stopped
or failed partway keeps every completed run; a stored case is always one measurement's files; a
stopped run's finished cases stay in its .runs folder.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from slidedp.exec.dist.launch import launch
from slidedp.spec.errors import SpecError
from slidedp.validate import store
from slidedp.validate.cases import Case, case_toml
from slidedp.validate.hostcheck import host_check
from slidedp.validate.worker import run_group, run_meta

RANK_TIMEOUT_S = 3600.0


def groups(cases: list[Case]) -> list[list[Case]]:
    """Cases sharing a host state, in order of first appearance."""
    out: dict[tuple, list[Case]] = {}
    for c in cases:
        out.setdefault((c.model, c.gpus, c.plan.host_bf16_copy), []).append(c)
    return list(out.values())


def check_devices(cases: list[Case], device: str, where: str) -> None:
    """One GPU per rank: every case's GPU count must exist here (cuda)."""
    have = torch.cuda.device_count() if device == "cuda" else None
    if device == "cuda" and have == 0:
        raise SpecError("--device", "cuda", "a CUDA device on this machine (none found; --device cpu?)")
    for i, c in enumerate(cases):
        if have is not None and c.gpus > have:
            raise SpecError(where, f"case[{i}].gpus", f"at most the {have} CUDA devices here, got {c.gpus}")


def measure_cases(cases: list[Case], root: Path, *, device: str, iters: int, discard: int,
                  machine: str, command: str, runs: int = 1,
                  stored: Callable[[str], None] = lambda name: None) -> list[str]:
    """Measure every case into root/<case>/, `runs` times (module docstring), each run after a
    host check (validate/hostcheck.py) kept with its cases; `stored(name)` for each case stored
    with at least one completed run, as soon as its group is done (the caller predicts it there,
    so a validation stopped in a later group keeps it predicted). The names of the cases whose
    group failed in a run."""
    failed: list[str] = []
    for group in groups(cases):
        per_run = []
        for run in range(1, runs + 1):
            stage = root / store.RUNS / f"run{run}"
            if runs > 1:
                print(f"run {run} of {runs}: {', '.join(c.name for c in group)}", flush=True)
            check = checked_host()
            if not _measure_group(group, stage, device, iters, discard, machine, command):
                failed += [c.name for c in group]
                break
            per_run.append({c.name: with_check(store.read_json(stage / c.name / store.MEASURED),
                                               check) for c in group})
            for c in group:
                done = [r[c.name] for r in per_run]
                store.adopt_run(stage / c.name, root / c.name,
                                done[0] if runs == 1 else store.merged_runs(done, runs))
        for c in group if per_run else ():
            stored(c.name)
    for stage in sorted((root / store.RUNS).glob("run*")) + [root / store.RUNS]:
        if stage.is_dir() and not any(stage.iterdir()):  # what a failed run left stays
            stage.rmdir()
    return failed


def with_check(meas: dict, check: dict) -> dict:
    """A run's measured figures with its host check, the state check (the worker's
    `state_adam_*` figures, one process only) moved into it."""
    state = {k: v for k, v in meas.items() if k.startswith("state_adam_")}
    return {k: v for k, v in meas.items() if k not in state} | {"host_check": check | state}


def checked_host() -> dict:
    """The host check (validate/hostcheck.py), or {"error": why} where it failed: it only
    informs, so it never stops a validation."""
    try:
        return host_check()
    except (OSError, RuntimeError, ValueError) as e:  # e.g. /dev/shm too small for its buffers
        return {"error": f"{type(e).__name__}: {e}"}


def _measure_group(group: list[Case], root: Path, device: str, iters: int, discard: int,
                   machine: str, command: str) -> bool:
    """One run of a group into root/<case>/ (in this process for one GPU, through torchrun for
    R); False if its rank processes failed."""
    R = group[0].gpus
    if R == 1:
        run_group(group, root, run_meta(device, iters, discard, machine, command))
        return True
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "group.toml"
        spec.write_text("\n".join(case_toml(c) for c in group))
        argv = ["-m", "slidedp.validate.worker", "--cases", str(spec), "--out", str(root),
                "--device", device, "--iters", str(iters), "--discard", str(discard),
                "--machine", machine, "--command", command]
        rc = launch(R, argv, env={"OMP_NUM_THREADS": "1"} | dict(os.environ),
                    timeout_s=RANK_TIMEOUT_S)
    return rc == 0
