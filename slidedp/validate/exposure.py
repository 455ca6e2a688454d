"""Exposure analysis of the stored cases, from the simulator (notebooks/exposure_analysis.ipynb).

exposure_table  per stored case: C (GPU compute per step), H (the busiest host-side resource
                and its seconds), E = step - max(C, H), the channel the critical GPU waits on
                longest and the task it waits for (SimResult.exposures)
what_ifs        one case re-simulated with one thing changed: PCIe x2 (every link and host-side
                cap), cores x2 (more threads for cast and update; the rate curves and DRAM stay),
                global batch x2 (twice the accumulation), the other parameter or gradient route
                (R > 1), the host BF16 copy flipped (the other way to feed the upload), the
                embedding's split update flipped (plan.embedding_rows: the step tail), the
                gradients widened on the other side (plan.grad_widen: BF16 or FP32 downloads
                and update reads). Each row says the step-time change against the host-bound
                rule of method.md section 5: removing delta_H of host work saves
                min(delta_H, H - C).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pandas as pd

from slidedp.model.predict import step_saving_s
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import HardwareSpec, load_hardware
from slidedp.spec.plan import GradRoute, GradWiden, ParamRoute
from slidedp.validate import store
from slidedp.validate.cases import Case
from slidedp.validate.predict import simulated_figures, stored_hardware


def stored(folder: Path | str) -> tuple[Case, HardwareSpec]:
    """A stored case and the hardware its stored prediction used."""
    folder = Path(folder)
    return store.read_case(folder), load_hardware(stored_hardware(folder)[0])


def _figures(hw: HardwareSpec, case: Case) -> dict:
    res = simulate(hw, case.workload(), case.plan)
    f = simulated_figures(res)
    exp = f["exposed_by_channel_s"]
    worst = max(exp, key=exp.get)
    return {"step_s": f["step_time_s"], "tokens_per_s": res.tokens_per_s, "C_s": f["compute_s"],
            "H_s": f["host_s"], "H_resource": f["host_resource"], "E_s": f["exposed_s"],
            "bound_by": f["bound_by"], "gpu_idle_s": sum(exp.values()),
            "most_exposed": worst if exp[worst] > 0 else "none", "most_exposed_s": exp[worst],
            "waits_on": (f["longest_exposure"] or {}).get("waiting_on", "")}


def exposure_table(root: Path, pattern: str = "*") -> pd.DataFrame:
    rows = []
    for folder in store.stored_cases(root, pattern):
        case, hw = stored(folder)
        rows.append({"case": case.name, "hardware": hw.name, "gpus": case.gpus,
                     "global_batch": case.global_batch, "micro_batch": case.micro_batch,
                     **_figures(hw, case)})
    return pd.DataFrame(rows)


def scaled_pcie(hw: HardwareSpec, factor: float) -> HardwareSpec:
    p = hw.pcie
    pcie = replace(p, h2d_bps=p.h2d_bps * factor, d2h_bps=p.d2h_bps * factor,
                   duplex_bps=p.duplex_bps * factor, all_h2d_bps=p.all_h2d_bps * factor,
                   all_d2h_bps=p.all_d2h_bps * factor, all_total_bps=p.all_total_bps * factor,
                   chunk_bps=tuple((c, h * factor, d * factor) for c, h, d in p.chunk_bps))
    return replace(hw, pcie=pcie, name=f"{hw.name}, PCIe x{factor:g}")


def scaled_cores(hw: HardwareSpec, factor: int) -> HardwareSpec:
    return replace(hw, host=replace(hw.host, cores=hw.host.cores * factor),
                   name=f"{hw.name}, cores x{factor}")


def variants(hw: HardwareSpec, case: Case) -> dict[str, tuple[HardwareSpec, Case]]:
    p = case.plan
    out = {"base": (hw, case), "PCIe x2": (scaled_pcie(hw, 2.0), case),
           "cores x2": (scaled_cores(hw, 2), case),
           "global batch x2": (hw, replace(case, global_batch=2 * case.global_batch))}
    if case.gpus > 1:
        other_p = ParamRoute.REPLICATED if p.param_route == ParamRoute.SHARDED else ParamRoute.SHARDED
        other_g = GradRoute.CPU if p.grad_route == GradRoute.GPU else GradRoute.GPU
        out[f"param route {other_p}"] = (hw, replace(case, plan=replace(p, param_route=other_p)))
        out[f"grad route {other_g}"] = (hw, replace(case, plan=replace(p, grad_route=other_g)))
    copy = "off" if p.host_bf16_copy else "on"
    out[f"host BF16 copy {copy}"] = (hw, replace(case, plan=replace(p, host_bf16_copy=not p.host_bf16_copy)))
    rows = "off" if p.embedding_rows else "on"
    out[f"embedding rows {rows}"] = (hw, replace(case, plan=replace(p, embedding_rows=not p.embedding_rows)))
    widen = GradWiden.GPU if p.grad_widen == GradWiden.HOST else GradWiden.HOST
    out[f"gradients widened on the {widen}"] = (hw, replace(case, plan=replace(p, grad_widen=widen)))
    return out


def what_ifs(folder: Path | str) -> pd.DataFrame:
    """The module docstring's variants of one stored case, against its base simulation.

    saved_s = base step - variant step (measured by re-simulation); delta_H_s = base H - variant
    H; rule_saving_s = min(delta_H, H - C) of the base: what the host-bound rule promises."""
    case, hw = stored(folder)
    rows = []
    for name, (h, c) in variants(hw, case).items():
        try:
            rows.append({"variant": name, **_figures(h, c)})
        except InfeasiblePlan as e:
            rows.append({"variant": name, "infeasible": str(e)})
    df = pd.DataFrame(rows)
    base = df.iloc[0]
    df["saved_s"] = base.step_s - df.step_s
    df["delta_H_s"] = base.H_s - df.H_s
    df["rule_saving_s"] = [step_saving_s(d, base.H_s, base.C_s) for d in df.delta_H_s.fillna(0.0)]
    df["tokens_per_s_gain"] = df.tokens_per_s / base.tokens_per_s - 1.0
    return df
