"""The analytic and simulated predictions of a stored case, written to predicted.json.

Both come from the same task graph and the given hardware file (profiled or a preset), with no
knowledge of the measured figures. Beside a measured trace the simulated steady step is written
as simulated_trace.json.gz (times from the step's start, like the measured one) and the two are
overlaid per channel in overlay.png, and predicted.json's task_kind_s lists each task kind's
summed seconds [measured, simulated] (which kind of task the model gets wrong) and, where the
trace has the GPU tasks' issue intervals, measured_issue_s: each GPU kind's [span seconds, the
part while its agent was still issuing it] (Timeline.issue_overlap_s); without one, the
simulated trace is left out (it is reproducible with `slidedp simulate --trace`, and there is
nothing to compare it with). Where the hardware file gives the host's spread (host.rate_range),
the simulated figures add `step_time_range_s`: the step simulated with AdamW and the cast at the
profile's slowest and at its fastest rounds (HardwareSpec.host_corners). Where a run's state
check was taken (validate/hostcheck.py), predicted.json adds `simulated_at_state_adam`: the
simulation at the AdamW rate the executor's own host state read after the run, an explanation
of an update's error beside the prediction, never the prediction.
"""

from __future__ import annotations

import datetime
from pathlib import Path

from slidedp.model.predict import predict
from slidedp.sim.result import SimResult
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec
from slidedp.validate import store
from slidedp.validate.cases import Case
from slidedp.validate.hostcheck import KERNELS, against_profile, at_state_adam
from slidedp.validate.traces import find_trace, load_trace, save_trace, steady_step


def analytic_figures(hw: HardwareSpec, case: Case) -> dict:
    p = predict(hw, case.workload(), case.plan)
    return {"step_time_s": p.step_time_s, "lower_bound_s": p.lower_bound_s,
            "critical_path_s": p.critical_path_s, "compute_s": p.compute_s, "host_s": p.host_s,
            "host_resource": p.host_resource, "exposed_s": p.exposed_s, "bound_by": p.bound_by,
            "bottleneck": p.bottleneck, "critical_path_by_channel_s": p.critical_path_by_channel_s,
            "gpu_peak_bytes": p.memory["gpu_peak_bytes"], "host_bytes": p.memory["host_bytes"],
            "limiter": p.limiter()}


def simulated_figures(res: SimResult) -> dict:
    host_resource, host_s = res.host
    t0, t1 = res.window_s
    rank = res.critical_rank
    longest = max((e for e in res.exposures if e.rank == rank and e.end_s > t0 and e.start_s < t1),
                  key=lambda e: min(e.end_s, t1) - max(e.start_s, t0), default=None)
    return {"step_time_s": res.step_time_s, "compute_s": res.compute_s, "host_s": host_s,
            "host_resource": host_resource, "exposed_s": res.exposed_s,
            "bound_by": "gpu" if res.compute_s >= host_s else "host",
            "bottleneck": res.bottleneck[0], "channel_busy_s": res.channel_busy_s,
            "exposed_by_channel_s": res.exposed_by_channel_s,
            "critical_path_by_channel_s": res.critical_path_by_channel_s,
            "longest_exposure": None if longest is None else {
                "channel": longest.channel, "waiting_on": longest.waiting_on,
                "seconds": min(longest.end_s, t1) - max(longest.start_s, t0)}}


def write_predictions(folder: Path, hardware: str, hardware_notes: list[str]) -> dict:
    """predicted.json (and, beside a measured trace, simulated_trace.json.gz and overlay.png)."""
    case = store.read_case(folder)
    hw, ref = store.hardware_ref(hardware, folder)
    res = simulate(hw, case.workload(), case.plan)
    out = {"case": case.name, "date": datetime.date.today().isoformat(),
           "hardware": ref | {"notes": hardware_notes},
           "analytic": analytic_figures(hw, case), "simulated": simulated_figures(res),
           "simulated_trace": None}
    corners = hw.host_corners()
    if corners is not None:  # where the host's own spread may put the step (HostSpec.rate_range)
        out["simulated"]["step_time_range_s"] = sorted(
            simulate(c, case.workload(), case.plan).step_time_s for c in corners)
    measured_trace = find_trace(folder / store.MEASURED_TRACE)
    if measured_trace is not None:
        from slidedp.validate.plot import overlay  # matplotlib only where a plot is drawn

        simulated = steady_step(res.timeline())
        save_trace(simulated, folder / store.SIMULATED_TRACE)
        out["simulated_trace"] = store.SIMULATED_TRACE
        measured = load_trace(measured_trace)
        overlay(measured, simulated, folder / store.OVERLAY, title=f"{case.name} on {hw.name}")
        # where a step's error comes from: each task kind's summed seconds, measured / simulated
        m_kinds, s_kinds = measured.kind_seconds(), simulated.kind_seconds()
        out["task_kind_s"] = {k: [m_kinds.get(k, 0.0), s_kinds.get(k, 0.0)]
                              for k in dict.fromkeys([*m_kinds, *s_kinds])}
        issue = measured.issue_overlap_s()
        if issue:  # traces with issue intervals: how much of each GPU kind waited on its issuing
            out["measured_issue_s"] = {k: list(v) for k, v in issue.items()}
    checks = host_checks(store.read_json(folder / store.MEASURED))
    ratios = [None if c is None or "error" in c else against_profile(c, hw) for c in checks]
    if any(ratios):  # the machine at each run against the hardware file, beside the errors
        out["host_check_vs_profile"] = {k: [r.get(k) if r else None for r in ratios]
                                        for k in KERNELS}
    state = [r["state adam"] for c, r in zip(checks, ratios, strict=True)
             if r and "state adam" in r and "state_adam_ring_mib" in c]
    if state:  # the explanation of an update's error: the profile at the state's AdamW
        ratio = sum(state) / len(state)
        at = simulate(at_state_adam(hw, ratio), case.workload(), case.plan)
        out["simulated_at_state_adam"] = {
            "state_adam_vs_profile": ratio, "step_time_s": at.step_time_s,
            "update_busy_s": at.channel_busy_s.get("UPDATE", 0.0),
            "what": "the simulation with the hardware file's AdamW curves scaled by the state "
                    "check's ratio (mean over the runs; validate/hostcheck.at_state_adam): an "
                    "explanation, not the prediction"}
    store.write_json(folder / store.PREDICTED, out)
    return out


def host_checks(meas: dict) -> list[dict | None]:
    """A measured case's host checks, one per run in run order (validate/hostcheck.py; None
    where a run had none); [] where none was taken (older cases, imported benchmark rows)."""
    runs = meas.get("run_host_checks")
    checks = runs if runs is not None else [meas.get("host_check")]
    return checks if any(checks) else []


def stored_hardware(folder: Path) -> tuple[str, list[str]]:
    """The hardware a stored prediction used (as a loadable argument) and its notes; the notes
    are dropped when the file changed since (they described the old one)."""
    if not (folder / store.PREDICTED).is_file():  # e.g. stored by a validation stopped early
        raise SpecError(str(folder / store.PREDICTED), "hardware",
                        "an earlier prediction's hardware (none yet: give --hardware)")
    ref = store.read_json(folder / store.PREDICTED)["hardware"]
    arg = store.hardware_arg(ref, folder)
    _, now = store.hardware_ref(arg, folder)
    return arg, ref.get("notes", []) if now["sha256"] == ref["sha256"] else []
