"""plan.kernels on the CPU (exec/fused_kernels.py): the resolution rule and its one-line errors, the
module patches and the RoPE dispatcher with exact stand-ins for liger's functions (bit-identical to
transformers' code, reversible, idempotent), the option through the CLI and the plan file, and the
hardware file's layer_time kernels tag. liger itself runs in tests/test_fused_kernels_gpu.py."""

import subprocess
import sys
import types
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from test_exec_engine import CONFIGS
from torch.func import functional_call

from slidedp.exec import fused_kernels as K
from slidedp.exec.layer_runner import ModelRunner, hf_config
from slidedp.exec.loss import linear_cross_entropy
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import LayerTime, load_hardware, parse_hardware, preset_dir
from slidedp.spec.plan import Kernels, Plan, parse_plan
from slidedp.spec.tomlio import read_toml

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # a device object: no GPU needed
SEQ = 16


@pytest.fixture(autouse=True)
def _restore_rope():
    yield
    K.restore()


# ---- resolution ---------------------------------------------------------------------------------


def test_auto_is_eager_off_cuda_and_says_why():
    assert K.resolve("auto", CPU) == ("eager", "auto: the device is cpu")
    assert K.resolve("eager", CUDA) == ("eager", "asked for")


def test_liger_off_cuda_is_one_line_naming_the_field():
    with pytest.raises(SpecError, match=r"^plan: field 'kernels': eager or auto on cpu: "
                       "liger-kernel runs on CUDA devices only$"):
        K.resolve("liger", CPU)
    with pytest.raises(SpecError, match=r"field 'kernels': one of auto, eager, liger, got 'fast'"):
        K.resolve("fast", CPU)


def test_cuda_follows_whether_liger_imports(monkeypatch):
    monkeypatch.setattr(K, "liger_unavailable", lambda: "ModuleNotFoundError: no liger")
    assert K.resolve("auto", CUDA) == ("eager", "auto: liger-kernel does not import "
                                               "(ModuleNotFoundError: no liger)")
    with pytest.raises(SpecError, match="does not import here"):
        K.resolve("liger", CUDA)
    monkeypatch.setattr(K, "liger_unavailable", lambda: None)
    assert K.resolve("auto", CUDA) == ("liger", "auto: CUDA with liger-kernel")
    assert K.resolve(Kernels.LIGER, CUDA) == ("liger", "asked for")


def test_runner_on_cpu_runs_the_exact_path():
    r = ModelRunner(CONFIGS["qwen3"], CPU, torch.float32)
    assert (r.kernels, r.head_loss) == ("eager", linear_cross_entropy)
    assert not any("forward" in m.__dict__ for m in r.layer.modules())
    with pytest.raises(SpecError, match="kernels"):
        ModelRunner(CONFIGS["qwen3"], CPU, torch.float32, "liger")
    assert K.head_loss("liger") is K.liger_linear_cross_entropy


# ---- module patches with exact stand-ins --------------------------------------------------------


def _hf_rms_norm(x, weight, eps):
    """transformers' RMSNorm forward as a function (what liger_rms_norm computes, casting_mode
    llama)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _stand_in(calls: list):
    def norm(x, w, eps):
        calls.append("norm")
        return _hf_rms_norm(x, w, eps)

    def silu_mul(g, u):
        calls.append("mlp")
        return F.silu(g) * u

    def rope(q, k, cos, sin):
        raise AssertionError("RoPE goes through install_rope, not the module patches")

    return K.Fused(norm, silu_mul, rope)


def _layer_io(family, runner=None):
    r = runner or ModelRunner(CONFIGS[family], CPU, torch.float32)
    gen = torch.Generator().manual_seed(0)
    params = r.layouts[1].views(torch.randn(r.layouts[1].numel, generator=gen) * 0.1)
    params = {n: p.clone().requires_grad_() for n, p in params.items()}
    x = torch.randn(2, SEQ, r.hidden, generator=gen, requires_grad=True)
    return r, params, x, torch.randn(2, SEQ, r.hidden, generator=gen)


def _fwd_bwd(r, params, x, g):
    out = r.layer_forward(params, x, r.rope(SEQ))
    return [out, *torch.autograd.grad(out, [x, *params.values()], g)]


@pytest.mark.parametrize("family", list(CONFIGS))
def test_patched_layer_calls_the_fused_functions_and_equals_hf(family):
    r, params, x, g = _layer_io(family)
    ref = _fwd_bwd(r, params, x, g)
    model = _meta_model(family)
    calls: list[str] = []
    norms = 2 + (2 if family == "qwen3" else 0)  # input, post-attention (+ q, k norms)
    layers = model.config.num_hidden_layers
    assert K.patch(model, _stand_in(calls)) == layers * (norms + 1) + 1  # + the final norm
    r.layer = model.model.layers[0]  # the runner computes with the patched layer
    got = _fwd_bwd(r, params, x, g)
    assert sorted(calls) == ["mlp"] + ["norm"] * norms
    assert all(torch.equal(a, b) for a, b in zip(ref, got, strict=True))
    assert K.patch(model, _stand_in(calls)) == layers * (norms + 1) + 1  # idempotent
    assert all(torch.equal(a, b) for a, b in zip(ref, _fwd_bwd(r, params, x, g), strict=True))
    K.unpatch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    calls.clear()
    assert all(torch.equal(a, b) for a, b in zip(ref, _fwd_bwd(r, params, x, g), strict=True))
    assert calls == []


def _meta_model(family):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(hf_config(CONFIGS[family]))


def test_final_norm_is_patched_through_functional_call():
    model = _meta_model("llama")
    calls: list[str] = []
    K.patch(model, _stand_in(calls))
    w, x = torch.rand(model.config.hidden_size) + 0.5, torch.randn(3, model.config.hidden_size)
    out = functional_call(model.model.norm, {"weight": w}, (x,))
    assert calls == ["norm"] and torch.equal(out, _hf_rms_norm(x, w, model.config.rms_norm_eps))


# ---- the RoPE dispatcher --------------------------------------------------------------------------


def _fake_modeling():
    mod = types.ModuleType("fake_modeling_for_rope")

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        return q * 2, k * 2

    mod.apply_rotary_pos_emb = apply_rotary_pos_emb
    sys.modules[mod.__name__] = mod
    return mod


def _in_place_rope(q, k, cos, sin):
    """A stand-in that writes its result into its inputs, as liger's RoPE does."""
    q.mul_(3)
    k.mul_(3)
    return q, k


def test_dispatcher_routes_by_device_and_restores():
    mod = _fake_modeling()
    original = mod.apply_rotary_pos_emb
    flag = {"fused": False}
    K.install_rope(mod, _in_place_rope, copy_inputs=True, on=lambda t: flag["fused"])
    q, k = torch.ones(2), torch.ones(2)
    assert [t.tolist() for t in mod.apply_rotary_pos_emb(q, k, None, None)] == [[2, 2], [2, 2]]
    flag["fused"] = True
    assert [t.tolist() for t in mod.apply_rotary_pos_emb(q, k, None, None)] == [[3, 3], [3, 3]]
    assert q.tolist() == [1, 1] and k.tolist() == [1, 1]  # copies: the inputs are untouched
    dispatcher = mod.apply_rotary_pos_emb
    K.install_rope(mod, _in_place_rope, copy_inputs=False, on=lambda t: True)  # installed: no-op
    assert mod.apply_rotary_pos_emb is dispatcher
    K.restore()
    assert mod.apply_rotary_pos_emb is original
    K.restore()
    assert mod.apply_rotary_pos_emb is original


def test_dispatcher_without_copies_writes_into_q_and_k():
    mod = _fake_modeling()
    K.install_rope(mod, _in_place_rope, copy_inputs=False, on=lambda t: True)
    q, k = torch.ones(2), torch.ones(2)
    mod.apply_rotary_pos_emb(q, k, None, None)
    assert q.tolist() == [3, 3]  # why families without q/k norms get copies (module docstring)


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_cpu_layers_stay_bit_identical_with_the_dispatcher_installed(family):
    r, params, x, g = _layer_io(family)
    ref = _fwd_bwd(r, params, x, g)
    attn = r.layer.self_attn
    mod = sys.modules[type(attn).__module__]
    original = mod.apply_rotary_pos_emb
    K.install_rope(mod, _in_place_rope, copy_inputs=not hasattr(attn, "q_norm"))  # on = is_cuda
    assert mod.apply_rotary_pos_emb is not original
    assert all(torch.equal(a, b) for a, b in zip(ref, _fwd_bwd(r, params, x, g), strict=True))
    K.restore()
    assert mod.apply_rotary_pos_emb is original


# ---- the option in plans, the CLI and the hardware file -----------------------------------------


def test_plan_field_parses_and_refuses_bad_values():
    assert Plan().kernels == Kernels.AUTO
    assert parse_plan({"plan": {"kernels": "liger"}}, "p.toml").kernels == Kernels.LIGER
    with pytest.raises(SpecError, match=r"p.toml: field 'plan.kernels': one of auto, eager, liger"):
        parse_plan({"plan": {"kernels": "triton"}}, "p.toml")


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "slidedp.cli", *args], capture_output=True,
                          text=True, timeout=300)


def test_cli_option_reaches_the_plan_and_liger_on_cpu_exits_2(tmp_path):
    r = _cli("predict", "--hardware", "h200x1", "--model", "qwen3-4b", "--kernels", "eager")
    assert r.returncode == 0 and "kernels eager" in r.stdout
    r = _cli("train", "--out", str(tmp_path / "o"), "--device", "cpu", "--kernels", "liger",
             "--steps", "1")
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "kernels" in err[0] and "CUDA" in err[0]
    assert not (tmp_path / "o" / "metrics.jsonl").exists()


def _rows(layer_times):
    data = read_toml(preset_dir() / "h200x1.toml")
    data["gpu"]["layer_time"] = layer_times
    return data


def test_layer_time_kernels_tag_parses_with_eager_as_default():
    base = {"hidden": 2560, "ffn": 9728, "seq": 4096, "micro_batch": 4, "fwd_bwd_s": 0.1,
            "source": "t"}
    hw = parse_hardware(_rows([base, base | {"kernels": "liger", "fwd_bwd_s": 0.07}]), "x.toml")
    assert [lt.kernels for lt in hw.gpu.layer_times] == ["eager", "liger"]
    with pytest.raises(SpecError, match=r"x.toml.*layer_time\[0\]\.kernels.*one of eager, liger"):
        parse_hardware(_rows([base | {"kernels": "auto"}]), "x.toml")
    old = load_hardware("h200x1")  # files without the tag: every row eager
    assert {lt.kernels for lt in old.gpu.layer_times} <= {"eager"}


def test_measured_layer_time_follows_the_plans_kernels():
    rows = (LayerTime(2560, 9728, 4096, 4, 0.10, "e"), LayerTime(2560, 9728, 4096, 4, 0.07, "l",
                                                                   kernels="liger"))
    hw = load_hardware("h200x1")
    gpu = replace(hw.gpu, layer_times=rows)
    assert gpu.measured_layer_s(2560, 9728, 4096, 4) == 0.10  # the default: eager
    assert gpu.measured_layer_s(2560, 9728, 4096, 8, "eager") == pytest.approx(0.20)
    assert gpu.measured_layer_s(2560, 9728, 4096, 4, "liger") == 0.07
    assert gpu.measured_layer_s(2560, 9728, 4096, 4, "auto") == 0.07  # the profile ran liger
    eager_only = replace(hw.gpu, layer_times=rows[:1])
    assert eager_only.measured_layer_s(2560, 9728, 4096, 4, "auto") == 0.10
    assert eager_only.measured_layer_s(2560, 9728, 4096, 4, "liger") == 0.10  # the other's rows
    assert eager_only.measured_layer_s(4096, 12288, 4096, 4, "liger") is None
