"""The moments' formats in the plans: the memory model counts them, the cheapest format that fits
host RAM is chosen for --plan auto with the reason, and `slidedp predict` shows the host bytes of
each and names one that fits when the plan's does not."""

from dataclasses import replace

import pytest

from slidedp import cli
from slidedp.model.memory import host_footprint
from slidedp.model.state_tier import choose_tier, host_bytes_by_tier
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Moments, Plan
from slidedp.spec.units import GIB
from slidedp.spec.workload import Workload

QWEN14 = Workload(load_model("qwen3-14b"), 4096, 4, 4, 1)


def test_host_state_bytes_per_parameter_by_format():
    n = QWEN14.model.total_params()
    state = {m: host_footprint(QWEN14, Plan(moments=m))["state"] / n for m in Moments}
    assert state == {Moments.FP32: 12, Moments.BF16: 8,
                     Moments.INT8: pytest.approx(4 + 2 + 8 / 256)}
    sizes = host_bytes_by_tier(QWEN14, Plan())
    assert sizes[Moments.FP32] - sizes[Moments.INT8] == pytest.approx((12 - state[Moments.INT8]) * n)


def test_the_cheapest_format_that_fits_is_chosen_and_said():
    hw = load_hardware("h200x1")
    plan, why = choose_tier(hw, QWEN14, Plan())
    assert plan.moments == Moments.BF16 and why.startswith("moments bf16: the cheapest")
    assert "fp32 168.5 GiB" in why and "host RAM 125.0 GiB" in why
    small = Workload(load_model("qwen3-4b"), 4096, 4, 4, 1)
    assert choose_tier(hw, small, Plan())[0].moments == Moments.FP32
    tight = replace(hw, host=replace(hw.host, ram_bytes=95 * GIB))
    assert choose_tier(tight, QWEN14, Plan())[0].moments == Moments.INT8
    with pytest.raises(InfeasiblePlan, match="even with int8 moments"):
        choose_tier(replace(hw, host=replace(hw.host, ram_bytes=50 * GIB)), QWEN14, Plan())


def test_predict_shows_host_bytes_per_format_and_names_one_that_fits(capsys):
    args = ["predict", "--hardware", "h200x1", "--model", "qwen3-14b", "--seq", "4096",
            "--micro-batch", "4"]
    assert cli.main([*args, "--moments", "int8"]) == 0
    out = capsys.readouterr().out
    assert "moments int8" in out and "host memory by moments        fp32 168.5 GiB, bf16 113.5, int8 86.5" in out
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert "host memory needs 168.55 GiB" in err and "--moments bf16 fits" in err
    assert len(err.strip().splitlines()) == 1


def test_auto_plan_gets_the_chosen_format_and_the_report_says_why(monkeypatch):
    """choose_plan (train --plan auto, slidedp plan) hands AutoPolicy the base plan with the
    chosen format and puts the reason first in the report's notes; a given format is kept."""
    from slidedp.commands import choose
    from slidedp.policy.report import PolicyReport

    seen = []

    def fake_auto_plan(hw, wl, cap, base=None, **kw):
        seen.append(base)
        return base, PolicyReport(cap, wl.model.n_layers, base.window_slots, notes=["auto's"])

    monkeypatch.setattr(choose, "auto_plan", fake_auto_plan)
    hw = load_hardware("h200x1")
    plan, rep = choose.choose_plan(hw, QWEN14, hw.gpu.hbm_bytes, choose_moments=True)
    assert plan.moments == seen[-1].moments == Moments.BF16
    assert rep.notes[0].startswith("moments bf16: the cheapest") and rep.notes[1] == "auto's"
    plan, rep = choose.choose_plan(hw, QWEN14, hw.gpu.hbm_bytes,
                                   base=Plan(moments=Moments.INT8))
    assert plan.moments == Moments.INT8 and rep.notes == ["auto's"]
