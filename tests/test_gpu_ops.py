"""GPU compute by kind of operation (slidedp/spec/gpu_ops.py): the layer's ops count the FLOPs the
model counts, fused kernels move fewer bytes, and the check against measured whole layers.

The check: the same code, from the H200's microbenchmarks and datasheet ([gpu.ops] of h200x2),
predicts the fwd + bwd times of one decoder layer measured on the lent H200
(shared/data/h200x2-probe.md, transformers' Qwen3DecoderLayer, SDPA, seq 4096). Those times are
data here, not inputs: nothing in [gpu.ops] was set from them (its elementwise rates come from
Liger-Kernel's public microbenchmarks of the same kernels, its GEMM and copy rates from one
8192^3 product and one copy).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slidedp.spec.errors import SpecError
from slidedp.spec.gpu_ops import (
    achieved_rows,
    layer_ops,
    layer_seconds,
    policy_recompute_seconds,
    reference_achieved_rows,
    wave_efficiency,
)
from slidedp.spec.hardware import load_hardware, parse_hardware, preset_dir
from slidedp.spec.model import load_model

ROOT = Path(__file__).resolve().parents[1]
SEQ = 4096
# shared/data/h200x2-probe.md, "One decoder layer on one H200": fwd + bwd of one layer, ms
MEASURED_MS = {
    ("qwen3-4b", 1): 7.8, ("qwen3-4b", 4): 28.1, ("qwen3-4b", 16): 112.6,
    ("qwen3-8b", 1): 11.2, ("qwen3-8b", 4): 43.8, ("qwen3-8b", 16): 177.1,
    ("qwen3-14b", 1): 16.7, ("qwen3-14b", 4): 66.4, ("qwen3-14b", 16): 268.4,
}


def _predicted_ms(model: str, micro_batch: int, preset: str = "h200x2") -> float:
    t = layer_seconds(load_model(model), SEQ, micro_batch, load_hardware(preset).gpu)
    return (t["fwd"] + t["bwd"]) * 1e3


def _probe_loop_ms(model: str, micro_batch: int, preset: str = "h200x2") -> float:
    """One timed iteration of the probe (shared/tools/layer_probe.py): the layer's fwd + bwd, plus
    what its loop adds: y.backward(torch.ones_like(y)) fills the output gradient (2 B per output
    element) and autograd adds each iteration's gradients into the .grad the warm-up left on the
    input and on every parameter (6 B per element: two reads and a write, BF16), at the copy
    rate."""
    m, gpu = load_model(model), load_hardware(preset).gpu
    elements = SEQ * micro_batch * m.hidden
    extra = (2 + 6) * elements + 6 * m.layer_params()
    return _predicted_ms(model, micro_batch, preset) + extra / gpu.ops.copy_bps * 1e3


@pytest.mark.parametrize("model", ["qwen3-4b", "qwen3-14b", "llama-3.1-8b"])
def test_ops_count_the_models_flops(model):
    """Forward GEMMs + attention = ModelSpec's forward FLOPs; backward GEMMs twice the forward's."""
    m = load_model(model)
    ops = layer_ops(m, SEQ, 2)
    tokens = 2 * SEQ
    fwd = sum(o.flops for o in ops if o.phase == "fwd" and o.kind != "elementwise")
    assert fwd == pytest.approx(m.layer_flops_per_token(SEQ)["fwd"] * tokens, rel=1e-12)
    gemm = {p: sum(o.flops for o in ops if o.phase == p and o.kind == "gemm")
            for p in ("fwd", "bwd")}
    assert gemm["bwd"] == pytest.approx(2 * gemm["fwd"], rel=1e-12)
    assert any(o.name == "q_norm" for o in ops) == m.qk_norm


def test_fused_kernels_move_fewer_bytes_and_launch_fewer_kernels():
    m = load_model("qwen3-8b")
    eager, fused = (layer_ops(m, SEQ, 1, k) for k in ("eager", "fused"))
    assert [o.name for o in eager] == [o.name for o in fused]
    for e, f in zip(eager, fused, strict=True):
        assert (e.flops, e.shape) == (f.flops, f.shape)
        assert f.hbm_bytes <= e.hbm_bytes and f.kernels <= e.kernels
    norm = {o.phase: o.kernels for o in eager if o.name.startswith("input_norm")}
    assert norm == {"fwd": 8, "bwd": 16}  # the eager norm's kernels (module docstring)
    gpu = load_hardware("h200x2").gpu
    t = {k: layer_seconds(m, SEQ, 1, gpu, k) for k in ("eager", "fused")}
    assert t["fused"]["fwd"] < t["eager"]["fwd"] and t["fused"]["bwd"] < t["eager"]["bwd"]


def test_wave_efficiency_is_one_for_full_waves_and_lower_for_a_partial_one():
    assert wave_efficiency(128 * 132, 256, 132) == pytest.approx(1.0)
    assert wave_efficiency(128 * 133, 256, 132) == pytest.approx(133 / 264)


def test_layer_time_grows_with_the_micro_batch_and_sac_recomputes_less_than_the_layer():
    m, gpu = load_model("qwen3-4b"), load_hardware("h200x2").gpu
    times = [sum(layer_seconds(m, SEQ, b, gpu).values()) for b in (1, 2, 4)]
    assert times[0] < times[1] < times[2] <= 4 * times[0]
    fwd = layer_seconds(m, SEQ, 4, gpu)["fwd"]
    sac = policy_recompute_seconds(m, SEQ, 4, gpu, "sac")
    whole = policy_recompute_seconds(m, SEQ, 4, gpu, "layer")
    assert 0 < sac < whole == pytest.approx(fwd)


@pytest.mark.parametrize("case", sorted(MEASURED_MS), ids=lambda c: f"{c[0]}-b{c[1]}")
def test_h200_layer_times_from_microbenchmarks_within_5_percent(case):
    """The probe's iteration from [gpu.ops] within 5% of its measured time, every case."""
    assert _probe_loop_ms(*case) == pytest.approx(MEASURED_MS[case], rel=0.05)


def test_h200_layer_times_mean_error_and_the_probe_loop_share():
    """The nine cases' mean error stays below 3%; the probe loop's own additions are a small
    part of each iteration (0.4% at micro-batch 16 to 3.1% at 1)."""
    errs = [abs(_probe_loop_ms(*c) / ms - 1) for c, ms in MEASURED_MS.items()]
    assert sum(errs) / len(errs) < 0.03
    for c in MEASURED_MS:
        assert 0 < _probe_loop_ms(*c) / _predicted_ms(*c) - 1 < 0.035


def test_unprofiled_gpus_rank_as_their_datasheets_and_stay_below_peak():
    """A800, H100 and RTX 4090 from their datasheets: a Qwen3-8B layer is slowest on the 4090,
    then the A800, then the H100, then the H200 (more HBM bandwidth, same peak); every achieved
    row is below the GPU's peak."""
    m = load_model("qwen3-8b")
    ms = {p: _predicted_ms("qwen3-8b", 4, p) for p in ("rtx4090x4", "a800x8", "h100x8", "h200x2")}
    assert ms["rtx4090x4"] > ms["a800x8"] > ms["h100x8"] > ms["h200x2"]
    for p in ms:
        gpu = load_hardware(p).gpu
        for hidden, tokens, tflops in achieved_rows(m, SEQ, (1, 4), gpu):
            assert hidden == m.hidden and tokens in (SEQ, 4 * SEQ)
            assert 0 < tflops * 1e12 < gpu.peak_bf16_flops


def _ops_table(**edit) -> dict:
    import tomllib

    raw = tomllib.loads((preset_dir() / "h200x2.toml").read_text())
    raw["gpu"]["ops"] |= edit
    return raw


@pytest.mark.parametrize("edit,field", [
    ({"elementwise_fraction": 1.2}, "gpu.ops.elementwise_fraction"),
    ({"elementwise_fraction": {"rmsnorm": 0.9}}, "gpu.ops.elementwise_fraction"),
    ({"gemm_tflops": 2000}, "gpu.ops.gemm_tflops"),
    ({"gemm_shape": [8192, 8192]}, "gpu.ops.gemm_shape"),
    ({"copy_gbps": 0}, "gpu.ops.copy_gbps"),
    ({"sms": 0}, "gpu.ops.sms"),
])
def test_bad_ops_table_names_the_field(edit, field):
    with pytest.raises(SpecError) as e:
        parse_hardware(_ops_table(**edit), "bad.toml")
    assert e.value.where == "bad.toml" and e.value.field == field


def test_measured_gemm_rate_replaces_the_wave_model_for_its_shape():
    m = load_model("qwen3-4b")
    gpu = load_hardware("h200x2").gpu
    q_proj = next(o for o in layer_ops(m, SEQ, 1) if o.name == "q_proj")
    slow = dataclasses.replace(gpu.ops, gemm_measured=((*q_proj.shape, 100e12),))
    base = layer_seconds(m, SEQ, 1, gpu)["fwd"]
    with_measured = layer_seconds(m, SEQ, 1, dataclasses.replace(gpu, ops=slow))["fwd"]
    assert with_measured - base == pytest.approx(
        q_proj.flops / 100e12 - q_proj.flops / min(gpu.peak_bf16_flops, gpu.ops.gemm_flops),
        rel=0.3)


def test_gpu_ops_imports_neither_torch_nor_simpy():
    code = ("import sys; import slidedp.spec.gpu_ops, slidedp.spec.topology; "
            "print(sorted(m for m in ('torch', 'simpy', 'ortools') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True)
    assert json.loads(out.stdout.replace("'", '"')) == []


def test_microbenchmark_script_runs_on_the_cpu(tmp_path):
    """benchmarks/gpu_ops_microbench.py, tiny shapes on the CPU: it must not rot between GPU
    sessions."""
    out = tmp_path / "mb.json"
    p = subprocess.run([sys.executable, "benchmarks/gpu_ops_microbench.py", str(out), "--device",
                        "cpu", "--quick", "--repeats", "1"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(out.read_text())
    assert d["gemm_measured"] and all(len(r) == 4 for r in d["gemm_measured"])
    assert set(d["elementwise_fraction"]) == {"rmsnorm", "rope", "swiglu", "residual"}
    assert d["copy_gbps"] > 0 and "default" in next(iter(d["attention_tflops"].values()))


def _achieved_script():
    import importlib.util

    path = ROOT / "benchmarks" / "achieved_from_gpu_ops.py"
    spec = importlib.util.spec_from_file_location("achieved_from_gpu_ops", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


UNPROFILED = ["a800x4", "a800x4-nobridge", "a800x8", "a800x8-nobridge", "h100x4", "h100x8",
              "rtx4090x4"]


def test_unprofiled_presets_take_their_achieved_rows_from_gpu_ops():
    """Every preset with [gpu.ops] and no measured layer carries exactly the rows gpu_ops gives
    (benchmarks/achieved_from_gpu_ops.py rewrites nothing), with a source saying so; the
    profiled H200 presets keep their measured rows."""
    script = _achieved_script()
    assert script.unprofiled_presets() == UNPROFILED
    for name in UNPROFILED:
        text = (preset_dir() / f"{name}.toml").read_text()
        assert script.rewritten(text, name) == text, f"{name}: run the script"
        gpu = load_hardware(name).gpu
        assert gpu.sources["achieved"].startswith("derived: spec/gpu_ops.py")
        flat = [v for row in reference_achieved_rows(gpu) for v in row]
        assert [v for h, t, r in gpu.achieved for v in (h, t, r / 1e12)] == pytest.approx(flat)
    assert load_hardware("h200x2").gpu.sources["achieved"].startswith("h200x2-probe.md")
