"""liger-kernel against eager transformers on the GPU (pytest -m gpu; exec/fused_kernels.py).

A decoder layer of each family through the executor's ModelRunner and PolicyRunner, under
policies "layer", "none" (what liger's functions save is kept) and "sac" (it keeps the q/k
projections' outputs, which liger's in-place RoPE must not overwrite), and HEAD_LOSS's linear +
cross-entropy: in BF16 with liger and with eager kernels, each against an FP32 eager reference on
the same values. liger's relative error (L2 norm of the difference / norm of the reference) must
be within 2x eager's + 5e-3 and below 5e-2 (a wrong scale, eps or overwritten input is O(1)).
The eager results are taken before any liger runner exists (its RoPE dispatcher is process-wide).
"""

import pytest
import torch
from test_exec_engine import CONFIGS

from slidedp.exec import fused_kernels as K
from slidedp.exec.activations import KeptActivations
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.loss import IGNORE_INDEX, linear_cross_entropy
from slidedp.exec.policy_runner import PolicyRunner, kept_layout
from slidedp.exec.staging import PinnedPool
from slidedp.spec.segments import parse_policy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(K.liger_unavailable() is not None,
                       reason=f"liger-kernel does not import: {K.liger_unavailable()}"),
]
DEV = torch.device("cuda")
SEQ, MB = 256, 2
POLICIES = ("layer", "none", "sac")
# the test configs with realistic head sizes, so that the Triton kernels see real block shapes
SIZES = {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8,
         "num_key_value_heads": 2, "head_dim": 64}


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def _values(runner: ModelRunner, dtype: torch.dtype):
    gen = torch.Generator(device=DEV).manual_seed(0)
    flat = torch.randn(runner.layouts[1].numel, generator=gen, device=DEV) * 0.05
    params = runner.layouts[1].views(flat.to(torch.bfloat16).to(dtype))
    x = torch.randn(MB, SEQ, runner.hidden, generator=gen, device=DEV).to(torch.bfloat16)
    g = torch.randn(MB, SEQ, runner.hidden, generator=gen, device=DEV).to(torch.bfloat16)
    return params, x.to(dtype), g.to(dtype)


def _run(family: str, kernels: str, dtype: torch.dtype, policy: str) -> list[torch.Tensor]:
    """(output, input gradient, parameter gradients...) of layer 1 under `policy`, as the engine
    runs it (test_exec_policies._run_policy on the GPU)."""
    r = ModelRunner(CONFIGS[family] | SIZES, DEV, dtype, kernels)
    assert r.kernels == kernels
    params, x, g = _values(r, dtype)
    rope = r.rope(SEQ)
    p = parse_policy(policy)
    runner = PolicyRunner(r, None)
    runner.acts = KeptActivations([kept_layout(runner, p, params, x, rope)], 1, 0.0, 2, DEV,
                                  PinnedPool(pin=True))
    runner.acts.add(1, 0, x)
    out, state = runner.forward(p, 1, 0, params, x, rope)
    out = out.clone()
    runner.recompute(state, params, rope)
    gx, pg = runner.backward(state, g)
    return [out, gx, *(pg[n] for n in sorted(pg))]


@pytest.fixture
def pure():
    """No RoPE dispatcher before (the eager results are eager) nor after the test."""
    K.restore()
    yield
    K.restore()


def _check(liger, eager, ref):
    for i, (a, b, r) in enumerate(zip(liger, eager, ref, strict=True)):
        el, ee = _rel(a, r), _rel(b, r)
        assert el <= 2 * ee + 5e-3 and el < 5e-2, (i, el, ee)


@pytest.mark.parametrize("family", list(CONFIGS))
def test_liger_layer_equals_eager_within_bf16(family, pure):
    ref = {p: _run(family, "eager", torch.float32, p) for p in POLICIES}
    eager = {p: _run(family, "eager", torch.bfloat16, p) for p in POLICIES}
    for policy in POLICIES:
        _check(_run(family, "liger", torch.bfloat16, policy), eager[policy], ref[policy])


def test_auto_picks_liger_on_this_gpu(pure):
    r = ModelRunner(CONFIGS["qwen3"], DEV, torch.bfloat16)
    assert (r.kernels, r.head_loss) == ("liger", K.liger_linear_cross_entropy)
    assert "forward" in r.layer.mlp.__dict__ and "forward" in r.layer.input_layernorm.__dict__


def _head(fn, hidden, weight, targets, scale, dtype):
    grad_w = torch.full_like(weight, 0.01, dtype=dtype)  # accumulates into what is there
    loss, grad_h = fn(hidden.to(dtype), weight.to(dtype), targets, scale, grad_w)
    return [loss, grad_h, grad_w - 0.01]


def test_liger_head_loss_is_token_weighted_over_the_global_batch():
    gen = torch.Generator(device=DEV).manual_seed(1)
    tokens, hidden, vocab = 1000, 256, 5000
    h = torch.randn(tokens, hidden, generator=gen, device=DEV).to(torch.bfloat16)
    w = (torch.randn(vocab, hidden, generator=gen, device=DEV) * 0.05).to(torch.bfloat16)
    y = torch.randint(0, vocab, (tokens,), generator=gen, device=DEV)
    y[:37] = IGNORE_INDEX
    scale = 1.0 / (3 * int((y != IGNORE_INDEX).sum()))  # this micro-batch is a third of the batch
    ref = _head(linear_cross_entropy, h, w, y, scale, torch.float32)
    eager = _head(linear_cross_entropy, h, w, y, scale, torch.bfloat16)
    liger = _head(K.liger_linear_cross_entropy, h, w, y, scale, torch.bfloat16)
    assert abs(liger[0].item() - ref[0].item()) <= 1e-3 * abs(ref[0].item())
    _check(liger[1:], eager[1:], ref[1:])
    assert liger[1][y == IGNORE_INDEX].abs().max().item() == 0.0  # ignored rows: no gradient
