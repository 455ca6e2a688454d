"""Measure a list of cases: one group per (model, GPU count, host BF16 copy), in this process for
one GPU, through torchrun (slidedp.exec.dist.launch running slidedp.validate.worker) for R.

A group shares one host state (built once with random weights, as the benchmarks do) and runs
its cases in the file's order. A group whose rank processes fail is reported and the others
still run. With `runs` > 1 the group runs that many times, each on a host state of its own
(method.md section 10: average over 2 runs): a case's step time is the mean of the runs' (each
run's in `run_step_times_s`, its steps in `run_all_steps_s`); its channel seconds, trace and
memory figures are the last run's. Each run starts with a host check (validate/hostcheck.py),
kept in the cases' measured.json (`host_check`; every run's in `run_host_checks`). Of several
runs, each writes its figures to a file of its own (store.run_measured), merged into measured.json
as soon as the run has completed (and then removed): a validation stopped or failed partway keeps
every completed run in measured.json and the stopped run's finished cases in their run file.
"""

from __future__ import annotations

import os
import tempfile
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
                  machine: str, command: str, runs: int = 1) -> list[str]:
    """Measure every case into root/<case>/, `runs` times (module docstring), each run after a
    host check (validate/hostcheck.py) kept with its cases; the names of the cases whose group
    failed."""
    failed: list[str] = []
    for group in groups(cases):
        per_run = []
        for run in range(1, runs + 1):
            name = store.MEASURED if runs == 1 else store.run_measured(run)
            if runs > 1:
                print(f"run {run} of {runs}: {', '.join(c.name for c in group)}", flush=True)
            check = checked_host()
            if not _measure_group(group, root, device, iters, discard, machine, command, name):
                failed += [c.name for c in group]
                break
            per_run.append({c.name: with_check(store.read_json(root / c.name / name), check)
                            for c in group})
            for c in group:
                done = [r[c.name] for r in per_run]
                store.write_json(root / c.name / store.MEASURED,
                                 done[0] if runs == 1 else store.merged_runs(done, runs))
                if name != store.MEASURED:
                    (root / c.name / name).unlink()
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
                   machine: str, command: str, name: str) -> bool:
    """One run of a group (in this process for one GPU, through torchrun for R), each case's
    figures into the file `name` of its folder; False if its rank processes failed."""
    R = group[0].gpus
    if R == 1:
        run_group(group, root, run_meta(device, iters, discard, machine, command), name=name)
        return True
    with tempfile.TemporaryDirectory() as tmp:
        spec = Path(tmp) / "group.toml"
        spec.write_text("\n".join(case_toml(c) for c in group))
        argv = ["-m", "slidedp.validate.worker", "--cases", str(spec), "--out", str(root),
                "--device", device, "--iters", str(iters), "--discard", str(discard),
                "--machine", machine, "--command", command, "--measured-name", name]
        rc = launch(R, argv, env={"OMP_NUM_THREADS": "1"} | dict(os.environ),
                    timeout_s=RANK_TIMEOUT_S)
    return rc == 0
