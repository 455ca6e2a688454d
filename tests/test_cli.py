"""The real `slidedp` CLI: predict's output and JSON keys, listings, and bad input (exit 2, one line)."""

import json
import shutil
import subprocess
import sys

import pytest
from isolation import run_without

from slidedp.spec.hardware import preset_dir


def run(*args, check_rc=None):
    out = subprocess.run([sys.executable, "-m", "slidedp.cli", *args], capture_output=True, text=True)
    if check_rc is not None:
        assert out.returncode == check_rc, out.stderr
    return out


def test_predict_default_prints_a_real_prediction():
    out = run("predict", check_rc=0)
    assert "step time (predicted)" in out.stdout and "tokens/s" in out.stdout
    assert "qwen3-8b" in out.stdout and "h200x2" in out.stdout
    assert "-bound" in out.stdout.splitlines()[-1]


def test_predict_json_keys():
    out = run("predict", "--hardware", "a800x4", "--model", "qwen3-4b", "--seq", "2048",
              "--global-batch", "8", "--gpus", "4", "--micro-batch", "2", "--param-route", "replicated",
              "--grad-route", "cpu", "--chunk-mib", "32", "--json", check_rc=0)
    d = json.loads(out.stdout)
    for k in ("step_time_s", "lower_bound_s", "critical_path_s", "tokens_per_s", "bottleneck"):
        assert k in d
    assert set(d["traffic_bytes"]) >= {"h2d", "d2h", "allgather", "reduce", "act_offload"}
    assert set(d["memory"]) == {"gpu_peak_bytes", "host_bytes"}
    assert d["step_time_s"] >= d["lower_bound_s"] > 0
    assert d["tokens_per_s"] == pytest.approx(8 * 2048 / d["step_time_s"])
    assert d["traffic_bytes"]["allgather"] == 0  # replicated route


def test_listings():
    hw = run("hardware", "list", check_rc=0).stdout
    for name in ("h200x1", "h200x2", "h100x4", "h100x8", "a800x4", "a800x8", "a800x4-nobridge", "rtx4090x4"):
        assert name in hw
    models = run("model", "list", check_rc=0).stdout
    for name in ("qwen3-0.6b", "qwen3-14b", "qwen2.5-72b", "llama-3.1-8b", "mistral-small-24b", "qwen3-30b-a3b"):
        assert name in models


def _one_line_error(out, *needles):
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_unknown_preset():
    _one_line_error(run("predict", "--hardware", "h300x9"), "--hardware", "h200x2")
    _one_line_error(run("predict", "--model", "qwen9-1t"), "qwen9-1t")


def test_misspelled_plan_key(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text("[plan]\nparam_rout = 'sharded'\n")
    _one_line_error(run("predict", "--plan", str(plan)), str(plan), "plan.param_rout", "unknown key")


def test_bad_plan_value(tmp_path):
    plan = tmp_path / "plan.toml"
    plan.write_text("[plan]\nparam_route = 'diagonal'\n")
    _one_line_error(run("predict", "--plan", str(plan)), str(plan), "plan.param_route", "replicated")


def test_negative_rate_and_missing_key_in_hardware(tmp_path):
    src = (preset_dir() / "h200x2.toml").read_text()
    bad = tmp_path / "neg.toml"
    bad.write_text(src.replace("h2d_gbps = 55.3", "h2d_gbps = -55.3"))
    _one_line_error(run("predict", "--hardware", str(bad)), str(bad), "pcie.h2d_gbps", "positive")
    zero = tmp_path / "zero.toml"
    zero.write_text(src.replace("dram_gbps = 146", "dram_gbps = 0"))
    _one_line_error(run("predict", "--hardware", str(zero)), str(zero), "host.dram_gbps")
    missing = tmp_path / "missing.toml"
    missing.write_text(src.replace("d2h_gbps = 55.2\n", ""))
    _one_line_error(run("predict", "--hardware", str(missing)), str(missing), "pcie.d2h_gbps", "missing")


def test_bad_options():
    _one_line_error(run("predict", "--global-batch", "3", "--gpus", "2", "--micro-batch", "1"), "global_batch")
    _one_line_error(run("predict", "--gpus", "0"), "--gpus")
    _one_line_error(run("predict", "--gpus", "3"), "gpus", "h200x2")
    _one_line_error(run("predict", "--offload-ratio", "1.5"), "--offload-ratio")


def test_plan_that_does_not_fit(tmp_path):
    # GPU: 64K-token micro-batches of a 14B model overflow 80 GB
    out = run("predict", "--hardware", "h100x4", "--model", "qwen3-14b", "--micro-batch", "64", "--gpus", "1")
    _one_line_error(out, "infeasible plan", "GPU memory", "over by")
    # host: a 72B model's 12 B/param state does not fit the 128 GiB of one H200 machine
    out = run("predict", "--hardware", "h200x1", "--model", "qwen2.5-72b", "--micro-batch", "1")
    _one_line_error(out, "infeasible plan", "host memory", "over by", "state")


def test_model_from_directory(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(preset_dir().parent / "models" / "qwen3-4b.json", d / "config.json")
    out = run("predict", "--model", str(d), "--json", check_rc=0)
    assert json.loads(out.stdout)["step_time_s"] > 0


def test_predict_starts_without_torch():
    """`slidedp predict` (and the CLI itself) never import torch or transformers: start-up stays
    well under the 2 s answer time."""
    out = run_without(("torch", "transformers"),
                      "from slidedp.cli import main\nsys.exit(main(['predict', '--json']))\n")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["step_time_s"] > 0
