"""The executor's activation policies compute what the whole-layer checkpoint computes.

Layer level (CPU, FP32, every family): the segment-level layer (segment_layer.py) gives the HF
layer's output and gradients bit for bit; under any policy (hypothesis over the 7-bit masks, none,
sac) and offload ratio, PolicyRunner's forward / offload / reload / recompute / backward gives the
same output and the same gradients bit for bit (one autograd graph per layer, the same ops in the
same order; the backward is ONE autograd.grad per layer and micro-batch for every policy). "none"
keeps exactly what autograd saves for the HF layer (and x). Engine level: after STEPS steps the
losses and parameters equal those of the all-"layer" run bit for bit, for none, sac, seg masks
0b0000000, 0b1111111 and a mixed per-layer list with offload ratios 0, 0.5, 1; the overlapped mode
equals the synchronous one bit for bit; the graph has no RECOMPUTE where a policy recomputes
nothing and offloads what a policy keeps after the forward that produced it.
"""

from dataclasses import replace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from test_exec_engine import CONFIGS, _batches, _elems, _reference, _train

from slidedp.exec.features.offload import OffloadedActivations
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.policy_runner import PolicyRunner, kept_layout
from slidedp.exec.segment_layer import SegmentLayer
from slidedp.exec.staging import PinnedPool
from slidedp.graph.build import build_graph
from slidedp.graph.tasks import Kind
from slidedp.spec.errors import SpecError
from slidedp.spec.model import parse_hf_config
from slidedp.spec.plan import Plan
from slidedp.spec.segments import parse_policy
from slidedp.spec.workload import Workload

FAMILIES = list(CONFIGS)
SEQ, STEPS = 16, 2
_RUNNERS: dict[str, ModelRunner] = {}


def _layer(family):
    """(runner, params, x, rope, grad_out) of one layer with fixed random values."""
    if family not in _RUNNERS:
        _RUNNERS[family] = ModelRunner(CONFIGS[family], torch.device("cpu"), torch.float32)
    r = _RUNNERS[family]
    gen = torch.Generator().manual_seed(0)
    params = r.layouts[1].views(torch.randn(r.layouts[1].numel, generator=gen) * 0.1)
    x = torch.randn(2, SEQ, r.hidden, generator=gen)
    return r, params, x, r.rope(SEQ), torch.randn(2, SEQ, r.hidden, generator=gen)


def _grads(out, x, params, g):
    return torch.autograd.grad(out, [x, *params.values()], g)


@pytest.mark.parametrize("family", FAMILIES)
def test_segment_layer_is_the_hf_layer(family):
    r, params, x, rope, g = _layer(family)
    seg = SegmentLayer(r.layer, list(params))
    leaves = {k: p.clone().requires_grad_() for k, p in params.items()}
    x = x.requires_grad_()
    ref, got = r.layer_forward(leaves, x, rope), seg.forward(leaves, x, rope)
    assert torch.equal(ref, got)
    assert all(torch.equal(a, b) for a, b in zip(_grads(ref, x, leaves, g), _grads(got, x, leaves, g),
                                                   strict=True))


def _run_policy(family, policy: str, ratio: float):
    """One layer under `policy` as the engine runs it: (output, input gradient, param grads)."""
    r, params, x, rope, g = _layer(family)
    p = parse_policy(policy)
    runner = PolicyRunner(r, None)
    acts = runner.acts = OffloadedActivations([kept_layout(runner, p, params, x, rope)], 1, ratio,
                                              2, torch.device("cpu"), PinnedPool(pin=False))
    acts.add(1, 0, x)
    out, state = runner.forward(p, 1, 0, params, x, rope)
    if ratio:
        acts.offload(1)
        acts.reload_layer(1)
    runner.recompute(state, params, rope)
    gx, pg = runner.backward(state, g)
    return out, gx, pg


def _check_policy(family, policy, ratio):
    ref_out, ref_gx, ref_pg = _run_policy(family, "layer", 0.0)
    out, gx, pg = _run_policy(family, policy, ratio)
    assert torch.equal(out, ref_out)
    assert torch.equal(gx, ref_gx)
    assert pg.keys() == ref_pg.keys() and all(torch.equal(pg[n], ref_pg[n]) for n in pg)


@pytest.mark.parametrize("policy", ["none", "sac", "seg:0b0000000", "seg:0b1111111"])
@pytest.mark.parametrize("family", FAMILIES)
def test_layer_policies_match_whole_layer_checkpoint(family, policy):
    for ratio in (0.0, 0.5, 1.0):
        _check_policy(family, policy, ratio)


@given(mask=st.integers(0, 127), ratio=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
       family=st.sampled_from(FAMILIES))
def test_any_segment_mask_matches_whole_layer_checkpoint(mask, ratio, family):
    _check_policy(family, f"seg:{mask}", ratio)


@pytest.mark.parametrize("policy", ["layer", "none", "sac", "seg:0b0000000", "seg:0b0101010"])
def test_backward_is_one_autograd_grad(policy, monkeypatch):
    calls = []
    grad = torch.autograd.grad

    def counting(*args, **kwargs):
        calls.append(1)
        return grad(*args, **kwargs)

    monkeypatch.setattr(torch.autograd, "grad", counting)
    _run_policy("qwen3", policy, 0.5)
    assert len(calls) == 1


@pytest.mark.parametrize("family", FAMILIES)
def test_none_keeps_what_autograd_saves(family):
    """The bytes "none" keeps are the distinct storages autograd saves for the HF layer (besides
    parameters and the RoPE table) plus x's: no boundary is kept for its own sake."""
    r, params, x, rope, _ = _layer(family)
    skip = {t.untyped_storage().data_ptr() for t in (*params.values(), *rope.tensors())}
    saved = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes()}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            saved.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
        return t

    leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = r.layer_forward(leaves, x.detach().requires_grad_(), rope)
    layout = kept_layout(PolicyRunner(r, None), parse_policy("none"), params, x, rope)
    assert sum(layout) == sum(saved.values()) and out is not None


def test_policy_keeps_what_its_layout_says():
    """Kept bytes grow with the kept boundaries; a full offload moves all of them."""
    r, params, x, rope, _ = _layer("qwen3")
    runner = PolicyRunner(r, None)
    size = {p: sum(kept_layout(runner, parse_policy(p), params, x, rope))
            for p in ("layer", "seg:0b0000000", "seg:0b0100000", "sac", "none")}
    assert size["layer"] == size["seg:0b0000000"] == x.numel() * 4
    assert size["seg:0b0000000"] < size["seg:0b0100000"] < size["none"]
    assert size["layer"] < size["sac"] < size["none"]
    acts = OffloadedActivations([(100, 60, 40)], 2, 0.5, 1, torch.device("cpu"),
                                PinnedPool(pin=False))
    assert acts.offload_bytes(1) == 100  # the first half of the 200 bytes, in keep order


# ---- the engine ----------------------------------------------------------------------------


def _plan(policies, ratio, n_layers):
    names = tuple(policies) if len(policies) == n_layers else tuple(policies) * n_layers
    return Plan(window_slots=2, h2d_chunk_mib=_elems(3000), d2h_chunk_mib=_elems(2000),
                layer_policies=names, offload_ratio=ratio)


POLICY_SETS = {"none": ("none",), "sac": ("sac",), "seg0": ("seg:0b0000000",),
               "seg127": ("seg:0b1111111",), "mixed": ("sac", "seg:0b1010101", "none")}


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_policies_match_whole_layer_checkpoint(family):
    cfg = CONFIGS[family]
    n = cfg["num_hidden_layers"]
    batches = _batches(cfg, 4)[:STEPS]
    layer_plan = _plan(["layer"], 0.0, n)
    init = _reference(cfg, batches)[2]  # the same initial parameters (seeded)
    ref_res, ref = _train(cfg, layer_plan, batches, micro_batch=2)
    for name, pols in POLICY_SETS.items():
        pols = (pols * n)[:n] if name == "mixed" else pols
        for ratio in (0.0, 0.5, 1.0):
            res, got = _train(cfg, _plan(pols, ratio, n), batches, micro_batch=2)
            assert [r.loss for r in res] == [r.loss for r in ref_res], f"{name} r={ratio}"
            for u, (p, pr, p0) in enumerate(zip(got, ref, init, strict=True)):
                rel = float((p - pr).norm() / (pr - p0).norm())
                assert torch.equal(p, pr), f"{name} r={ratio} unit {u}: {rel:.1e}"


def test_engine_policies_overlap_equals_sync_bit_for_bit():
    cfg = CONFIGS["qwen3"]
    plan = _plan(("none", "sac", "seg:0b0110001", "layer"), 0.5, 4)
    plan = replace(plan, reload_ahead_layers=1, update_workers=2)
    batches = _batches(cfg, 4)[:STEPS]
    a, pa = _train(cfg, plan, batches, mode="overlap")
    b, pb = _train(cfg, plan, batches, mode="sync")
    assert [r.loss for r in a] == [r.loss for r in b]
    assert all(torch.equal(x, y) for x, y in zip(pa, pb, strict=True))


def test_graph_follows_each_layers_policy():
    cfg = CONFIGS["qwen3"]
    wl = Workload(parse_hf_config(cfg, "test"), seq_len=SEQ, global_batch=2, micro_batch=2, gpus=1)
    plan = _plan(("none", "seg:0b1111111", "layer", "seg:0b0000000"), 0.5, 4)
    g = build_graph(wl, plan, cores=2, iterations=1)
    kinds = [Kind(int(k)) for k in g.kind]
    task = {(kinds[v], int(g.unit[v])): v for v in range(g.n_tasks)}
    assert {u for k, u in task if k == Kind.RECOMPUTE} == {3, 4}
    preds = {}
    for s, d in zip(g.edge_src.tolist(), g.edge_dst.tolist(), strict=True):
        preds.setdefault(d, set()).add(s)
    for layer, producer in ((1, (Kind.FWD, 1)), (2, (Kind.FWD, 2)), (3, (Kind.FWD, 2)),
                            (4, (Kind.FWD, 3))):
        assert task[producer] in preds[task[(Kind.ACT_OFFLOAD, layer)]]


def test_bad_policies_are_spec_errors():
    with pytest.raises(SpecError):
        Plan(layer_policies=("seg:0b11111111",))
    with pytest.raises(SpecError):
        parse_policy("segment")


def test_a_step_after_a_failed_step_starts_clean():
    """A step that fails after the forward kept its activations leaves them behind; the next
    step must not trip over them (KeptActivations.reset at each step's start)."""
    from test_exec_engine import OPT, SEED, SEQ
    from transformers import AutoConfig

    from slidedp.exec.engine import Engine

    cfg = CONFIGS["qwen3"]
    n = cfg["num_hidden_layers"]
    (ids, labels), = _batches(cfg, 4)[:1]
    fail = [True]

    def probe(it, kind, unit, slot):
        if kind == Kind.BWD and fail[0]:
            fail[0] = False
            raise RuntimeError("injected")

    wl = Workload(parse_hf_config(cfg, "test"), seq_len=SEQ, global_batch=4, micro_batch=2, gpus=1)
    with Engine(cfg, wl, _plan(("sac",), 0.5, n), optimizer=OPT, probe=probe) as eng:
        eng.host_state.init_random(AutoConfig.for_model(**cfg), seed=SEED)
        with pytest.raises(RuntimeError, match="injected"):
            eng.step(ids, labels)
        assert eng.step(ids, labels).loss > 0
