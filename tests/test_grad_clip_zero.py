"""`--grad-clip 0` is no clipping in train, predict, simulate and plan, equal to no flag bit for
bit; `--grad-clip X > 0` predicts the deferred-update plan the executor runs when it clips
(spec/plan.py plan_for_clipping)."""

import json
import tomllib

import pytest
import torch
from safetensors.torch import load_file

from slidedp import cli
from slidedp.spec.plan import Plan, plan_for_clipping

TRAIN = ["--steps", "4", "--global-batch", "8", "--micro-batch", "4", "--warmup-steps", "1",
         "--device", "cpu"]
SMALL = ["--hardware", "h200x1", "--model", "qwen3-0.6b", "--seq", "1024"]


TIMINGS = {"elapsed_s", "sim_wall_s", "wall_s", "events_per_s"}  # how long it ran: no prediction


def _stdout(capsys, *argv) -> str:
    assert cli.main(list(argv)) == 0
    return capsys.readouterr().out


def _figures(capsys, *argv):
    """The command's JSON without the keys that time the command itself."""
    def strip(d):
        return {k: strip(v) for k, v in d.items() if k not in TIMINGS} if isinstance(d, dict) else d
    return strip(json.loads(_stdout(capsys, *argv, "--json")))


def test_plan_for_clipping_defers_only_when_the_norm_is_needed():
    p = Plan()
    assert plan_for_clipping(p, None) is p and plan_for_clipping(p, 0.0) is p
    assert plan_for_clipping(p, 1.0).defer_update and plan_for_clipping(p, None, 2).defer_update
    deferred = Plan(defer_update=True)
    assert plan_for_clipping(deferred, 0.0) == deferred  # an explicit --defer-update stays


def test_train_grad_clip_zero_equals_no_flag_bit_for_bit(tmp_path):
    assert cli.main(["train", "--out", str(tmp_path / "none"), *TRAIN]) == 0
    assert cli.main(["train", "--out", str(tmp_path / "zero"), *TRAIN, "--grad-clip", "0"]) == 0
    rows = {k: (tmp_path / k / "metrics.jsonl").read_text().splitlines() for k in ("none", "zero")}
    losses = {k: [json.loads(r)["loss"] for r in v] for k, v in rows.items()}
    assert len(losses["none"]) == 4 and losses["none"] == losses["zero"]
    a, b = (load_file(str(tmp_path / k / "final" / "model.safetensors")) for k in ("none", "zero"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    config = {k: (tmp_path / k / "config.toml").read_text() for k in ("none", "zero")}
    assert config["none"] == config["zero"] and "grad_clip" not in config["zero"]


@pytest.mark.parametrize("verb", ["predict", "simulate"])
def test_predict_and_simulate_grad_clip_zero_equal_no_flag(capsys, verb):
    plain = _figures(capsys, verb, *SMALL)
    zero = _figures(capsys, verb, *SMALL, "--grad-clip", "0")
    clipped = _figures(capsys, verb, *SMALL, "--grad-clip", "1.0")
    deferred = _figures(capsys, verb, *SMALL, "--defer-update")
    assert zero == plain
    assert clipped == deferred and clipped != plain  # clipping predicts the deferred update


def test_plan_grad_clip_zero_equals_no_flag(tmp_path, capsys):
    def chosen(*extra):
        out = tmp_path / f"plan{len(list(tmp_path.iterdir()))}.toml"
        _stdout(capsys, "plan", "--hardware", "h200x1", "--model", "tiny-qwen3", "--seq", "64",
                "--out", str(out), *extra)
        return tomllib.loads(out.read_text())["plan"]

    plain, zero, clipped = chosen(), chosen("--grad-clip", "0"), chosen("--grad-clip", "0.5")
    assert zero == plain and not plain["defer_update"]
    assert clipped["defer_update"]


@pytest.mark.parametrize("value", ["-1", "inf", "nan"])
@pytest.mark.parametrize("verb", ["predict", "simulate", "plan"])
def test_a_bad_grad_clip_is_one_line_exit_2(capsys, verb, value):
    assert cli.main([verb, *SMALL, "--grad-clip", value]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--grad-clip" in err[0] and ">= 0" in err[0]
