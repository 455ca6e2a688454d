"""profile_layer_policy's retained bytes agree with the model (slidedp.spec.segments.policy_cost).

CPU, BF16, one layer of the tiny qwen3 and llama configs. Stated tolerance: exact (0 bytes) for
"layer", "sac" and every mask that does not keep segment 3 (the model counts transformers' eager
RMSNorm as the executor runs it: slidedp.spec.segments.EAGER_NORM_BYTES); a kept segment 3 is
exactly 2 q bytes per token fewer than the model: on the CPU SDPA's output is already in o_proj's
order, so the o_proj input copy the model keeps as a GPU upper bound does not happen (segments.py
docstring); kept segments 3 and 4 together are 2 h bytes per token fewer: the executor keeps
boundary 3 (h1) only where a recompute starts from it (segment 4 recomputed); no backward reads
the BF16 h1 (the eager post-norm saves its FP32 copy, the residual adds nothing). Any other drift
fails.
"""

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_exec_engine import CONFIGS

from slidedp.exec.policy_profile import profile_layer_policy
from slidedp.spec.errors import SpecError
from slidedp.spec.model import load_model, parse_hf_config, preset_dir
from slidedp.spec.segments import BF16, parse_policy, policy_cost

SEQ, MB = 32, 2


def _eager_difference(m, policy: str) -> float:
    """Per token: measured minus modelled retained bytes (module docstring)."""
    p = parse_policy(policy)
    q = m.n_heads * m.head_dim
    if p.kind in ("layer", "sac"):
        return 0.0
    kept = {s for s in range(7) if p.kind == "none" or p.mask >> s & 1}
    return -BF16 * q * (3 in kept) - BF16 * m.hidden * (3 in kept and 4 in kept)


def _check(family: str, policy: str, ratio: float = 0.0):
    cfg = CONFIGS[family]
    m = parse_hf_config(cfg, "test")
    prof = profile_layer_policy(cfg, policy, MB, SEQ, offload_ratio=ratio, repeats=1)
    tokens = MB * SEQ
    predicted = tokens * (policy_cost(m, policy, SEQ).retained_bytes + _eager_difference(m, policy))
    assert prof.retained_bytes == predicted
    assert prof.offload_bytes == round(ratio * prof.retained_bytes)
    assert prof.fwd_s > 0 and prof.bwd_s > 0
    assert (prof.recompute_s > 0) == policy_cost(m, policy, SEQ).recomputes
    assert prof.transient_peak_bytes is None and prof.retained_alloc_bytes is None  # CPU
    return prof


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("policy", ["layer", "none", "sac", "seg:0b0000000", "seg:0b1100100"])
def test_retained_bytes_match_model(family, policy):
    _check(family, policy, ratio=0.5)


@settings(max_examples=10)
@given(mask=st.integers(0, 127), family=st.sampled_from(["qwen3", "llama"]))
def test_retained_bytes_match_model_for_masks(mask, family):
    _check(family, f"seg:{mask}")


def test_bad_inputs_are_spec_errors():
    with pytest.raises(SpecError):
        profile_layer_policy(CONFIGS["llama"], "seg:0b2", MB, SEQ)
    with pytest.raises(SpecError):
        profile_layer_policy(CONFIGS["llama"], "none", MB, SEQ, offload_ratio=1.5)
    with pytest.raises(SpecError):
        profile_layer_policy(CONFIGS["llama"] | {"model_type": "gpt2"}, "none", MB, SEQ)


def test_preset_spec_config_is_accepted():
    """`slidedp profile` passes a preset ModelSpec's config (a read-only mapping), not a dict:
    the sac-recompute step failed on that on the GPU (2026-12-01 08:23) before hf_config took
    any mapping."""
    spec = load_model("tiny-qwen3")
    assert not isinstance(spec.config, dict)
    prof = profile_layer_policy(spec.config, "sac", 1, SEQ, repeats=1)
    assert prof.fwd_s > 0 and prof.recompute_s > 0


@pytest.mark.gpu
def test_cuda_measures_allocated_bytes():
    prof = profile_layer_policy(CONFIGS["qwen3"], "none", MB, 256, device="cuda",
                                offload_ratio=0.5)
    assert prof.retained_alloc_bytes >= prof.retained_bytes * 0.5
    assert prof.transient_peak_bytes > 0


@pytest.mark.gpu
def test_cuda_policies_cost_what_they_recompute():
    """One Qwen3-0.6B layer in BF16, micro-batch 2 x 2048 tokens. What a policy recomputes is
    structural: "none" and seg:0b1111111 (every boundary kept) nothing, "layer" and seg:0b0000000
    (no boundary kept) the forward. The time between them is about that forward: with a forward
    f and a backward about 2f, 3f against 4f, so a policy that recomputes nothing takes at most
    0.9 of one that recomputes the forward (the margin holds while the recompute is above a
    tenth of the layer's time). No order is asserted between "layer" and seg:0b0000000: the
    segment path re-runs the segments one at a time, an overhead the FLOP share does not count
    and that can make it the slower of the two."""
    cfg = json.loads((preset_dir() / "qwen3-0.6b.json").read_text())
    prof = {p: profile_layer_policy(cfg, p, 2, 2048, device="cuda", repeats=7)
            for p in ("layer", "none", "seg:0b1111111", "seg:0b0000000")}
    assert prof["none"].recompute_s == prof["seg:0b1111111"].recompute_s == 0.0
    assert prof["layer"].recompute_s > 0 and prof["seg:0b0000000"].recompute_s > 0
    t = {p: x.compute_s for p, x in prof.items()}
    for kept in ("none", "seg:0b1111111"):
        for redone in ("layer", "seg:0b0000000"):
            assert t[kept] < 0.9 * t[redone], (kept, redone, t)
