"""The cost model's RECOMPUTE time per activation policy against one layer's measured recompute
(benchmarks/policy_layers.py output), with and without policy sac's measured recompute in the
hardware spec (gpu.layer_time sac_recompute_fraction, graph/costs.flops_per_hbm_byte). CPU only.

usage: python3 benchmarks/probes/recompute_model_check.py HARDWARE POLICY_LAYERS.json [...]
Each file's model, micro-batch and sequence make the workload; its `layer` forward is the
forward time both variants get (so the comparison is of the recompute split alone), its `sac`
recompute over sac's own forward (one run, as `slidedp profile` measures it) the fraction the
second gets. Prints a markdown table per file: measured, modelled without and with sac's
fraction, in ms, and the mean / largest absolute error over the policies other than the
calibration points (layer, sac) and those that recompute nothing. In-sample: sac's figure comes
from the run whose other policies it is checked against.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import numpy as np

from slidedp.graph.build import build_graph
from slidedp.graph.costs import task_durations
from slidedp.graph.tasks import Kind
from slidedp.spec.hardware import LayerTime, load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import ParamRoute, Plan
from slidedp.spec.workload import Workload


def modelled_ms(hw, wl: Workload, policy: str) -> float:
    """One layer's RECOMPUTE on `policy` (every layer on it), ms."""
    plan = Plan(param_route=ParamRoute.REPLICATED, layer_policies=(policy,) * wl.model.n_layers)
    g = build_graph(wl, plan, hw.host.cores)
    return float(np.median(task_durations(g, hw, wl)[g.kind == int(Kind.RECOMPUTE)])) * 1e3


def check(hw, path: Path) -> list[str]:
    d = json.loads(path.read_text())
    m, mb, seq, pols = load_model(d["model"]), d["micro_batch"], d["seq"], d["policies"]
    lt = LayerTime(m.hidden, m.ffn, seq, mb, 3 * pols["layer"]["fwd_ms"] / 1e3, str(path))
    frac = pols["sac"]["recompute_ms"] / pols["sac"]["fwd_ms"]  # one run, as the profile takes it
    variants = [dataclasses.replace(hw, gpu=dataclasses.replace(hw.gpu, layer_times=(x,)))
                for x in (lt, dataclasses.replace(lt, sac_recompute_fraction=frac))]
    wl = Workload(m, seq, mb, mb, 1)
    out = [f"{d['model']} mb {mb} seq {seq} ({path})", "",
           "| policy | measured ms | model ms (HBM rate) | model ms (sac's rate) |",
           "| --- | --- | --- | --- |"]
    errs: list[tuple[float, float]] = []
    for name, v in pols.items():
        if v["recompute_ms"] == 0.0:
            continue
        old, new = (modelled_ms(h, wl, name) for h in variants)
        out.append(f"| {name} | {v['recompute_ms']:.2f} | {old:.2f} | {new:.2f} |")
        if name not in ("layer", "sac"):
            errs.append((abs(old - v["recompute_ms"]), abs(new - v["recompute_ms"])))
    e = np.array(errs)
    out += ["", f"other policies ({len(e)}): mean abs error {e[:, 0].mean():.2f} -> "
                f"{e[:, 1].mean():.2f} ms, largest {e[:, 0].max():.2f} -> {e[:, 1].max():.2f} ms", ""]
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("hardware")
    ap.add_argument("policy_layers", nargs="+", type=Path)
    a = ap.parse_args()
    hw = load_hardware(a.hardware)
    for path in a.policy_layers:
        print("\n".join(check(hw, path)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
