"""The activation-policy space (spec/segments.py) and its use by the plan, the graph and memory."""

import pytest

from slidedp.graph.build import build_graph
from slidedp.graph.tasks import Kind
from slidedp.model.memory import gpu_footprint
from slidedp.spec.errors import SpecError
from slidedp.spec.model import load_model
from slidedp.spec.plan import Plan, parse_plan
from slidedp.spec.segments import (
    ALL_KEPT,
    N_BOUNDARIES,
    SEGMENTS,
    parse_policy,
    policy_cost,
    recompute_fraction,
    segment_costs,
)
from slidedp.spec.workload import Workload

MODELS = ["tiny-qwen3", "qwen3-8b", "llama-3.1-8b", "qwen3-30b-a3b"]
SEQ = 4096


@pytest.mark.parametrize("name", MODELS)
def test_segments_sum_to_the_layer_figures(name):
    m = load_model(name)
    c = segment_costs(m, SEQ)
    assert len(c.fwd_flops) == len(SEGMENTS) == N_BOUNDARIES + 1 == len(c.internal_bytes)
    assert sum(c.fwd_flops) == pytest.approx(m.layer_flops_per_token(SEQ)["fwd"], rel=1e-12)
    none = c.input_bytes + sum(c.boundary_bytes) + sum(c.internal_bytes)
    assert none == pytest.approx(m.activation_bytes_per_token("none"), rel=1e-12)
    assert c.input_bytes == m.activation_bytes_per_token("layer")


@pytest.mark.parametrize("name", MODELS)
def test_named_policies_and_mask_extremes(name):
    m = load_model(name)
    none, layer = policy_cost(m, "none", SEQ), policy_cost(m, "layer", SEQ)
    assert none.retained_bytes == pytest.approx(m.activation_bytes_per_token("none"))
    assert not none.recomputes and none.transient_bytes < layer.transient_bytes
    assert layer.retained_bytes == m.activation_bytes_per_token("layer")
    assert layer.recompute_flops == m.layer_flops_per_token(SEQ)["recompute"]
    assert layer.transient_bytes == pytest.approx(m.backward_transient_bytes_per_token())
    assert recompute_fraction(m, "layer", SEQ, 150.0) == pytest.approx(1.0)
    # mask 0: keep x alone, recompute everything but down_proj (its output is not needed)
    zero = policy_cost(m, "seg:0b0000000", SEQ)
    assert zero.retained_bytes == layer.retained_bytes
    down = segment_costs(m, SEQ).fwd_flops[-1]
    assert zero.recompute_flops == pytest.approx(layer.recompute_flops - down)
    # all ones: exactly what none keeps, nothing recomputed
    ones = policy_cost(m, f"seg:{ALL_KEPT}", SEQ)
    assert ones == none
    sac = policy_cost(m, "sac", SEQ)
    assert layer.retained_bytes < sac.retained_bytes < none.retained_bytes
    assert sac.recompute_flops == 0 and sac.recompute_hbm_bytes > 0
    assert 0 < recompute_fraction(m, "sac", SEQ, 150.0) < 1


def test_masks_are_monotone():
    """Keeping one more boundary never retains less nor recomputes more."""
    m = load_model("qwen3-8b")
    for mask in range(ALL_KEPT):
        a = policy_cost(m, f"seg:{mask}", SEQ)
        for i in range(N_BOUNDARIES):
            if not mask >> i & 1:
                b = policy_cost(m, f"seg:{mask | 1 << i}", SEQ)
                assert b.retained_bytes > a.retained_bytes
                assert b.recompute_flops <= a.recompute_flops


@pytest.mark.parametrize(
    "text", ["seg", "seg:0b12", "seg:0b11111111", "seg:128", "seg:-1", "full", 3, "SAC"]
)
def test_bad_policy_names(text):
    with pytest.raises(SpecError, match="layer_policies"):
        parse_policy(text)


def test_plan_parses_and_canonicalizes_policies():
    p = Plan(layer_policies=("seg:85", "sac"))
    assert p.layer_policies == ("seg:0b1010101", "sac") and p.policy_of(1) == "seg:0b1010101"
    assert parse_plan(
        {"plan": {"layer_policies": ["seg:0b11", "none"]}}, "f.toml"
    ).layer_policies == ("seg:0b0000011", "none")
    with pytest.raises(SpecError, match=r"f.toml: field 'plan.layer_policies\[1\]'"):
        parse_plan({"plan": {"layer_policies": ["layer", "segment"]}}, "f.toml")
    with pytest.raises(SpecError, match="layer_policies"):
        parse_plan({"plan": {"layer_policies": "layer"}}, "f.toml")
    # one policy for every layer: layer or none; the others point at layer_policies
    assert parse_plan({"plan": {"activation_policy": "none"}}, "f.toml").policy_of(1) == "none"
    with pytest.raises(SpecError, match=r"f.toml: field 'plan.activation_policy'.*layer_policies"
                                        r".*got 'sac'"):
        parse_plan({"plan": {"activation_policy": "sac"}}, "f.toml")
    with pytest.raises(SpecError, match="policy"):
        load_model("tiny-qwen3").activation_bytes_per_token("seg:0b2")


def _wl():
    return Workload(load_model("tiny-qwen3"), 32, 1, 1, 1)  # 2 layers


def test_graph_uses_each_layers_policy():
    wl = _wl()
    m, tok = wl.model, wl.tokens_per_gpu_step
    plan = Plan(layer_policies=("sac", f"seg:{ALL_KEPT}"), offload_ratio=0.5)
    g = build_graph(wl, plan, cores=4, iterations=1)
    rec = g.kind == Kind.RECOMPUTE
    assert g.unit[rec].tolist() == [1]  # all boundaries kept: nothing to recompute, no task
    assert g.work[rec].tolist() == [0.0]  # sac recomputes elementwise work only
    assert g.meta.recompute_hbm_bytes[1] == tok * policy_cost(m, "sac", 32).recompute_hbm_bytes
    off = dict(
        zip(
            g.unit[g.kind == Kind.ACT_OFFLOAD].tolist(),
            g.work[g.kind == Kind.ACT_OFFLOAD].tolist(),
            strict=True,
        )
    )
    assert off[1] == 0.5 * tok * policy_cost(m, "sac", 32).retained_bytes
    assert off[2] == 0.5 * tok * m.activation_bytes_per_token("none")
    masked = build_graph(wl, Plan(layer_policies=("seg:0b0000001", "layer")), cores=4, iterations=1)
    works = masked.work[masked.kind == Kind.RECOMPUTE].tolist()
    assert works[1] < works[0] == tok * m.layer_flops_per_token(32)["recompute"]  # layer 2 first


def test_memory_uses_each_layers_policy():
    wl = _wl()
    m = wl.model
    tok, mb = wl.tokens_per_gpu_step, wl.tokens_per_micro_batch
    mixed = gpu_footprint(wl, Plan(layer_policies=("layer", "none")))
    assert mixed["checkpoints"] == pytest.approx(
        tok * (m.activation_bytes_per_token("layer") + m.activation_bytes_per_token("none"))
    )
    assert mixed["transient"] == pytest.approx(mb * policy_cost(m, "layer", 32).transient_bytes)
    none = gpu_footprint(wl, Plan(layer_policies=("none", "none")))
    assert none["transient"] == pytest.approx(mb * policy_cost(m, "none", 32).transient_bytes)
    assert none["transient"] < mixed["transient"]
