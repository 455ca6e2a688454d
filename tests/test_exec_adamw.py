"""adamw_chunk on chunk views equals torch.optim.AdamW over whole tensors."""

import pytest
import torch

from slidedp.exec import adamw
from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.spec.errors import SpecError


def _run(fused: bool | None, chunks: list[int], steps: int = 4):
    cfg = AdamWConfig(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=gen)
    grads = [torch.randn(1000, generator=gen) for _ in range(steps)]
    ref = p0.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                            weight_decay=cfg.weight_decay, fused=fused)
    p, m, v = p0.clone(), torch.zeros(1000), torch.zeros(1000)
    for t, g in enumerate(grads, start=1):
        ref.grad = g.clone()
        opt.step()
        lo = 0
        for n in chunks:
            adamw_chunk(p[lo:lo + n], g[lo:lo + n], m[lo:lo + n], v[lo:lo + n], t, cfg, cfg.lr)
            lo += n
    return p, ref.detach(), opt.state[ref]


def test_chunked_fused_equals_torch_fused_exactly():
    p, ref, state = _run(fused=True, chunks=[300, 300, 400])
    assert torch.equal(p, ref)


def test_chunked_equals_torch_default_within_rounding():
    p, ref, _ = _run(fused=None, chunks=[1, 999])
    torch.testing.assert_close(p, ref, rtol=1e-6, atol=1e-7)


def test_bad_betas_rejected():
    with pytest.raises(SpecError):
        AdamWConfig(betas=(0.9, 1.0))


@pytest.mark.parametrize("clip", [1.0, 0.37])
def test_bf16_gradient_widened_in_blocks_equals_its_fp32_copy(monkeypatch, clip):
    """A BF16 gradient (plan.grad_widen = host) widened block by block, the last block partial,
    gives bit for bit the update of the same gradient widened first; clipping alike."""
    monkeypatch.setattr(adamw, "WIDEN_BLOCK", 96)
    monkeypatch.setattr(adamw._scratch, "block", None, raising=False)
    cfg = AdamWConfig(lr=3e-3, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(1000, generator=gen)
    narrow = [torch.randn(1000, generator=gen).bfloat16() for _ in range(3)]
    states = [[p0.clone(), torch.zeros(1000), torch.zeros(1000)] for _ in range(2)]
    for t, g in enumerate(narrow, start=1):
        adamw_chunk(*states[0][:1], g.clone(), *states[0][1:], t, cfg, cfg.lr, clip)
        adamw_chunk(*states[1][:1], g.float(), *states[1][1:], t, cfg, cfg.lr, clip)
    assert all(torch.equal(a, b) for a, b in zip(*states, strict=True))
    assert not torch.equal(states[0][0], p0)
