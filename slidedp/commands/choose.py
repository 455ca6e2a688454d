"""AutoPolicy on the command line, shared by `slidedp plan` and `slidedp train --plan auto`: the
GPU memory cap option, real probes on the device at hand (policy/probe.py; one rank only), and
the plan TOML written with the report as its header comment.

torch is imported only when probes run or the executor's policies are asked for, so that
`slidedp plan` without --probe starts without it."""

from __future__ import annotations

from pathlib import Path

from slidedp.model.state_tier import choose_tier
from slidedp.policy.auto import GIB, auto_plan
from slidedp.policy.report import PolicyReport
from slidedp.profile.tomlw import dumps
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan, default_plan, plan_dict
from slidedp.spec.workload import Workload

DEFAULT_TIME_LIMIT_S = 60.0  # selection with probes (a minute, against the published method's ~20)


def time_limit(value: float | None) -> float | None:
    """--time-limit-s checked (None: no limit)."""
    if value is not None and (isinstance(value, bool) or not value > 0):
        raise SpecError("command line", "--time-limit-s", f"a positive number of seconds, got {value!r}")
    return value


def cap_bytes(hw: HardwareSpec, gib: float | None) -> float:
    """--gpu-memory-cap-gib in bytes (default: the hardware's whole HBM)."""
    if gib is None:
        return hw.gpu.hbm_bytes
    if isinstance(gib, bool) or not isinstance(gib, int | float) or gib <= 0:
        raise SpecError("command line", "--gpu-memory-cap-gib", f"a positive number, got {gib!r}")
    return gib * GIB


def choose_plan(hw: HardwareSpec, wl: Workload, cap: float, *, base: Plan | None = None,
                probe_device: str | None = None, executor_device: str | None = None,
                time_limit_s: float | None = DEFAULT_TIME_LIMIT_S,
                choose_moments: bool = False) -> tuple[Plan, PolicyReport]:
    """auto_plan, confirmed by real probes on `probe_device` when given (one rank only: with
    wl.gpus > 1 the report says it was not probed) within `time_limit_s` of selection, its
    activation policies limited to those the executor runs on `executor_device` when given;
    with `choose_moments`, base's moments format is the cheapest that fits host RAM
    (model/state_tier.py), and the report's first note says why."""
    why = None
    if choose_moments:
        base, why = choose_tier(hw, wl, base or default_plan(hw.fabric.kind))
    plan, rep = _choose(hw, wl, cap, base, probe_device, executor_device, time_limit_s)
    if why is not None:
        rep.notes.insert(0, why)
    return plan, rep


def _choose(hw: HardwareSpec, wl: Workload, cap: float, base: Plan | None,
            probe_device: str | None, executor_device: str | None,
            time_limit_s: float | None) -> tuple[Plan, PolicyReport]:
    runs = None
    if executor_device is not None:
        from slidedp.policy.probe import runs_policy

        def runs(name: str) -> bool:
            return runs_policy(name, executor_device)
    if probe_device is None or wl.gpus > 1:
        plan, rep = auto_plan(hw, wl, cap, base=base, runs_policy=runs)
        if probe_device is not None:
            rep.notes.append(f"no real probes: they run one rank only, this workload has "
                             f"{wl.gpus} (probing R > 1 needs rank processes, not implemented)")
        return plan, rep
    from slidedp.policy.probe import ExecutorProbe

    with ExecutorProbe(wl, probe_device, moments=str(base.moments if base else "fp32")) as probe:
        plan, rep = auto_plan(hw, wl, cap, base=base, probe=probe, probe_device=probe_device,
                              calibrate=probe.marginal_s, runs_policy=runs,
                              time_limit_s=time_limit_s)
        rep.notes += [f"probe refused: {r}" for r in dict.fromkeys(probe.refusals)]
    return plan, rep


def plan_toml(plan: Plan, comment: str) -> str:
    """The [plan] table of every Plan field, as parse_plan reads it back."""
    return dumps({"plan": plan_dict(plan)}, comment)


def write_plan(path: Path, plan: Plan, report: PolicyReport, who: str) -> None:
    """The plan TOML, with `who` wrote it and the report as its header comment."""
    path.write_text(plan_toml(plan, f"written by {who}\n" + "\n".join(report.lines())))


def default_device() -> str:
    """cuda when this torch build sees a CUDA device, else cpu."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"

