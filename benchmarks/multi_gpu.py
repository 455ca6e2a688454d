"""Data-parallel benchmark (issue 5): R rank processes sharing one host state, configurations side
by side in one launch.

Run under torchrun (R > 1) or plainly (R = 1, no process group):
  PYTHONPATH=$PWD python3 benchmarks/multi_gpu.py OUT.jsonl MODEL CASE [CASE ...]
  PYTHONPATH=$PWD python3 -m torch.distributed.run --standalone --nproc-per-node 2 \
      benchmarks/multi_gpu.py OUT.jsonl MODEL CASE [CASE ...]
CASE = GLOBAL_BATCH:MICRO_BATCH:PARAM_ROUTE:GRAD_ROUTE:UPDATE_SHARDING, e.g. 8:4:sharded:gpu:rank0,
or ref:MICRO_BATCH for the compute-only reference (one process, before the host state exists).
The host state (random weights, benchmarks/single_gpu.fill_random) is built once and trained
through every case in turn; each case runs `--iters` steps, the mean of the steps after
`--discard` is its step time. Rank 0 appends one JSON line per case to OUT (host PSS summed
over the ranks: shared memory counts once in the sum).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from compute_reference import reference_step_s  # noqa: E402
from single_gpu import GIB, fill_random, host_pss_bytes, step_flops  # noqa: E402

from slidedp.exec.adamw import AdamWConfig  # noqa: E402
from slidedp.exec.engine import Engine  # noqa: E402
from slidedp.exec.host_state import HostState  # noqa: E402
from slidedp.exec.io import RandomInit, hf_config, meta_layout  # noqa: E402
from slidedp.spec.model import load_model  # noqa: E402
from slidedp.spec.plan import GradRoute, ParamRoute, Plan, UpdateSharding  # noqa: E402
from slidedp.spec.workload import Workload  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("model")
    ap.add_argument("cases", nargs="+")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--discard", type=int, default=3)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the script itself")
    a = ap.parse_args()
    spec = load_model(a.model)
    cfg = dict(spec.config)
    distributed = "RANK" in os.environ
    R = int(os.environ.get("WORLD_SIZE", "1"))
    sess = None
    if distributed:
        from slidedp.exec.dist.session import DistSession
        sess = DistSession(device=a.device).__enter__()
    rank = sess.rank if sess else 0
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)

    def emit(row: dict) -> None:
        if rank == 0:
            row |= {"ranks": R, "model": a.model, "seq": a.seq,
                    "gpu": torch.cuda.get_device_name() if cuda else "cpu",
                    "date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count()}
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                              for k, v in row.items() if k != "channel_s"}), flush=True)

    for case in [c for c in a.cases if c.startswith("ref:")]:
        mb = int(case.split(":")[1])
        if rank == 0:
            ref = reference_step_s(cfg, mb, a.seq, iters=a.iters, discard=a.discard)
            emit({"case": case, "reference_step_s": ref["step_s"],
                  "gpu_peak_gib": ref["gpu_peak_bytes"] / GIB})

    model, layout = meta_layout(hf_config(cfg))
    numels = [u.numel for u in layout]
    init = RandomInit(model, layout, seed=0)
    if sess:
        hs = sess.host_state(numels, None, init=lambda s: fill_random(init, layout, s))
    else:
        hs = HostState.create(numels, None)
        fill_random(init, layout, hs)
    opt = AdamWConfig(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.0)
    for case in [c for c in a.cases if not c.startswith("ref:")]:
        gb, mb, pr, gr, us = case.split(":")
        wl = Workload(spec, a.seq, int(gb), int(mb), R)
        plan = Plan(param_route=ParamRoute(pr), grad_route=GradRoute(gr),
                    update_sharding=UpdateSharding(us))
        eng = Engine(cfg, wl, plan, device=a.device, dtype=torch.bfloat16 if cuda else torch.float32,
                     optimizer=opt,
                     host_state=hs, **({"session": sess} if sess else {}))
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        data = torch.randint(0, spec.vocab_size, (wl.global_batch, a.seq),
                             generator=torch.Generator().manual_seed(0))
        times, last = [], None
        for _ in range(a.iters):
            last = eng.step(data)
            times.append(last.step_time_s)
        steady = times[a.discard:]
        step = sum(steady) / len(steady)
        pss = float(host_pss_bytes())
        if sess:
            pss = sess.all_reduce_sum([pss])[0]
        emit({"case": case, "global_batch": wl.global_batch, "micro_batch": wl.micro_batch,
              "accum": wl.accum_steps, "param_route": pr, "grad_route": gr, "update_sharding": us,
              "step_s": step, "all_steps_s": [round(x, 4) for x in times],
              "tokens_per_s": wl.tokens_per_step / step,
              "tflops_per_gpu": step_flops(spec, wl) / step / R / 1e12,
              "gpu_peak_gib": torch.cuda.max_memory_reserved() / GIB if cuda else None,
              "host_pss_gib_all_ranks": pss / GIB, "channel_s": last.channel_s,
              "loss_last": last.loss})
        eng.close()
        del eng
        if cuda:
            torch.cuda.empty_cache()
    if sess:
        sess.__exit__(None, None, None)
    else:
        hs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
