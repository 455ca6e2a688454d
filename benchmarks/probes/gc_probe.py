"""Python's garbage collector inside the executor, on the CPU: step times and the collections of
each generation (count, total and longest ms) over N steps of a 36-layer model with a small hidden
size (7391 tasks per step, so that the per-task objects dominate, as on a real 36-layer model).

usage: PYTHONPATH=$PWD python3 benchmarks/probes/gc_probe.py [STEPS]
The engine freezes its long-lived objects after the first step (engine docstring, "Python's
cyclic garbage collector"); the full collections after it should then be short.
"""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch
from transformers import AutoConfig

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.engine import Engine
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

MIB = 2**20


def main() -> int:
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    base = json.loads((Path(__file__).parents[2] / "slidedp/presets/models/tiny-qwen3.json").read_text())
    cfg = base | {"num_hidden_layers": 36, "hidden_size": 128, "intermediate_size": 256,
                  "vocab_size": 151936}
    wl = Workload(parse_hf_config(cfg, "gc-probe"), seq_len=64, global_batch=2, micro_batch=2, gpus=1)
    chunk_mib = 20000 * 2 / MIB  # small chunks: many tasks per step
    events, started, step = [], [0.0], [0]

    def on_gc(phase, info):
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            events.append((info["generation"], time.perf_counter() - started[0], step[0]))

    gc.callbacks.append(on_gc)
    ids = torch.randint(0, cfg["vocab_size"], (2, 64))
    times = []
    plan = Plan(window_slots=36, h2d_chunk_mib=chunk_mib, d2h_chunk_mib=chunk_mib)
    try:
        with Engine(cfg, wl, plan, optimizer=AdamWConfig(lr=1e-4), device="cpu",
                    dtype=torch.float32) as eng:
            eng.host_state.init_random(AutoConfig.for_model(**cfg), seed=0)
            for step[0] in range(steps):
                times.append(eng.step(ids).step_time_s)
    finally:
        gc.callbacks.remove(on_gc)
    print(f"tasks per step {eng.tpl.n}; step s after the first: mean "
          f"{sum(times[1:]) / len(times[1:]):.3f}, {[round(t, 3) for t in times]}")
    for gen in (0, 1, 2):
        ms = [d * 1e3 for g, d, _ in events if g == gen]
        print(f"generation {gen}: {len(ms)} collections, total {sum(ms):.1f} ms, "
              f"longest {max(ms, default=0):.2f} ms")
    print("full collections (step, ms; step 0's last one is the engine's own, before its "
          "freeze):", [(s, round(d * 1e3, 1)) for g, d, s in events if g == 2])
    return 0


if __name__ == "__main__":
    sys.exit(main())
