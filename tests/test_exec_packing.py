"""Packed rows compute what their documents compute one by one.

Layer level (CPU, FP32): a row of several documents through a decoder layer with the packed
attention (position ids restarting per document, the block-diagonal causal mask) gives each
document's output and gradients as the document alone through the unpacked layer (within FP32
summation order: the mask changes SDPA's reduction lengths); every activation policy equals the
whole-layer checkpoint bit for bit on packed rows too. Engine level: steps of packed rows
(exec/packing.py) give the losses and parameters of plain HF training on the same documents
unpacked, the loss token-weighted over the step's label tokens (HF's num_items_in_batch).
"""

import pytest
import torch
from reference_docs import plain_adamw_docs
from test_exec_engine import CONFIGS, OPT, SEED, _elems
from transformers import AutoConfig

from slidedp.exec.engine import Engine
from slidedp.exec.features.offload import OffloadedActivations
from slidedp.exec.layer_runner import ModelRunner, document_mask
from slidedp.exec.packing import Document, pack_rows
from slidedp.exec.policy_runner import PolicyRunner, kept_layout
from slidedp.exec.staging import PinnedPool
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import Plan
from slidedp.spec.segments import parse_policy
from slidedp.spec.workload import Workload

SEQ = 16
LENGTHS = (5, 7, 4)  # one row: three documents
CPU = torch.device("cpu")


def _positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(k) for k in lengths])[None]


def test_document_mask_is_block_diagonal_causal():
    m = document_mask(torch.tensor([[0, 1, 2, 0, 1, 0]]), torch.float32)[0, 0]
    allowed = (m == 0).int().tolist()
    assert allowed == [[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                       [0, 0, 0, 1, 0, 0], [0, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 1]]
    assert bool(torch.isinf(m[m != 0]).all())


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_packed_layer_equals_documents_one_by_one(family):
    cfg = CONFIGS[family]
    packed = ModelRunner(cfg, CPU, torch.float32, packed=True)
    plain = ModelRunner(cfg, CPU, torch.float32)
    gen = torch.Generator().manual_seed(0)
    params = packed.layouts[1].views(torch.randn(packed.layouts[1].numel, generator=gen) * 0.1)
    x = torch.randn(1, SEQ, packed.hidden, generator=gen, requires_grad=True)
    g = torch.randn(1, SEQ, packed.hidden, generator=gen)
    leaves = {k: p.clone().requires_grad_() for k, p in params.items()}
    attn = packed.rope(SEQ, [_positions(LENGTHS)]).of(0)
    out = packed.layer_forward(leaves, x, attn)
    gx, *gp = torch.autograd.grad(out, [x, *leaves.values()], g)
    ref_gp = [torch.zeros_like(p) for p in gp]
    lo = 0
    for k in LENGTHS:
        xd = x.detach()[:, lo:lo + k].clone().requires_grad_()
        od = plain.layer_forward(leaves, xd, plain.rope(k))
        gxd, *gpd = torch.autograd.grad(od, [xd, *leaves.values()], g[:, lo:lo + k])
        torch.testing.assert_close(out[:, lo:lo + k], od, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx[:, lo:lo + k], gxd, rtol=1e-5, atol=1e-6)
        ref_gp = [a + b for a, b in zip(ref_gp, gpd, strict=True)]
        lo += k
    for a, b in zip(gp, ref_gp, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # without the mask the row would be one document: the test can tell them apart
    whole = packed.layer_forward(leaves, x, packed.rope(SEQ))
    assert not torch.allclose(whole[:, LENGTHS[0]:], out[:, LENGTHS[0]:], atol=1e-3)


def _run_policy(runner, policy, params, x, rope, g, ratio):
    p = parse_policy(policy)
    pr = PolicyRunner(runner, None)
    acts = pr.acts = OffloadedActivations([kept_layout(pr, p, params, x, rope)], 1, ratio, 2, CPU,
                                     PinnedPool(pin=False))
    acts.add(1, 0, x)
    out, state = pr.forward(p, 1, 0, params, x, rope)
    if ratio:
        acts.offload(1)
        acts.reload_layer(1)
    pr.recompute(state, params, rope)
    gx, pg = pr.backward(state, g)
    return out, gx, pg


@pytest.mark.parametrize("policy", ["none", "sac", "seg:0b0000000", "seg:0b0101010"])
def test_policies_on_packed_rows_match_whole_layer_checkpoint(policy):
    r = ModelRunner(CONFIGS["qwen3"], CPU, torch.float32, packed=True)
    gen = torch.Generator().manual_seed(1)
    params = r.layouts[1].views(torch.randn(r.layouts[1].numel, generator=gen) * 0.1)
    x = torch.randn(2, SEQ, r.hidden, generator=gen)
    g = torch.randn(2, SEQ, r.hidden, generator=gen)
    pos = torch.cat([_positions(LENGTHS), _positions((9, 7))])
    rope = r.rope(SEQ, [pos])
    ref = _run_policy(r, "layer", params, x, rope, g, 0.0)
    for ratio in (0.0, 0.5):
        out, gx, pg = _run_policy(r, policy, params, x, rope, g, ratio)
        assert torch.equal(out, ref[0]) and torch.equal(gx, ref[1])
        assert all(torch.equal(pg[n], ref[2][n]) for n in pg)


def _documents(vocab: int, steps: int) -> list[list[Document]]:
    """Per step 8 documents that pack into exactly 4 rows of 16 (BFD: 16 | 11+5 | 9+7 | 7+6+3);
    every other document masks its first two tokens (a prompt)."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        docs = []
        for i, k in enumerate((9, 7, 5, 11, 16, 3, 6, 7)):
            ids = torch.randint(0, vocab, (k,), generator=gen).tolist()
            labels = [-100, -100, *ids[2:]] if i % 2 else None
            docs.append(Document(ids, labels))
        out.append(docs)
    return out


PACKED_PLANS = {
    "layer": Plan(window_slots=2, h2d_chunk_mib=_elems(3000), d2h_chunk_mib=_elems(2000)),
    "policies-offload": Plan(window_slots=2, offload_ratio=0.5,
                             layer_policies=("sac", "seg:0b0101010", "none", "layer")),
}


def _check_packed_engine(plan: Plan, device: str = "cpu", dtype=torch.float32, tol=1e-5):
    cfg = CONFIGS["qwen3"]
    steps = _documents(cfg["vocab_size"], 2)
    rows = [pack_rows(docs, SEQ, pad_id=0) for docs in steps]
    assert all(len(r.tokens) == 4 and r.documents == 8 for r in rows)
    ref_docs = [[(torch.tensor(d.ids), torch.tensor(d.ids if d.labels is None else d.labels))
                 for d in docs] for docs in steps]
    ref_losses, ref_units = plain_adamw_docs(cfg, ref_docs, OPT, SEED)
    wl = Workload(parse_hf_config(cfg, "test"), seq_len=SEQ, global_batch=4, micro_batch=2, gpus=1)
    eng = Engine(cfg, wl, plan, optimizer=OPT, packed=True, device=device, dtype=dtype)
    try:
        eng.host_state.init_random(AutoConfig.for_model(**cfg), seed=SEED)
        init = [eng.host_state.unit_master(u).clone() for u in range(eng.host_state.n_units)]
        for r, ref in zip(rows, ref_losses, strict=True):
            got = eng.step(torch.from_numpy(r.tokens).long(), torch.from_numpy(r.labels).long(),
                           position_ids=torch.from_numpy(r.position_ids).long())
            assert abs(got.loss - ref) <= tol, (got.loss, ref)
        if dtype != torch.float32:
            return
        for u, (pr, p0) in enumerate(zip(ref_units, init, strict=True)):
            p = eng.host_state.unit_master(u)
            rel = float((p - pr).norm() / (pr - p0).norm())
            assert rel <= 1e-4, f"unit {u}: relative parameter difference {rel:.2e}"
    finally:
        eng.close()
        eng.host_state.close()


@pytest.mark.parametrize("plan", list(PACKED_PLANS))
def test_engine_on_packed_rows_matches_hf_on_documents_unpacked(plan):
    _check_packed_engine(PACKED_PLANS[plan])


# ---- on the device machine: python3 -m pytest -m gpu tests/test_exec_packing.py ---------------


@pytest.mark.gpu
@pytest.mark.parametrize("plan", list(PACKED_PLANS))
def test_cuda_packed_rows_match_documents_unpacked(plan):
    """The mask through SDPA's CUDA kernels (and, for the policies, the kept layout found with
    the packed runner's mask): FP32 as on the CPU; BF16 within BF16's reach of the FP32 reference."""
    _check_packed_engine(PACKED_PLANS[plan], device="cuda")
    _check_packed_engine(PACKED_PLANS[plan], device="cuda", dtype=torch.bfloat16, tol=3e-2)


def test_position_ids_need_a_packed_engine():
    cfg = CONFIGS["qwen3"]
    wl = Workload(parse_hf_config(cfg, "test"), seq_len=SEQ, global_batch=2, micro_batch=2, gpus=1)
    eng = Engine(cfg, wl, Plan(window_slots=2), optimizer=OPT)
    try:
        ids = torch.zeros(2, SEQ, dtype=torch.long)
        with pytest.raises(ValueError, match="packed=True"):
            eng.step(ids, position_ids=torch.zeros(2, SEQ, dtype=torch.long))
    finally:
        eng.close()
        eng.host_state.close()
