"""Compact Adam moments (plan.moments = bf16 | int8, exec/moments.py).

The chunked kernel equals a plain-torch version of the same scheme over whole tensors (dequantize
with the dynamic map and each block's absmax, torch.optim.AdamW's step, requantize to the nearest
map entry): within 1e-6, and in fact bit for bit. Through the engine, int8 moments give the same
state whatever the gradient chunks, and 50 steps of a tiny model land within 1% of FP32 AdamW's
loss. A checkpoint keeps the compact moments and a resumed run continues bit for bit.
"""

import importlib.util
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from slidedp.exec import moments as mom
from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.engine import Engine
from slidedp.exec.host_state import HostState
from slidedp.spec.errors import SpecError
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import Moments, Plan
from slidedp.spec.workload import Workload

CFG = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MIB = 2**20


def _plain_dequantize(q, absmax, code):
    n = len(q)
    pad = -n % 256
    x = code[q.long()]
    x = torch.cat([x, torch.zeros(pad)]).view(-1, 256) * absmax.view(-1, 1)
    return x.reshape(-1)[:n]


def _plain_quantize(x, code):
    n = len(x)
    pad = -n % 256
    blocks = torch.cat([x, torch.zeros(pad)]).view(-1, 256)
    absmax = blocks.abs().amax(dim=1)
    scaled = (blocks / absmax.clamp_min(1e-38).view(-1, 1)).reshape(-1)[:n]
    bounds = (code[:-1] + code[1:]) / 2
    return torch.bucketize(scaled, bounds).to(torch.uint8), absmax


def _plain_step(fmt, p, g, m, v, step):
    """One step of the scheme over whole tensors: decode, torch.optim.AdamW, encode."""
    if fmt == "int8":
        mf = _plain_dequantize(m[0], m[1], mom.dynamic_map(True))
        vf = _plain_dequantize(v[0], v[1], mom.dynamic_map(False))
    else:
        mf, vf = m.float(), v.float()
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=CFG.lr, betas=CFG.betas, eps=CFG.eps,
                            weight_decay=CFG.weight_decay, fused=True)
    opt.state[ref] = {"step": torch.tensor(float(step - 1)), "exp_avg": mf, "exp_avg_sq": vf}
    ref.grad = g.float()
    opt.step()
    if fmt == "int8":
        return (ref.detach(), _plain_quantize(mf, mom.dynamic_map(True)),
                _plain_quantize(vf, mom.dynamic_map(False)))
    return ref.detach(), mf.bfloat16(), vf.bfloat16()


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                    reason="bitsandbytes is not installed")
def test_dynamic_maps_are_bitsandbytes_own():
    import bitsandbytes.functional as F

    for signed in (True, False):
        assert torch.equal(mom.dynamic_map(signed), F.create_dynamic_map(signed=signed))


@pytest.mark.parametrize("qmap", [mom.SIGNED, mom.UNSIGNED], ids=["signed", "unsigned"])
def test_nearest_entry_tables_equal_bucketize(qmap):
    """The BF16-indexed tables give torch.bucketize's answer: on every BF16 interval's ends, ties
    and neighbours (every 16-bit prefix with 8 low patterns), on each midpoint and its float
    neighbours, on each map entry."""
    prefix = torch.arange(1 << 16, dtype=torch.int32) << 16
    low = torch.tensor([0, 1, 2, 0x7FFF, 0x8000, 0x8001, 0xFFFE, 0xFFFF], dtype=torch.int32)
    xs = (prefix.view(-1, 1) | low.view(1, -1)).view(-1).view(torch.float32)
    b = qmap.bounds
    xs = torch.cat([xs, b, torch.nextafter(b, b + 1), torch.nextafter(b, b - 1), qmap.code])
    xs = xs[torch.isfinite(xs)]
    key = xs.bfloat16().view(torch.int16).int() & 0xFFFF
    got = qmap.base[key] + (xs > qmap.bound[key]).int()
    assert torch.equal(got, torch.bucketize(xs, b, out_int32=True))


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_chunked_kernel_equals_plain_torch_scheme(monkeypatch, fmt, grad_dtype):
    """Several chunks (on block boundaries), several COMPACT_BLOCKs per chunk, a partial last
    block; 4 steps, the state carried in its compact form."""
    monkeypatch.setattr(mom, "COMPACT_BLOCK", 512)
    monkeypatch.setattr(mom._scratch, "m", None, raising=False)
    n, chunks = 3000, [(0, 1280), (1280, 2816), (2816, 3000)]
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    hs = HostState.create([n], moments=fmt)
    try:
        hs.unit_master(0).copy_(p0)
        ref_p = p0.clone()
        ref_m, ref_v = (((torch.zeros(n, dtype=torch.uint8), torch.zeros(12)) if fmt == "int8"
                         else torch.zeros(n, dtype=torch.bfloat16)) for _ in range(2))
        for t in range(1, 5):
            g = (torch.randn(n, generator=gen) * 10 ** -(t % 3)).to(grad_dtype)
            for lo, hi in chunks:
                hs.moment_span(0, lo, hi).adamw(hs.unit_master(0)[lo:hi], g[lo:hi].clone(), t,
                                                CFG, CFG.lr)
            ref_p, ref_m, ref_v = _plain_step(fmt, ref_p, g, ref_m, ref_v, t)
        got = hs.unit_state(0)
        assert (got["master"] - ref_p).abs().max() <= 1e-6
        assert not torch.equal(got["master"], p0)
        if fmt == "int8":
            assert torch.equal(got["m"], ref_m[0]) and torch.equal(got["v"], ref_v[0])
            assert torch.equal(got["m_absmax"], ref_m[1]) and torch.equal(got["v_absmax"], ref_v[1])
        else:
            assert torch.equal(got["m"], ref_m) and torch.equal(got["v"], ref_v)
    finally:
        hs.close()


def test_int8_chunk_must_start_on_a_block():
    hs = HostState.create([1000], moments="int8")
    try:
        with pytest.raises(ValueError, match="not a multiple of 256"):
            hs.moment_span(0, 100, 1000)
    finally:
        hs.close()


def test_plan_refuses_compact_moments_with_split_embedding():
    with pytest.raises(SpecError, match="embedding_rows"):
        Plan(moments=Moments.INT8, embedding_rows=True)


TINY = json.loads((Path(__file__).parents[1] / "slidedp/presets/models/tiny-qwen3.json").read_text())
SEQ = 16


def _batches(steps: int, pool: int = 4, batch: int = 4):
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, TINY["vocab_size"], (batch, SEQ), generator=gen) for _ in range(pool)]
    return [(ids[i % pool], ids[i % pool].clone()) for i in range(steps)]


def _engine_run(plan: Plan, batches, opt=CFG):
    wl = Workload(parse_hf_config(TINY, "test"), seq_len=SEQ, global_batch=4, micro_batch=4,
                  gpus=1)
    with Engine(TINY, wl, plan, optimizer=opt) as eng:
        eng.host_state.init_random(AutoConfig.for_model(**TINY), seed=0)
        losses = [eng.step(ids, labels).loss for ids, labels in batches]
        hs = eng.host_state
        return losses, [{k: t.clone() for k, t in hs.unit_state(u).items()}
                        for u in range(hs.n_units)]


def test_int8_state_is_the_same_whatever_the_gradient_chunks():
    batches = _batches(3)
    whole = _engine_run(Plan(window_slots=2, moments=Moments.INT8), batches)
    chunked = _engine_run(Plan(window_slots=2, moments=Moments.INT8, update_workers=2,
                               d2h_chunk_mib=1000 * 4 / MIB), batches)  # 1000 FP32 elements
    assert whole[0] == chunked[0]
    for a, b in zip(whole[1], chunked[1], strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_fifty_steps_within_one_percent_of_fp32_adamw():
    """FP32 AdamW: the engine's FP32 moments, torch.optim.AdamW's update bit for bit
    (test_exec_engine.py checks the whole run against it)."""
    batches = _batches(50)
    ref_losses, _ = _engine_run(Plan(window_slots=2), batches)
    ref = sum(ref_losses[-5:]) / 5
    assert ref < ref_losses[0] - 1.0  # it learns: the comparison is not between flat curves
    for fmt in (Moments.BF16, Moments.INT8):
        losses, _ = _engine_run(Plan(window_slots=2, moments=fmt), batches)
        got = sum(losses[-5:]) / 5
        assert abs(got - ref) <= 0.01 * ref, (fmt, got, ref)


def _train(out, *extra):
    from slidedp import cli

    return cli.main(["train", "--out", str(out), "--steps", "4", "--global-batch", "8",
                     "--micro-batch", "8", "--warmup-steps", "1", "--device", "cpu", *extra])


def _metrics(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_int8_checkpoint_keeps_the_compact_moments_and_resume_is_exact(tmp_path):
    """Stopped after step 2 (its checkpoint kept), resumed to step 4: the losses and the final
    state equal an uninterrupted run's bit for bit; the checkpoint holds uint8 moments."""
    from safetensors import safe_open

    from slidedp.exec.checkpoint import latest_checkpoint

    a, b = tmp_path / "a", tmp_path / "b"
    assert _train(a, "--moments", "int8", "--checkpoint-every", "2") == 0
    assert _train(b, "--moments", "int8", "--checkpoint-every", "2", "steps=2") == 0
    with safe_open(str(latest_checkpoint(b / "checkpoints") / "unit-00001.safetensors"),
                   framework="pt") as f:
        assert f.get_tensor("m").dtype == torch.uint8
        assert f.get_tensor("v_absmax").dtype == torch.float32
    assert _train(b, "--resume", "steps=4") == 0
    assert _metrics(a) == _metrics(b)
    last_a, last_b = (latest_checkpoint(d / "checkpoints") for d in (a, b))
    for u in range(4):
        with safe_open(str(last_a / f"unit-{u:05d}.safetensors"), framework="pt") as fa, \
                safe_open(str(last_b / f"unit-{u:05d}.safetensors"), framework="pt") as fb:
            names = fa.keys()  # safe_open is not a dict
            assert all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in names)


def test_no_checkpoint_writes_final_only(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(out, "--moments", "bf16", "--no-checkpoint") == 0
    assert (out / "final" / "model.safetensors").is_file()
    assert not (out / "checkpoints").exists() or not list((out / "checkpoints").iterdir())
    assert _train(tmp_path / "bad", "--no-checkpoint", "--checkpoint-every", "2") == 2
    assert "--checkpoint-every" in capsys.readouterr().err
