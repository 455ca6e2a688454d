"""Predictions beside measurements: for each measured case of a results JSONL written by
benchmarks/multi_gpu.py, the analytic model's and the simulator's step time for the same
(hardware, workload, plan), and their errors. CPU only.

usage: python3 benchmarks/predict_cases.py HARDWARE RESULTS.jsonl [RESULTS.jsonl ...]
"""

from __future__ import annotations

import json
import sys

from slidedp.model.predict import predict
from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import GradRoute, ParamRoute, Plan, UpdateSharding
from slidedp.spec.workload import Workload


def main() -> int:
    hw = load_hardware(sys.argv[1])
    print("| R | case | measured s | analytic s | error | simulated s | error | bound by (sim) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for path in sys.argv[2:]:
        with open(path) as f:
            rows += [json.loads(line) for line in f]
    for d in rows:
        if "step_s" not in d:
            continue
        wl = Workload(load_model(d["model"]), d["seq"], d["global_batch"], d["micro_batch"],
                      d["ranks"])
        plan = Plan(param_route=ParamRoute(d["param_route"]), grad_route=GradRoute(d["grad_route"]),
                    update_sharding=UpdateSharding(d["update_sharding"]))
        a = predict(hw, wl, plan).step_time_s
        sim = simulate(hw, wl, plan)
        s, m = sim.step_time_s, d["step_s"]
        host_name, host_s = sim.host
        bound = "gpu" if sim.compute_s >= host_s else f"host ({host_name})"
        print(f"| {d['ranks']} | {d['case']} | {m:.2f} | {a:.2f} | {100 * (a - m) / m:+.0f}% | "
              f"{s:.2f} | {100 * (s - m) / m:+.0f}% | {bound} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
