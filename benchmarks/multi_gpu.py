"""Data-parallel benchmark (issue 5): R rank processes sharing one host state, configurations side
by side in one launch.

Run under torchrun (R > 1) or plainly (R = 1, no process group):
  PYTHONPATH=$PWD python3 benchmarks/multi_gpu.py OUT.jsonl MODEL CASE [CASE ...]
  PYTHONPATH=$PWD python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      benchmarks/multi_gpu.py OUT.jsonl MODEL CASE [CASE ...]
CASE = GLOBAL_BATCH:MICRO_BATCH:PARAM_ROUTE:GRAD_ROUTE:UPDATE_SHARDING[:FIELD=VALUE...], e.g.
8:4:sharded:gpu:rank0 or 8:4:sharded:gpu:rank0:window_slots=36 (any Plan field, value as TOML),
or GB:MB:plan=FILE[:FIELD=VALUE...] (a plan TOML, e.g. from `slidedp plan`),
or ref:MICRO_BATCH for the compute-only reference (one process, before the host state exists).
The host state (random weights, slidedp.exec.measure.fill_random) is built once and trained
through every case in turn; each case runs `--iters` steps, the mean of the steps after
`--discard` is its step time. Rank 0 appends one JSON line per case to OUT (host PSS summed
over the ranks: shared memory counts once in the sum; channel_s over every rank's tasks;
compute_idle_s: per GPU, the seconds of the last step its compute stream ran nothing, i.e. the
exposed time, Timeline.compute_idle_s).
The measurement itself is slidedp.exec.measure's (shared with `slidedp validate`).
--traces DIR: rank 0 also writes each case's last step (every rank's tasks) as a gzip-compressed
Chrome trace, DIR/<importer.trace_file_name(case)> (.json.gz: Perfetto opens it), which `slidedp
validate --import-results` stores beside the case (provenance field `traces`).
--switch-interval-s S: the interpreter's thread switch interval (sys.setswitchinterval; Python's
default 0.005 s) for every case: how long an agent thread may wait for the GIL after a torch op
that released it (each row records it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.dirname(__file__))
from compute_reference import reference_step_s  # noqa: E402
from single_gpu import GIB, step_flops  # noqa: E402

from slidedp.exec.fused_kernels import resolve as resolve_kernels  # noqa: E402
from slidedp.exec.measure import measure, random_host_state  # noqa: E402
from slidedp.spec.model import load_model  # noqa: E402
from slidedp.spec.plan import plan_dict  # noqa: E402
from slidedp.spec.workload import Workload  # noqa: E402
from slidedp.validate.cases import parse_case_spec  # noqa: E402
from slidedp.validate.importer import trace_file_name  # noqa: E402
from slidedp.validate.traces import save_trace  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("model")
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--discard", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    ap.add_argument("--traces", metavar="DIR", help="write each case's last step as a Chrome trace")
    ap.add_argument("--switch-interval-s", type=float, help="sys.setswitchinterval for the run")
    a = ap.parse_args()
    if a.switch_interval_s is not None:
        sys.setswitchinterval(a.switch_interval_s)
    with contextlib.ExitStack() as stack:  # a failure reaches the session: the peers stop too
        sess = None
        if "RANK" in os.environ:
            from slidedp.exec.dist.session import DistSession
            sess = stack.enter_context(DistSession(device=a.device))
        rc = run_cases(a, sess, stack)
    if sess is not None:  # a rank process: as the validation's and training's ranks end
        from slidedp.exec.dist.session import leave_rank
        leave_rank(rc)
    return rc


def run_cases(a: argparse.Namespace, sess, stack: contextlib.ExitStack) -> int:
    spec = load_model(a.model)
    cfg = dict(spec.config)
    R = int(os.environ.get("WORLD_SIZE", "1"))
    rank = sess.rank if sess else 0
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)

    def emit(row: dict) -> None:
        if rank == 0:
            row |= {"ranks": R, "model": a.model, "seq": a.seq,
                    "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                    "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(),
                    "switch_interval_s": sys.getswitchinterval(),
                    "gomp_spincount": os.environ.get("GOMP_SPINCOUNT")}
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in row.items() if k != "channel_s"}), flush=True)

    for case in [c for c in a.cases if c.startswith("ref:")]:
        mb = int(case.split(":")[1])
        if rank == 0:
            ref = reference_step_s(cfg, mb, a.seq, iters=a.iters, discard=a.discard,
                                   kernels=resolve_kernels("auto", torch.device("cuda"))[0])
            emit({"case": case, "reference_step_s": ref["step_s"],
                  "gpu_peak_gib": ref["gpu_peak_bytes"] / GIB})

    hs = random_host_state(cfg, None, sess)
    if sess is None:  # a session's host state is the session's to close
        stack.callback(hs.close)
    for case in [c for c in a.cases if not c.startswith("ref:")]:
        gb, mb, plan = parse_case_spec(case)
        pr, gr, us = str(plan.param_route), str(plan.grad_route), str(plan.update_sharding)
        wl = Workload(spec, a.seq, gb, mb, R)
        m = measure(cfg, wl, plan, hs, device=a.device, iters=a.iters, discard=a.discard,
                    session=sess)
        if a.traces and m.timeline is not None:  # rank 0: every rank's tasks
            os.makedirs(a.traces, exist_ok=True)
            save_trace(m.timeline, Path(a.traces) / trace_file_name(case))
        gpu_peak = None if m.gpu_peak_bytes is None else m.gpu_peak_bytes / GIB
        idle = m.timeline.compute_idle_s() if m.timeline is not None else {}
        emit({"case": case, "global_batch": wl.global_batch, "micro_batch": wl.micro_batch,
              "accum": wl.accum_steps, "plan": plan_dict(plan), "param_route": pr, "grad_route": gr, "update_sharding": us,
              "step_s": m.step_time_s, "all_steps_s": [round(x, 4) for x in m.all_steps_s],
              "tokens_per_s": wl.tokens_per_step / m.step_time_s,
              "tflops_per_gpu": step_flops(spec, wl) / m.step_time_s / R / 1e12,
              "gpu_peak_gib": gpu_peak, "host_pss_gib_all_ranks": (m.host_pss_bytes or 0) / GIB,
              "channel_s": m.channel_s, "loss_last": m.loss_last,
              # the last step: per GPU, the time its compute stream ran nothing (exposed)
              "compute_idle_s": [round(x, 4) for x in idle.values()]})  # by rank
    return 0


if __name__ == "__main__":
    sys.exit(main())
