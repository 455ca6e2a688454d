"""Single-GPU host-streaming benchmark (issue 4): ours against a compute-only reference, same run.

For each (model, micro-batch, plan): random weights written unit by unit into a fresh host state
(with the BF16 copy when the plan keeps one), `iters` real optimizer steps of the engine in BF16
at sequence `seq` (slidedp.exec.measure.measure, as benchmarks/multi_gpu.py), the steady-state step
time (mean of steps after `discard`), tokens/s, achieved TFLOP/s (FLOPs from the model spec with
recompute: fwd + recompute + bwd = 4 x fwd per layer, plus the LM head), GPU peak reserved, host
PSS per billion parameters, per-channel busy seconds of the last step; then the compute-only
reference (benchmarks/compute_reference.py: every parameter resident, no host work) on the same
micro-batch, and the ratio reference_step / our_step.

usage: PYTHONPATH=$PWD python3 benchmarks/single_gpu.py OUT.json MODEL:MB[,MB...] [...]
         [--iters 10] [--discard 5] [--seq 4096] [--bf16-copy both|on|off]
         [--moments fp32[,bf16,int8]]   (plan.moments: each format a row of its own)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import sys
import time
from datetime import date

import torch

sys.path.insert(0, os.path.dirname(__file__))
from compute_reference import reference_step_s  # noqa: E402

from slidedp.exec.fused_kernels import resolve as resolve_kernels  # noqa: E402
from slidedp.exec.measure import measure, random_host_state  # noqa: E402
from slidedp.spec.model import load_model  # noqa: E402
from slidedp.spec.plan import Moments, Plan  # noqa: E402
from slidedp.spec.workload import Workload  # noqa: E402

GIB = 2**30


def step_flops(spec, wl) -> float:
    f = spec.layer_flops_per_token(wl.seq_len)
    h = spec.head_flops_per_token()
    per_tok = spec.n_layers * (f["fwd"] + f["recompute"] + f["bwd"]) + h["fwd"] + h["bwd"]
    return per_tok * wl.tokens_per_step


def run_ours(name: str, mb: int, seq: int, plan: Plan, iters: int, discard: int) -> dict:
    spec = load_model(name)
    wl = Workload(spec, seq, mb, mb, 1)
    t0 = time.perf_counter()
    state = random_host_state(dict(spec.config), torch.bfloat16 if plan.host_bf16_copy else None,
                              None, moments=str(plan.moments))
    init_s = time.perf_counter() - t0
    try:
        m = measure(dict(spec.config), wl, plan, state, device="cuda", iters=iters,
                    discard=discard)
    finally:
        state.close()
    step = m.step_time_s
    out = {
        "model": name, "params": spec.total_params(), "micro_batch": mb, "seq": seq,
        "plan": {"host_bf16_copy": plan.host_bf16_copy, "window_slots": plan.window_slots,
                 "moments": str(plan.moments),
                 "h2d_chunk_mib": plan.h2d_chunk_mib, "d2h_chunk_mib": plan.d2h_chunk_mib},
        "step_s": step, "all_steps_s": [round(x, 4) for x in m.all_steps_s],
        "tokens_per_s": wl.tokens_per_step / step,
        "tflops": step_flops(spec, wl) / step / 1e12,
        "gpu_peak_gib": m.gpu_peak_bytes / GIB,
        "host_pss_gib": m.host_pss_bytes / GIB,
        "host_pss_gib_per_bparam": m.host_pss_bytes / GIB / (spec.total_params() / 1e9),
        "channel_s_last_step": m.channel_s, "loss_first_last": [m.loss_first, m.loss_last],
        "init_s": init_s,
    }
    del state
    gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("cases", nargs="+", help="MODEL:MB[,MB...]")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--discard", type=int, default=5)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--bf16-copy", choices=["both", "on", "off"], default="both")
    ap.add_argument("--no-reference", action="store_true")
    ap.add_argument("--moments", default="fp32", help="comma-separated plan.moments formats")
    a = ap.parse_args()
    copies = {"both": [False, True], "on": [True], "off": [False]}[a.bf16_copy]
    rows = []
    meta = {"date": str(date.today()), "host": socket.gethostname(),
            "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "command": " ".join(sys.argv), "cpus": os.cpu_count()}
    for case in a.cases:
        name, mbs = case.split(":")
        for mb in [int(x) for x in mbs.split(",")]:
            ref = None if a.no_reference else reference_step_s(
                dict(load_model(name).config), mb, a.seq, iters=a.iters, discard=a.discard,
                kernels=resolve_kernels("auto", torch.device("cuda"))[0])  # as ours: Plan()'s
            for copy, moments in ((c, m) for c in copies for m in a.moments.split(",")):
                r = run_ours(name, mb, a.seq, Plan(host_bf16_copy=copy, moments=Moments(moments)),
                             a.iters, a.discard)
                if ref:
                    r["reference_step_s"] = ref["step_s"]
                    r["reference_gpu_peak_gib"] = ref["gpu_peak_bytes"] / GIB
                    r["ratio_to_reference"] = ref["step_s"] / r["step_s"]
                rows.append(r)
                print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v)
                                  for k, v in r.items() if k != "channel_s_last_step"}), flush=True)
                with open(a.out, "w") as f:
                    json.dump({"meta": meta, "rows": rows}, f, indent=1)
    print(f"{'model':<10}{'mb':>3}{'copy':>6}{'moments':>8}{'step s':>8}{'ref s':>8}{'ratio':>7}{'tok/s':>8}"
          f"{'TFLOP/s':>8}{'GPU GiB':>8}{'PSS/B':>7}")
    for r in rows:
        print(f"{r['model']:<10}{r['micro_batch']:>3}{str(r['plan']['host_bf16_copy']):>6}"
              f"{r['plan']['moments']:>8}"
              f"{r['step_s']:>8.3f}{r.get('reference_step_s', float('nan')):>8.3f}"
              f"{r.get('ratio_to_reference', float('nan')):>7.3f}{r['tokens_per_s']:>8.0f}"
              f"{r['tflops']:>8.0f}{r['gpu_peak_gib']:>8.1f}{r['host_pss_gib_per_bparam']:>7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
