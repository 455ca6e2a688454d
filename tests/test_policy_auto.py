"""AutoPolicy: the MILP against brute force, placement, shortlisting, fallback and `slidedp plan`."""

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import slidedp.policy.auto as auto
from slidedp.policy.activations import place, profile_policies, shortlist
from slidedp.policy.auto import auto_plan
from slidedp.policy.milp import PolicyData, brute_force, memory_bytes, solve, step_cost_s
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import load_plan
from slidedp.spec.workload import Workload

GIB = 2**30

policy_data = st.builds(
    PolicyData,
    name=st.just(""),
    tau_s=st.floats(0.01, 1.0),
    retained_bytes=st.floats(0.0, 10.0),
    transient_bytes=st.floats(0.0, 10.0),
    reload_bytes=st.floats(0.0, 5.0),
)


@given(st.lists(policy_data, min_size=1, max_size=3), st.integers(1, 6), st.floats(0.0, 60.0))
def test_milp_matches_brute_force(data, n_layers, budget):
    data = [
        PolicyData(f"p{j}", d.tau_s, d.retained_bytes, d.transient_bytes, d.reload_bytes)
        for j, d in enumerate(data)
    ]
    best = brute_force(data, n_layers, budget)
    counts = solve(data, n_layers, budget)
    if best is None:
        assert counts is None
        return
    assert counts is not None and sum(counts) == n_layers
    assert memory_bytes(data, counts) <= budget * (1 + 1e-6) + 1e-6
    assert step_cost_s(data, counts) == pytest.approx(best, rel=1e-6, abs=1e-6)


def test_milp_max_terms_count_only_used_policies():
    cheap = PolicyData("layer", 1.0, 1.0, 1.0, 0.0)
    fast = PolicyData("none", 0.5, 3.0, 100.0, 0.0)  # fast, but its transient peak never fits
    assert solve([cheap, fast], 4, 50.0) == [4, 0]
    assert solve([cheap, fast], 4, 200.0) == [0, 4]
    assert solve([cheap, fast], 4, 3.0) is None


def test_placement_contiguous_lightest_first():
    retained = {"none": 9.0, "layer": 1.0, "sac": 4.0}
    assert place({"none": 2, "layer": 1, "sac": 2}, retained) == (
        "layer",
        "sac",
        "sac",
        "none",
        "none",
    )


def test_shortlist_is_a_pareto_front_with_the_reference():
    hw = load_hardware("h200x2")
    wl = Workload(load_model("qwen3-8b"), 4096, 8, 4, 2)
    short = shortlist(profile_policies(hw, wl), limit=5)
    names = [p.name for p in short]
    assert "layer" in names and "none" in names and len(short) <= 5
    front = [p for p in short if p.name != "layer"]
    for a, b in zip(front, front[1:], strict=False):
        assert a.retained_bytes_per_token < b.retained_bytes_per_token
        assert a.recompute_fraction > b.recompute_fraction


def _tiny():
    return load_hardware("h200x1"), Workload(load_model("tiny-qwen3"), 256, 2, 2, 1)


def test_auto_plan_fits_the_cap_and_reports():
    hw, wl = _tiny()
    plan, rep = auto_plan(hw, wl, 40 * GIB)
    assert len(plan.layer_policies) == wl.model.n_layers
    assert sum(rep.counts.values()) == wl.model.n_layers
    assert rep.selection_s > 0 and any("selection took" in x for x in rep.lines())
    assert any("no probe given" in n for n in rep.notes)


def test_probe_hook_reorders_routes():
    hw, wl = _tiny()
    seen = []

    def probe(plan):
        seen.append(plan.h2d_chunk_mib)
        return 1.0 / plan.h2d_chunk_mib  # pretend: the biggest chunk measures fastest

    plan, rep = auto_plan(hw, wl, 40 * GIB, probe=probe)
    assert len(seen) == 2 and rep.routes[0].measured_s == min(1.0 / c for c in seen)
    assert not any("no probe" in n for n in rep.notes)


def test_fallback_when_the_milp_finds_nothing(monkeypatch):
    hw, wl = _tiny()
    monkeypatch.setattr(auto, "solve", lambda *a, **k: None)
    plan, rep = auto_plan(hw, wl, 40 * GIB)
    assert plan.layer_policies == ("layer",) * wl.model.n_layers
    assert any("fell back" in n for n in rep.notes)


def test_cap_too_small_says_it_cannot_fit():
    hw, wl = _tiny()
    with pytest.raises(InfeasiblePlan, match="GPU memory"):
        auto_plan(hw, wl, 0.5 * GIB)


def test_cli_plan_writes_a_plan_simulate_reads(tmp_path):
    out = tmp_path / "plan.toml"
    args = ["--hardware", "h200x1", "--model", "tiny-qwen3", "--seq", "256", "--micro-batch", "2"]
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "slidedp.cli",
            "plan",
            *args,
            "--gpu-memory-cap-gib",
            "40",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "selection took" in r.stdout and "exposed:" in r.stdout and "40.0 GiB" in r.stdout
    plan = load_plan(out)
    assert len(plan.layer_policies) == 2
    for verb in ("simulate", "predict"):
        r = subprocess.run(
            [sys.executable, "-m", "slidedp.cli", verb, *args, "--plan", str(out)],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "slidedp.cli", "plan", "--gpu-memory-cap-gib", "0"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--gpu-memory-cap-gib" in bad.stderr
