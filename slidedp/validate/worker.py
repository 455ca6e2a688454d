"""The measuring process: runs a group of cases (one model, one GPU count, one host-state layout)
on one host state and writes each case's measured files.

In-process for one GPU (measure.py calls run_group), or in each of R rank processes started by
torchrun: `python -m slidedp.validate.worker --cases GROUP.toml --out ROOT --device cuda
--iters N --discard N --machine NAME --command "..."`. Every rank measures; rank 0 writes
ROOT/<case>/case.toml, measured.json and measured_trace.json.gz (runner.py merges the ranks);
measure.py gives ROOT/.runs/run<K> as ROOT and adopts the folders when the run has completed.
In one process, after the group, one AdamW pass over its host state is timed (the state check,
validate/hostcheck.py) and written to the group's measured.json files.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from slidedp.exec.dist.launch import is_rank_process
from slidedp.exec.dist.session import DistSession, leave_rank
from slidedp.exec.measure import Measurement, measure, random_host_state
from slidedp.profile.machine import probe_machine
from slidedp.spec.plan import team_cores
from slidedp.validate import store
from slidedp.validate.cases import Case, load_cases
from slidedp.validate.hostcheck import grad_ring_bytes, state_adam_rate
from slidedp.validate.traces import save_trace


def run_meta(device: str, iters: int, discard: int, machine: str, command: str) -> dict:
    """What measured.json says about the run: date, machine, GPU, torch, command."""
    m = probe_machine()
    return {"date": m.date, "machine": machine or m.hostname,
            "machine_detail": {"hostname": m.hostname, "cpu_model": m.cpu_model, "cores": m.cores,
                               "cpus": m.cpus, "ram_gib": round(m.ram_bytes / 2**30, 1),
                               "gpus": m.gpus()},
            "gpu": m.gpu_model if device == "cuda" else "cpu", "torch": torch.__version__,
            "device": device, "dtype": "bfloat16" if device == "cuda" else "float32",
            "command": command, "iters": iters, "discard": discard}


def write_measured(folder: Path, case: Case, m: Measurement, meta: dict) -> None:
    store.write_case(folder, case, f"measured by slidedp validate on {meta['date']}, "
                                   f"{meta['machine']}")
    save_trace(m.timeline, folder / store.MEASURED_TRACE)
    wl = case.workload()
    store.write_json(folder / store.MEASURED, meta | {
        "case": case.name, "gpus_used": wl.gpus, "step_time_s": m.step_time_s,
        "all_steps_s": m.all_steps_s, "tokens_per_s": wl.tokens_per_step / m.step_time_s,
        "channel_s": m.channel_s, "channel_s_scope": "last step, union over every rank's tasks",
        "gpu_peak_bytes": m.gpu_peak_bytes, "host_pss_bytes": m.host_pss_bytes,
        "host_pss_scope": "summed over the rank processes", "loss_last": m.loss_last,
        "trace": store.MEASURED_TRACE, "notes": []})


def run_group(cases: list[Case], root: Path, meta: dict, session: DistSession | None = None) -> None:
    """Measure every case of the group on one host state (module docstring)."""
    device = meta["device"]
    cfg = dict(cases[0].spec.config)
    copy = torch.bfloat16 if device == "cuda" else torch.float32
    hs = random_host_state(cfg, copy if cases[0].plan.host_bf16_copy else None, session)
    try:
        written = []
        for case in cases:
            m = measure(cfg, case.workload(), case.plan, hs, device=device, iters=meta["iters"],
                        discard=meta["discard"], session=session)
            if m.timeline is not None:
                write_measured(root / case.name, case, m, meta)
                written.append(root / case.name / store.MEASURED)
                print(f"measured {case.name}: {m.step_time_s:.3f} s", flush=True)
        if session is None and written:  # one process: the state check (validate/hostcheck.py)
            m = probe_machine()
            rate, ring = state_adam_rate(hs, team_cores(m.cores), grad_ring_bytes(m.llc_bytes))
            state = {"state_adam_gparam_per_s": rate / 1e9, "state_adam_ring_mib": ring / 2**20}
            for f in written:
                store.write_json(f, store.read_json(f) | state)
    finally:
        if session is None:
            hs.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slidedp.validate.worker")
    ap.add_argument("--cases", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--iters", type=int, required=True)
    ap.add_argument("--discard", type=int, required=True)
    ap.add_argument("--machine", default="")
    ap.add_argument("--command", default="")
    a = ap.parse_args(argv)
    cases = load_cases(a.cases)
    meta = run_meta(a.device, a.iters, a.discard, a.machine, a.command)
    if not is_rank_process():
        run_group(cases, Path(a.out), meta)
        return 0
    R = int(os.environ["WORLD_SIZE"])
    threads = max(1, (os.cpu_count() or 1) // R) if a.device == "cpu" else None
    with DistSession(a.device, num_threads=threads) as sess:
        run_group(cases, Path(a.out), meta, sess)
    leave_rank(0)


if __name__ == "__main__":
    sys.exit(main())
