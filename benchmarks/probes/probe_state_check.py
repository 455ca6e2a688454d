"""Does a probe's host state time the executor as the whole state does? (policy/probe.py)

AutoPolicy's probes run the executor on a host state in which decoder layer i lives in layer
i mod k's memory (DISTINCT_LAYERS; exec/measure.py layers_sharing_memory): built in a fraction
of the time, it must give the same step time as the whole state. This script builds both states
of one model (timing each build); times the host's own passes on each, --runs times interleaved:
the fused AdamW and the FP32 -> BF16 cast over every decoder layer's state, a chunk at a time (no
GPU: what memory sharing could change); then measures one plan on each, --runs times interleaved
(whole, shared, whole, shared, ...), each run --iters steps with the mean of those after
--discard; and writes one JSON object: the build seconds and bytes, every run's pass and step
times, the means and the ratios shared / whole. At a window below the layer count the backward's
re-upload casts may run beside updates of layers that share their memory (policy/probe.py); at
the full window they cannot: run both.

usage: PYTHONPATH=$PWD python3 benchmarks/probes/probe_state_check.py OUT.json --model qwen3-0.6b
           [--seq 4096] [--micro-batch 1] [--device cuda] [--iters 6] [--discard 2] [--runs 2]
           [--window-slots 3] [--chunk-mib 64] [--distinct-layers 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from slidedp.exec.adamw import adamw_chunk  # noqa: E402
from slidedp.exec.host_state import HostState  # noqa: E402
from slidedp.exec.measure import OPTIMIZER, measure, random_host_state  # noqa: E402
from slidedp.policy.probe import DISTINCT_LAYERS  # noqa: E402
from slidedp.profile.machine import probe_machine  # noqa: E402
from slidedp.spec.elements import FP32_BYTES  # noqa: E402
from slidedp.spec.model import load_model  # noqa: E402
from slidedp.spec.plan import ParamRoute, Plan  # noqa: E402
from slidedp.spec.workload import Workload  # noqa: E402

PASS_CHUNK = 1 << 24  # elements a pass's kernel takes at a time (64 MiB of FP32)


def host_passes_s(hs: HostState, step: int) -> dict[str, float]:
    """Seconds of one fused-AdamW pass and one FP32 -> BF16 cast pass over every decoder layer's
    state (units 1 .. L), PASS_CHUNK elements at a time, as the executor's update and cast do."""
    grad = torch.full((PASS_CHUNK,), 1e-3)
    staging = torch.empty(PASS_CHUNK, dtype=torch.bfloat16)
    chunks = [(u, lo, min(lo + PASS_CHUNK, hs.unit_numels[u]))
              for u in range(1, hs.n_units - 1) for lo in range(0, hs.unit_numels[u], PASS_CHUNK)]
    t0 = time.perf_counter()
    for u, lo, hi in chunks:
        adamw_chunk(hs.unit_master(u)[lo:hi], grad[:hi - lo], hs.unit_m(u)[lo:hi],
                    hs.unit_v(u)[lo:hi], step, OPTIMIZER, OPTIMIZER.lr)
    t1 = time.perf_counter()
    for u, lo, hi in chunks:
        staging[:hi - lo].copy_(hs.unit_master(u)[lo:hi])
    return {"adam": t1 - t0, "cast": time.perf_counter() - t1}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--discard", type=int, default=2)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--window-slots", type=int, default=3)
    ap.add_argument("--chunk-mib", type=float, default=64.0)
    ap.add_argument("--distinct-layers", type=int, default=DISTINCT_LAYERS)
    a = ap.parse_args(argv)
    model = load_model(a.model)
    wl = Workload(model, a.seq, a.micro_batch, a.micro_batch, 1)
    plan = Plan(param_route=ParamRoute.REPLICATED, window_slots=a.window_slots,
                h2d_chunk_mib=a.chunk_mib, d2h_chunk_mib=a.chunk_mib)
    cfg = dict(model.config)
    states, build_s, state_bytes = {}, {}, {}
    try:
        for name, k in (("whole", None), ("shared", a.distinct_layers)):
            t = time.perf_counter()
            states[name] = random_host_state(cfg, None, None, distinct_layers=k)
            build_s[name] = time.perf_counter() - t
            state_bytes[name] = 3 * FP32_BYTES * states[name].master.numel()  # master, m, v
            print(f"{name} state built in {build_s[name]:.2f} s", flush=True)
        passes: dict[str, dict[str, list[float]]] = {n: {"adam": [], "cast": []} for n in states}
        for r in range(a.runs):
            for name, hs in states.items():
                for k, s in host_passes_s(hs, r + 1).items():
                    passes[name][k].append(s)
            print(f"host passes {r + 1}: " + ", ".join(
                f"{n} adam {p['adam'][-1]:.3f} s cast {p['cast'][-1]:.3f} s"
                for n, p in passes.items()), flush=True)
        runs: dict[str, list[float]] = {"whole": [], "shared": []}
        for r in range(a.runs):
            for name, hs in states.items():
                m = measure(cfg, wl, plan, hs, device=a.device, iters=a.iters, discard=a.discard)
                runs[name].append(m.step_time_s)
                print(f"run {r + 1} {name}: {m.step_time_s:.4f} s/step "
                      f"(steps {', '.join(f'{s:.3f}' for s in m.all_steps_s)})", flush=True)
    finally:
        for hs in states.values():
            hs.close()
    mean = {k: statistics.fmean(v) for k, v in runs.items()}
    mach = probe_machine()
    pass_mean = {n: {k: statistics.fmean(v) for k, v in p.items()} for n, p in passes.items()}
    out = {"model": a.model, "seq": a.seq, "micro_batch": a.micro_batch, "device": a.device,
           "plan": {"window_slots": a.window_slots, "chunk_mib": a.chunk_mib},
           "distinct_layers": a.distinct_layers, "iters": a.iters, "discard": a.discard,
           "build_s": build_s, "state_bytes": state_bytes,
           "host_passes_s": passes, "host_passes_mean_s": pass_mean,
           "host_passes_shared_over_whole": {k: pass_mean["shared"][k] / pass_mean["whole"][k]
                                             for k in ("adam", "cast")},
           "runs_s": runs, "mean_s": mean, "shared_over_whole": mean["shared"] / mean["whole"],
           "date": mach.date, "host": mach.hostname, "cpu_model": mach.cpu_model,
           "cores": mach.cores, "gpus": mach.gpus(), "torch": torch.__version__,
           "command": " ".join(["python3", "benchmarks/probes/probe_state_check.py", *sys.argv[1:]])}
    a.out.write_text(json.dumps(out, indent=1) + "\n")
    hp = out["host_passes_shared_over_whole"]
    print(f"shared / whole: step {out['shared_over_whole']:.4f}, adam pass {hp['adam']:.4f}, "
          f"cast pass {hp['cast']:.4f}; builds {build_s['whole']:.1f} s "
          f"/ {build_s['shared']:.1f} s")
    return out


if __name__ == "__main__":
    main()
