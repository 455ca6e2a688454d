"""Predictions for benchmark cases: the analytic model's and the simulator's step time for the
same (hardware, workload, plan), beside the measurement where there is one. CPU only.

usage: python3 benchmarks/predict_cases.py HARDWARE MODEL [--seq 4096] ITEM [ITEM ...]
ITEM = a results JSONL of benchmarks/multi_gpu.py (each measured row, with its error), or
       R@CASE, a case not measured (yet) on R GPUs, in multi_gpu.py's case syntax, e.g.
       8@64:4:sharded:gpu:rank0:window_slots=36 (a projection, e.g. for hardware not lent).
Prints a markdown table. (Measured rows are better kept as validation cases:
`slidedp validate --import-results`; this script is for quick tables and projections.)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slidedp.model.predict import predict
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import InfeasiblePlan, SpecError
from slidedp.spec.hardware import load_hardware
from slidedp.validate.cases import Case, parse_case_spec
from slidedp.validate.importer import multi_gpu_rows


def _items(items: list[str], model: str, seq: int) -> list[tuple[Case, float | None]]:
    """(case, measured step s or None) per item; R@CASE items on `model` at `seq`."""
    out = []
    for item in items:
        if "@" in item:
            r, spec = item.split("@", 1)
            gb, mb, plan = parse_case_spec(spec)
            out.append((Case(spec, model, seq, int(r), gb, mb, plan), None))
        else:  # the rows slidedp validate --import-results reads, as it reads them
            out += [(c, m["step_time_s"]) for c, m in multi_gpu_rows(Path(item))]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hardware")
    ap.add_argument("model")
    ap.add_argument("items", nargs="+")
    ap.add_argument("--seq", type=int, default=4096)
    a = ap.parse_args()
    hw = load_hardware(a.hardware)
    print(f"hardware {hw.name}, model {a.model}, sequence {a.seq}")
    print("| R | case | measured s | analytic s | simulated s | tokens/s (sim) | bound by (sim) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case, measured in _items(a.items, a.model, a.seq):
        r, plan = case.gpus, case.plan
        try:
            wl = case.workload()
            an = predict(hw, wl, plan).step_time_s
        except (InfeasiblePlan, SpecError) as e:
            print(f"| {r} | {case.name} | - | {e} | | | |")
            continue
        sim = simulate(hw, wl, plan)
        s = sim.step_time_s
        host_name, host_s = sim.host
        bound = "gpu" if sim.compute_s >= host_s else f"host ({host_name})"

        def err(x: float, measured: float | None = measured) -> str:
            return "" if measured is None else f" ({100 * (x - measured) / measured:+.0f}%)"

        m = "-" if measured is None else f"{measured:.2f}"
        print(f"| {r} | {case.name} | {m} | {an:.2f}{err(an)} | {s:.2f}{err(s)} | "
              f"{wl.tokens_per_step / s:,.0f} | {bound} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
