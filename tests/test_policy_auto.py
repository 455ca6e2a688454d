"""AutoPolicy: the MILP against brute force, placement, shortlisting, fallback and `slidedp plan`."""

import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

import slidedp.policy.auto as auto
import slidedp.sim.batch as sim_batch
from slidedp.model.memory import check_fits
from slidedp.policy.activations import (
    PolicyProfile,
    place,
    profile_policies,
    shortlist,
)
from slidedp.policy.auto import auto_plan, capped
from slidedp.policy.milp import PolicyData, brute_force, memory_bytes, solve, step_cost_s
from slidedp.policy.report import ActivationChoice, Finalist, PolicyReport
from slidedp.policy.routes import TIE_REL, Scored, best_first, window_candidates
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import ParamRoute, Plan, default_plan, load_plan
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
    assert (counts is None) == (best is None)  # infeasible for both, or for neither
    if best is None:
        return
    assert sum(counts) == n_layers
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


@st.composite
def _policy_profiles(draw):
    """`layer` anywhere, a Pareto front of up to 20 policies (heavier ones recompute less) and a
    few others."""
    n = draw(st.integers(1, 20))
    sizes = sorted(draw(st.lists(st.integers(2, 400), min_size=n, max_size=n, unique=True)))
    fracs = sorted(draw(st.lists(st.integers(0, 64), min_size=n, max_size=n, unique=True)),
                   reverse=True)
    extra = draw(st.lists(st.tuples(st.integers(1, 400), st.integers(0, 64)), max_size=5))
    layer = draw(st.tuples(st.integers(1, 400), st.integers(0, 64)))
    points = dict.fromkeys([*zip(sizes, fracs, strict=True), *extra])  # distinct, in order
    points.pop(layer, None)
    return [PolicyProfile("layer", float(layer[0]), 0.0, layer[1] / 64),
            *(PolicyProfile(f"p{i}", float(b), 0.0, k / 64) for i, (b, k) in enumerate(points))]


def _on_or_above(a: PolicyProfile, b: PolicyProfile, c: PolicyProfile) -> bool:
    """b on or above the chord from a to c (a, b, c by increasing bytes), exactly: the cross
    product of integers and 64ths."""
    return ((b.retained_bytes_per_token - a.retained_bytes_per_token)
            * (c.recompute_fraction - a.recompute_fraction)
            - (b.recompute_fraction - a.recompute_fraction)
            * (c.retained_bytes_per_token - a.retained_bytes_per_token)) <= 0


@given(_policy_profiles(), st.integers(3, 8))
def test_shortlist_keeps_every_lower_hull_point_that_fits(profiles, limit):
    """The shortlist is `layer` first, then points of the Pareto front (by definition: nothing as
    light and as cheap), at most `limit` in all, in the front's order; where the front's lower
    convex hull (by definition: no two front points on either side with the point on or above
    their chord), `layer` left out, fits in limit - 1, every hull point is in it; where it does
    not, only hull points are, limit - 1 of them, the hull's two ends among them."""
    reference = profiles[0]
    short = shortlist(profiles, limit)
    assert short[0] is reference and reference not in short[1:] and len(short) <= limit

    def dominated(p):
        return any(q is not p and q.retained_bytes_per_token <= p.retained_bytes_per_token
                   and q.recompute_fraction <= p.recompute_fraction for q in profiles)

    front = sorted((p for p in profiles if not dominated(p)),
                   key=lambda p: p.retained_bytes_per_token)
    assert short[1:] == [p for p in front if p in short and p is not reference]
    hull = [b for i, b in enumerate(front)
            if not any(_on_or_above(a, b, c) for a in front[:i] for c in front[i + 1:])]
    hull = [p for p in hull if p is not reference]
    kept = [p for p in hull if p in short]
    assert len(kept) == min(len(hull), limit - 1)  # the whole hull where it fits
    overflow = len(hull) > limit - 1  # else only hull points, the hull's two ends among them
    assert not overflow or (kept == short[1:] and hull[0] in kept and hull[-1] in kept)


def _tiny():
    return load_hardware("h200x1"), Workload(load_model("tiny-qwen3"), 256, 2, 2, 1)


@pytest.fixture(autouse=True)
def _priced(monkeypatch):
    """The tiny model's simulated steps price no activation policy (auto._priced_none), which
    with probes would send every selection here down the unpriced path; the tests of the MILP's
    mix and of its probe see policies priced, and the tests of the unpriced path set it again."""
    monkeypatch.setattr(auto, "_priced_none", lambda finalist, profiles: False)


def test_auto_plan_fits_the_cap_and_reports():
    hw, wl = _tiny()
    plan, rep = auto_plan(hw, wl, 40 * GIB)
    assert len(plan.layer_policies) == wl.model.n_layers
    assert sum(rep.chosen.activations.counts.values()) == wl.model.n_layers
    assert rep.selection_s > 0 and any("selection took" in x for x in rep.lines())
    assert any("no real probe" in x for x in rep.lines())
    # the time by stage adds up to the whole (no probes: ranking and the activation MILPs)
    assert list(rep.stages_s) == ["route ranking", "activation MILPs"]
    assert sum(rep.stages_s.values()) == pytest.approx(rep.selection_s, abs=0.05)
    assert any("(route ranking " in x for x in rep.lines())


def test_windows_are_candidates_up_to_the_largest_that_fits():
    hw = load_hardware("h200x1")
    wl = Workload(load_model("qwen3-8b"), 4096, 4, 4, 1)
    base = Plan(param_route=ParamRoute.REPLICATED)
    assert window_candidates(hw, wl, base) == [3, 19, 36]  # W = L fits 141 GiB
    tight = capped(hw, 24 * GIB)  # 18.4 GiB at 3 slots, 0.36 GiB per slot more
    ws = window_candidates(tight, wl, base)
    assert len(ws) == 3 and ws[0] == 3 and 3 < ws[-1] < 36 and ws[1] == (3 + ws[-1]) // 2
    fits = replace(base, window_slots=ws[-1], layer_policies=("layer",) * 36)
    check_fits(tight, wl, fits)  # the largest fits, one more slot does not
    with pytest.raises(InfeasiblePlan):
        check_fits(tight, wl, replace(fits, window_slots=ws[-1] + 1))


def test_spare_memory_goes_to_the_window_when_uploads_are_exposed():
    """Host-bound Qwen3-8B on one H200: W = L saves the second upload (simulated ~12%)."""
    hw = load_hardware("h200x1")
    wl = Workload(load_model("qwen3-8b"), 4096, 4, 4, 1)
    plan, rep = auto_plan(hw, wl, hw.gpu.hbm_bytes)
    assert plan.window_slots == wl.model.n_layers
    windows = {f.route.plan.window_slots for f in rep.finalists}
    assert windows == {3, 19, 36}
    # every chunk size reaches the probes too: the simulator barely separates them
    assert {f.route.plan.h2d_chunk_mib for f in rep.finalists} == {
        s.plan.h2d_chunk_mib for s in rep.routes}
    by_w = {f.route.plan.window_slots: f.score_s for f in rep.finalists}
    assert by_w[36] < by_w[3] * 0.95
    assert any("window 36 over window 3, " in x and " saves " in x for x in rep.lines())


def test_probes_decide_between_finalists_and_say_so():
    hw, wl = _tiny()
    seen = []

    def probe(plan):  # pretend: the biggest window with the biggest chunk measures fastest
        seen.append(plan)
        return 1.0 / (plan.window_slots * plan.h2d_chunk_mib)

    plan, rep = auto_plan(hw, wl, 40 * GIB, probe=probe, probe_device="fake")
    routes = [p for p in seen if not p.layer_policies]  # every finalist's route, all `layer`
    assert len(routes) == len(rep.finalists) >= 2
    assert all(f.route.measured_s is not None for f in rep.finalists)
    # the tiny model's MILP chooses a mix (not all `layer`): the chosen plan is probed last
    assert rep.chosen.activations.counts != {"layer": wl.model.n_layers}
    assert seen[-1] == plan and rep.chosen.plan_measured_s == probe(plan)
    best = max(routes, key=lambda p: p.window_slots * p.h2d_chunk_mib)
    assert (plan.window_slots, plan.h2d_chunk_mib) == (best.window_slots, best.h2d_chunk_mib)
    text = "\n".join(rep.lines())
    assert "probes on fake:" in text and "no real probe" not in text
    assert f"probes of {len(rep.finalists)} of {len(rep.finalists)} finalists" in rep.stages_s


def test_time_limit_stops_the_probes_and_says_so():
    """No probe starts that would end the selection past the limit: with probes of 0.2 s and a
    limit the simulated stages already spend, only the best simulated finalist is measured; the
    others leave the choice and the report names them."""
    hw, wl = _tiny()
    _, free = auto_plan(hw, wl, 40 * GIB, probe=lambda p: 1.0, probe_device="fake")
    assert len(free.finalists) >= 2

    def probe(plan):
        time.sleep(0.2)
        return 1.0

    plan, rep = auto_plan(hw, wl, 40 * GIB, probe=probe, probe_device="fake", time_limit_s=0.01)
    assert len(rep.finalists) == 1 and rep.finalists[0].route.measured_s == 1.0
    best = min(free.finalists, key=lambda f: f.simulated_score_s)
    assert rep.finalists[0].route.plan == best.route.plan
    skipped = [n for n in rep.notes if n.startswith("finalist") and "time limit" in n]
    assert len(skipped) == len(free.finalists) - 1
    # the tiny model's MILP chooses a mix (not all `layer`), and the limit leaves it unprobed
    assert rep.chosen.activations.counts != {"layer": wl.model.n_layers}
    assert rep.chosen.plan_measured_s is None
    assert any(n.startswith("the chosen policy mix was not probed") for n in rep.notes)


@pytest.mark.parametrize("limit_s, mix_probed", [(15.0, False), (25.0, True)])
def test_the_mix_probe_starts_only_where_it_ends_within_the_limit(monkeypatch, limit_s, mix_probed):
    """On a clock where the simulated stages take no time and a probe 10 s: the first finalist
    is always probed (ends at 10 s); a second finalist needs room for itself and the mix (30 s);
    the chosen mix is probed only where one more probe still ends within the limit (20 s), not
    merely where the limit has not passed yet."""
    hw, wl = _tiny()
    _, free = auto_plan(hw, wl, 40 * GIB)
    assert free.chosen.activations.counts != {"layer": wl.model.n_layers}
    assert len(free.finalists) >= 2
    now = [0.0]
    monkeypatch.setattr(auto, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    probed = []

    def probe(plan):
        probed.append(plan)
        now[0] += 10.0
        return 1.0

    _, rep = auto_plan(hw, wl, 40 * GIB, probe=probe, probe_device="fake", time_limit_s=limit_s)
    assert len(probed) == 1 + mix_probed
    assert (rep.chosen.plan_measured_s is not None) == mix_probed
    assert any(n.startswith("the chosen policy mix was not probed") for n in rep.notes) != mix_probed
    assert rep.selection_s <= limit_s


def test_the_probes_host_state_is_prepared_only_once_a_plan_fits():
    """auto_plan asks the probe to start building its host state after the route ranking found
    a plan that fits the machine (host memory included), never before, never for a cap that
    nothing fits."""
    hw, wl = _tiny()
    events = []

    class Probe:
        def prepare(self):
            events.append("prepare")

        def __call__(self, plan):
            events.append("probe")
            return 1.0

    auto_plan(hw, wl, 40 * GIB, probe=Probe(), probe_device="fake")
    assert events[0] == "prepare" and events.count("prepare") == 1 and "probe" in events
    events.clear()
    with pytest.raises(InfeasiblePlan):
        auto_plan(hw, wl, 1e6, probe=Probe(), probe_device="fake")
    assert events == []


def test_no_mix_probe_without_a_measured_route():
    """Every finalist refused by the probe: nothing to compare the mix with, so it is not probed
    (it could not be rejected) and the report says so."""
    hw, wl = _tiny()
    probed = []

    def probe(plan):
        probed.append(plan)
        return None

    _, rep = auto_plan(hw, wl, 40 * GIB, probe=probe, probe_device="fake")
    assert rep.chosen.activations.counts != {"layer": wl.model.n_layers}
    assert all(p.layer_policies == () or set(p.layer_policies) == {"layer"} for p in probed)
    assert rep.chosen.plan_measured_s is None
    assert any("no route was measured" in n for n in rep.notes)


def test_a_mix_no_faster_than_all_layer_as_a_whole_plan_is_dropped():
    """With half the activations offloaded the per-layer savings can add up while the whole plan
    simulates slower than all `layer` (the offload traffic): such a mix is not kept."""
    hw = load_hardware("h200x1")
    wl = Workload(load_model("qwen3-1.7b"), 8192, 2, 1, 1)
    base = replace(default_plan(hw.fabric.kind), offload_ratio=0.5)
    _, rep = auto_plan(hw, wl, 40 * GIB, base=base)
    dropped = [f for f in rep.finalists if any("no faster than all `layer`" in n
                                               for n in f.activations.notes)]
    assert dropped
    for f in rep.finalists:
        assert f.activations.whole_plan_saving_s >= 0 and f.activations.saving_s >= 0
    for f in dropped:
        assert set(f.activations.plan.layer_policies) == {"layer"}


def test_probe_refusals_drop_finalists_and_measured_taus_replace_simulated():
    hw, wl = _tiny()
    calls = []

    def calibrate(ref, name):
        calls.append(name)
        return -1.0 if name == "none" else None

    plan, rep = auto_plan(
        hw, wl, 40 * GIB, probe=lambda p: None if p.window_slots == 3 else 1.0,
        probe_device="fake", calibrate=calibrate)
    assert all(f.route.plan.window_slots != 3 for f in rep.finalists)
    assert any("refused" in n for n in rep.notes)
    taus = rep.chosen.activations.taus_s
    assert taus["none"] == pytest.approx(taus["layer"] - 1.0)  # tau_0 + measured delta
    assert rep.measured_taus == {"none"}
    assert rep.chosen.activations.counts == {"none": wl.model.n_layers}  # measured: far cheaper
    assert calls == ["none"]  # only what a finalist's MILP chose is measured


def test_calibration_rounds_measure_what_the_milps_choose_then_solve_again():
    """Every policy measured far costlier than `layer`: round 1 measures what the simulated
    costs chose, round 2 what the MILPs chose instead; none is measured twice, and no measured
    policy survives in the choice."""
    hw, wl = _tiny()
    calls = []

    def calibrate(ref, name):
        calls.append(name)
        return 1.0

    plan, rep = auto_plan(hw, wl, 40 * GIB, calibrate=calibrate)
    _, free = auto_plan(hw, wl, 40 * GIB)  # no calibration: round 1's choice
    first = set(free.chosen.activations.counts) - {"layer"}
    assert first and first <= set(calls) and len(calls) == len(set(calls))
    assert set(calls) == rep.measured_taus
    assert not set(rep.chosen.activations.counts) & rep.measured_taus
    assert rep.stages_s["policy costs measured"] >= 0 and rep.stages_s["activation MILPs"] > 0


def test_calibrations_keep_within_their_share_of_the_time_limit(monkeypatch):
    """On a clock where the simulated stages take no time and a calibration or a probe 10 s,
    with a 30 s limit: calibrations end within CALIBRATION_SHARE of it (15 s), so the first
    runs (0-10 s) and the next, which would end at 20 s, does not; its policy keeps the
    simulated tau_j and the report says why; the probes still get their time after."""
    hw, wl = _tiny()
    unbounded = []
    auto_plan(hw, wl, 40 * GIB, calibrate=lambda ref, name: unbounded.append(name) or 1.0)
    assert len(unbounded) >= 2  # without a limit, two rounds measure two policies or more
    now = [0.0]
    monkeypatch.setattr(auto, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    calls, probed = [], []

    def calibrate(ref, name):
        calls.append(name)
        now[0] += 10.0
        return 1.0

    def probe(plan):
        probed.append(plan)
        now[0] += 10.0
        return 1.0

    _, rep = auto_plan(hw, wl, 40 * GIB, calibrate=calibrate, probe=probe, probe_device="fake",
                       time_limit_s=30.0)
    assert auto.CALIBRATION_SHARE == 0.5 and calls == unbounded[:1]
    assert rep.measured_taus == set(calls)
    late = [n for n in rep.notes if "keep within 50% of the selection's time limit" in n]
    assert len(late) == 1 and unbounded[1] in late[0]
    assert probed and rep.selection_s <= 30.0


def test_calibration_rounds_simulate_nothing_twice(monkeypatch):
    """Re-solving after a calibration round reuses the simulated plans (sim/batch.py StepTimes,
    here in this process): the rounds add only the measured costs, not a second pass of
    simulations."""
    hw, wl = _tiny()
    seen: list[Plan] = []
    real = sim_batch.simulate

    def counting(hw_, wl_, plan, **kw):
        seen.append(plan)
        return real(hw_, wl_, plan, **kw)

    monkeypatch.setattr(sim_batch, "simulate", counting)
    _, rep = auto_plan(hw, wl, 40 * GIB, calibrate=lambda ref, name: 1.0, sim_workers=1)
    assert len(rep.measured_taus) >= 2  # measured costs (here two rounds, one policy each)
    assert seen and len(seen) == len(set(seen))


def test_a_mix_saves_no_more_than_its_whole_plan_simulates():
    """A policy mix is scored by the smaller of the MILP's sum of per-layer savings and the
    whole plan simulated: the finalist whose pipeline hides the saved compute wins even where the
    sums tie (Qwen3-4B seq 16384: windows 3 and 36 had equal sums; window 36 measured 7% faster)."""
    hw = load_hardware("benchmarks/results/2026-12-01-h200-profile-0205.toml")
    wl = Workload(load_model("qwen3-4b"), 16384, 1, 1, 1)
    _, rep = auto_plan(hw, wl, hw.gpu.hbm_bytes)
    for f in rep.finalists:
        a = f.activations
        assert a.whole_plan_saving_s == pytest.approx(a.all_layer_s - a.final_s)
        assert a.saving_s == min(a.milp_saving_s, a.whole_plan_saving_s)
    sums = {round(f.activations.milp_saving_s, 6) for f in rep.finalists
            if f.route.plan.h2d_chunk_mib == 256}
    assert len(sums) == 1  # the MILPs' sums tie across windows: the whole plans decide
    assert rep.chosen.route.plan.window_slots == wl.model.n_layers
    assert rep.chosen.activations.saving_s < rep.chosen.activations.milp_saving_s


def test_runs_policy_limits_the_activation_policies():
    hw, wl = _tiny()
    plan, rep = auto_plan(hw, wl, 40 * GIB, runs_policy=lambda name: name == "layer")
    assert set(rep.chosen.activations.taus_s) == {"layer"}
    assert plan.layer_policies == ("layer",) * wl.model.n_layers


def test_fallback_when_the_milp_finds_nothing(monkeypatch):
    hw, wl = _tiny()
    monkeypatch.setattr(auto, "solve", lambda *a, **k: None)
    plan, rep = auto_plan(hw, wl, 40 * GIB)
    assert plan.layer_policies == ("layer",) * wl.model.n_layers
    assert any("fell back" in x for x in rep.lines())


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


def test_time_limit_never_leaves_only_a_refused_finalist():
    """The best simulated finalist refused (e.g. out of memory) and the time already past the
    limit: the probes go on until one finalist is measured, and that one is chosen."""
    hw, wl = _tiny()
    calls = []

    def probe(plan):
        calls.append(plan)
        time.sleep(0.05)
        return None if len(calls) == 1 else 1.0

    plan, rep = auto_plan(hw, wl, 40 * GIB, probe=probe, probe_device="fake", time_limit_s=0.01)
    assert len(rep.finalists) == 1 and rep.finalists[0].route.measured_s == 1.0
    assert rep.finalists[0].route.plan != calls[0]
    assert any("refused it (dropped)" in n for n in rep.notes)
    assert "probes of 2 of" in " ".join(rep.stages_s)


def test_a_probes_one_off_setup_is_not_its_cost(monkeypatch):
    """A probe whose first call builds the host state (setup_s) does not make every later probe
    look as long: on a clock where the simulated stages take no time, 3 s of setup, 10 ms probes
    and a limit of 3.6 s probe every finalist (counting the setup as the first probe's cost
    would stop after it)."""
    hw, wl = _tiny()
    _, free = auto_plan(hw, wl, 40 * GIB, probe=lambda p: 1.0, probe_device="fake")
    now = [0.0]
    monkeypatch.setattr(auto, "time", SimpleNamespace(perf_counter=lambda: now[0]))

    class Probe:
        setup_s = 0.0

        def __call__(self, plan):
            if self.setup_s == 0.0:
                now[0] += 3.0
                self.setup_s = 3.0
            now[0] += 0.01
            return 1.0

    _, rep = auto_plan(hw, wl, 40 * GIB, probe=Probe(), probe_device="fake", time_limit_s=3.6)
    assert len(rep.finalists) == len(free.finalists) >= 2
    assert not any("time limit" in n for n in rep.notes)
    assert rep.selection_s == pytest.approx(3.0 + 0.01 * len(rep.finalists), abs=0.011)


def test_plan_cli_refuses_a_bad_time_limit(capsys):
    from slidedp.cli import main

    assert main(["plan", "--model", "tiny-qwen3", "--seq", "64", "--micro-batch", "1",
                 "--time-limit-s", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--time-limit-s" in err and "positive" in err


def test_a_simulated_tie_goes_to_the_larger_chunks():
    """Within TIE_REL of the best, larger chunks first (the executor's per-task cost, which the
    model leaves out); a real difference still wins."""
    plans = {c: Plan(h2d_chunk_mib=c, d2h_chunk_mib=c) for c in (16.0, 64.0, 256.0)}
    steps = [(plans[16.0], 2.217), (plans[256.0], 2.220), (plans[64.0], 2.219)]
    order = best_first(steps, lambda x: x[1], lambda x: x[0])
    assert [p.h2d_chunk_mib for p, _ in order] == [256.0, 64.0, 16.0]
    steps = [(plans[16.0], 2.0), (plans[256.0], 2.0 * (1 + 2 * TIE_REL))]
    assert best_first(steps, lambda x: x[1], lambda x: x[0])[0][0].h2d_chunk_mib == 16.0


@given(st.lists(st.tuples(st.sampled_from([16.0, 64.0, 256.0]), st.floats(1.0, 1.02),
                          st.integers(2, 40)), min_size=1, max_size=12))
def test_best_first_is_a_permutation_led_by_a_near_best(items):
    plan = lambda x: Plan(h2d_chunk_mib=x[0], d2h_chunk_mib=x[0], window_slots=x[2])  # noqa: E731
    order = best_first(items, lambda x: x[1], plan)
    assert sorted(order) == sorted(items)
    best = min(x[1] for x in items)
    assert order[0][1] <= best * (1 + TIE_REL)
    assert order[0][0] == max(x[0] for x in items if x[1] <= best * (1 + TIE_REL))


def _dropped_mix_report(measured_taus: set[str]) -> PolicyReport:
    """One finalist whose MILP mix (`sac` on the last 2 of 4 layers) the whole-plan simulation
    dropped; its all-`layer` route measured 1.0 s."""
    route = Plan(layer_policies=("layer",) * 4)
    a = ActivationChoice(route, 1.0, {"layer": 0.25, "sac": 0.24}, {"layer": 1.0, "sac": 2.0},
                         1e9, 1.0, "host-bound", [],
                         dropped=replace(route, layer_policies=("layer", "layer", "sac", "sac")),
                         dropped_s=1.01)
    return PolicyReport(cap_bytes=GIB, n_layers=4, base_window=3, probe_device="fake",
                        finalists=[Finalist(Scored(route, 1.0, 1.0, 1.0), a)],
                        measured_taus=measured_taus)


@pytest.mark.parametrize("mix_s, kept", [(0.9, True), (1.1, False), (1.0, False), (0.996, False)])
def test_a_dropped_mix_with_a_measured_saving_is_probed_and_the_probe_decides(mix_s, kept):
    """The whole-plan simulation dropped the mix while the probes measured a saving for `sac`:
    the mix is probed against its measured all-`layer` route and taken only if faster beyond a
    tie (routes.TIE_REL: the simulator saw no gain); the report's lines follow the plan."""
    rep, probed = _dropped_mix_report({"sac"}), []

    def probe(plan):
        probed.append(plan)
        return mix_s

    auto._probe_mix(probe, rep, deadline=None, longest=0.0)
    assert probed == [rep.chosen.activations.dropped]
    assert rep.chosen.plan_measured_s == mix_s
    assert rep.chosen.plan.layer_policies == (("layer", "layer", "sac", "sac") if kept
                                              else ("layer",) * 4)
    lines = rep.lines()
    line = next(x for x in lines if x.startswith("policy mix the whole-plan simulation"))
    assert "(layer x2, sac x2)" in line and "(simulated 1.01 s)" in line
    assert ("taken: the probe overturned the simulation" in line) == kept
    sac = next(x for x in lines if x.lstrip().startswith("sac "))
    assert sac.endswith(f"chosen for {2 if kept else 0} layers")
    assert any(x.startswith("policy mix: 1.01 s/step") and "taken by the probe" in x
               for x in lines) == kept


def test_a_dropped_mix_is_probed_only_on_a_measured_saving_and_within_the_limit():
    """No measured cost of its policies: the simulator's drop stands, nothing probed; measured
    but past the time limit: not probed, and the report says so."""
    def probe(plan):
        raise AssertionError("not to be probed")

    rep = _dropped_mix_report(set())
    assert not auto._probe_mix(probe, rep, deadline=None, longest=0.0)
    assert rep.chosen.plan.layer_policies == ("layer",) * 4 and not rep.notes
    rep = _dropped_mix_report({"sac"})
    rep.chosen.activations.taus_s["sac"] = 0.26  # measured, but costlier than `layer`
    assert not auto._probe_mix(probe, rep, deadline=None, longest=0.0)
    rep = _dropped_mix_report({"sac"})
    assert not auto._probe_mix(probe, rep, deadline=time.perf_counter() + 1.0, longest=5.0)
    assert rep.chosen.plan.layer_policies == ("layer",) * 4
    assert rep.notes == ["the policy mix the whole-plan simulation dropped was not probed: the "
                         "selection's time limit (the longest probe so far would end past it; "
                         "kept as the simulator chose it)"]


@pytest.mark.parametrize("mix_s, taken", [(0.8, True), (0.9, False)])
def test_auto_plan_probes_the_dropped_mix_of_the_measured_fastest_route(mix_s, taken):
    """End to end: `sac` measured far cheaper than `layer` (calibrate), every other policy
    costlier; with half the activations offloaded the whole plan of `sac` on every layer
    simulates slower than all `layer` at window 3, so the simulation drops it there; the probes
    measure window 3 / 256 MiB fastest, then its dropped mix, which is taken only if faster."""
    hw = load_hardware("h200x1")
    wl = Workload(load_model("qwen3-1.7b"), 8192, 2, 1, 1)
    base = replace(default_plan(hw.fabric.kind), offload_ratio=0.5)
    chosen_route = (3, 256.0)
    probed = []

    def probe(plan):
        probed.append(plan)
        if set(plan.layer_policies) - {"layer"}:
            return mix_s
        return 0.9 if (plan.window_slots, plan.h2d_chunk_mib) == chosen_route else 1.0

    plan, rep = auto_plan(hw, wl, 40 * GIB, base=base, probe=probe, probe_device="fake",
                          calibrate=lambda ref, name: -0.01 if name == "sac" else 0.01,
                          sim_workers=1)
    c = rep.chosen
    assert (c.route.plan.window_slots, c.route.plan.h2d_chunk_mib) == chosen_route
    assert c.activations.counts == {"layer": wl.model.n_layers}  # the simulation dropped it
    assert c.activations.dropped.layer_policies == ("sac",) * wl.model.n_layers
    assert probed[-1] == c.activations.dropped and c.plan_measured_s == mix_s
    assert plan.layer_policies == (("sac",) if taken else ("layer",)) * wl.model.n_layers
    assert any(("taken: the probe overturned" in x) == taken
               and x.startswith("policy mix the whole-plan simulation dropped (sac x28)")
               for x in rep.lines())


def _unpriced_finalist(taus_ms: dict[str, float]) -> tuple[Finalist, list[PolicyProfile]]:
    """4 layers, a budget of 16 bytes; policies (retained bytes per layer, recompute fraction,
    transient bytes): layer (1, 1.0, 0), p1 (2, 0.6, 0), p2 (3, 0.5, 0: above the chord p1-p3,
    off the hull), p3 (3.5, 0.05, 3: retains 14 on 4 layers, but its transient makes it 17),
    p4 (3.6, 0.04, 0: 14.4), p5 (8, 0.0, 0: 32)."""
    shape = {"layer": (1, 1.0, 0), "p1": (2, 0.6, 0), "p2": (3, 0.5, 0), "p3": (3.5, 0.05, 3),
             "p4": (3.6, 0.04, 0), "p5": (8, 0.0, 0)}
    profiles = [PolicyProfile(n, b, tr, rc) for n, (b, rc, tr) in shape.items()]
    data = [PolicyData(n, 0.25, b, tr, 0.0) for n, (b, _, tr) in shape.items()]
    route = Plan(layer_policies=("layer",) * 4)
    a = ActivationChoice(route, 1.0, {n: 0.25 + taus_ms.get(n, 0.0) / 1e3 for n in shape},
                         {d.name: d.retained_bytes for d in data}, 16.0, 1.0, "host-bound", [],
                         uniform_bytes={d.name: memory_bytes([d], [4]) for d in data})
    return Finalist(Scored(route, 1.0, 1.0, 1.0), a), profiles


def test_the_unpriced_case_and_the_hull_policies_probed_in_it(monkeypatch):
    """Priced: some simulated tau_j more than UNPRICED_S below `layer`'s (one priced above counts
    as unpriced). The policies probed where nothing is priced: the hull's whose every-layer plan
    fits by the MILP's constraint (5), transient included, least recompute first, at most
    UNPRICED_POLICIES."""
    monkeypatch.undo()  # the real _priced_none (the module's fixture stubs it)
    best, profiles = _unpriced_finalist({"p1": -0.05, "p2": 5.0})
    assert auto._priced_none(best, profiles)
    assert auto._hull_fitting(best, profiles) == ["p4", "p1"][:auto.UNPRICED_POLICIES]
    best, profiles = _unpriced_finalist({"p2": -0.5})
    assert not auto._priced_none(best, profiles)


def _unpriced_selection(monkeypatch, probe_s, limit_s=None, step_s=0.0):
    """auto_plan on the tiny model with nothing priced and seg:0b0000000, then `sac`, as the
    hull policies to probe (neither in any finalist's mix); `probe_s`: measured seconds by the
    set of policies a plan holds, 1.0 for the rest; each probe advances a fake clock by
    `step_s`. (plan, report, plans probed, policies calibrated)."""
    monkeypatch.setattr(auto, "_priced_none", lambda finalist, profiles: True)
    monkeypatch.setattr(auto, "_hull_fitting", lambda finalist, profiles: ["seg:0b0000000", "sac"])
    now = [0.0]
    if step_s:
        monkeypatch.setattr(auto, "time", SimpleNamespace(perf_counter=lambda: now[0]))
    probed: list[Plan] = []
    calls: list[str] = []

    def probe(plan):
        probed.append(plan)
        now[0] += step_s
        return probe_s.get(frozenset(plan.layer_policies) - {"layer"}, 1.0)

    hw, wl = _tiny()
    plan, rep = auto_plan(hw, wl, 40 * GIB, sim_workers=1, probe=probe, probe_device="fake",
                          calibrate=lambda ref, name: calls.append(name) or 0.0,
                          time_limit_s=limit_s)
    return plan, rep, probed, calls


def test_where_no_policy_is_priced_whole_plans_are_probed_instead_of_per_layer_costs(monkeypatch):
    """Nothing is measured per layer; after the route probes the chosen route is probed with
    every layer on seg:0b0000000, then on `sac`, then with the MILP's mix; the
    fastest beyond a tie is taken, and the report says which was taken, which was beaten and
    which was not faster; the MILP's mix, not faster, is not kept."""
    one, two = frozenset({"seg:0b0000000"}), frozenset({"sac"})
    plan, rep, probed, calls = _unpriced_selection(monkeypatch, {one: 0.9, two: 0.85})
    L = _tiny()[1].model.n_layers
    c = rep.chosen
    assert not calls and any("nothing is measured per layer" in n for n in rep.notes)
    mix = c.activations.plan
    assert set(mix.layer_policies) != {"layer"}  # the tiny model's MILP chooses a mix
    expected = [replace(c.route.plan, layer_policies=(p,) * L) for p in ("seg:0b0000000", "sac")]
    assert probed[-3:] == [*expected, mix]
    assert plan.layer_policies == ("sac",) * L
    lines = rep.lines()
    assert ("every layer on `seg:0b0000000` measured 0.9 s/step on fake, against 1 s: faster, "
            "then beaten by a later probe") in lines
    assert "every layer on `sac` measured 0.85 s/step on fake, against 0.9 s: taken" in lines
    assert ("the MILP's policy mix measured 1 s/step on fake, against 0.85 s: not faster "
            "beyond a tie") in lines
    assert any(x.startswith("policy mix: every layer on `sac`, taken by its probe") for x in lines)
    assert "probes of whole plans" in rep.stages_s and "probe of the chosen mix" not in rep.stages_s


def test_a_whole_plan_within_the_tie_leaves_every_layer_on_layer(monkeypatch):
    plan, rep, _, _ = _unpriced_selection(monkeypatch, {frozenset({"sac"}): 0.996})
    assert set(plan.layer_policies) == {"layer"}
    assert ("every layer on `sac` measured 0.996 s/step on fake, against 1 s: not faster beyond "
            "a tie") in rep.lines()


def test_the_route_probes_keep_time_for_the_whole_plans(monkeypatch):
    """On a fake clock where the simulated stages take no time and a probe 10 s, with a limit of
    35 s: the first finalist is probed (ends at 10 s); a second would need room for itself and
    the two whole plans (40 s), so it is not; the two whole plans are (20, 30 s); the MILP's
    mix no longer fits (40 s), is left out and not kept."""
    plan, rep, probed, _ = _unpriced_selection(
        monkeypatch, {frozenset({"sac"}): 0.8}, limit_s=35.0, step_s=10.0)
    assert len(probed) == 3 and len(rep.finalists) == 1
    assert any(n.startswith("finalist") and "time limit" in n for n in rep.notes)
    assert set(rep.chosen.activations.plan.layer_policies) != {"layer"}  # the MILP's mix
    assert "the MILP's policy mix was not probed: the selection's time limit" in rep.notes
    assert set(plan.layer_policies) == {"sac"} and rep.selection_s <= 35.0


def test_whole_plans_need_a_measured_route_and_report_refusals():
    """_probe_unpriced: nothing to compare with (the route unmeasured): nothing probed, and the
    report says why; a refused plan is reported and not taken."""
    def refuse(plan):
        return None

    plans = [Plan(layer_policies=(p,) * 4) for p in ("sac", "none")]
    rep = _dropped_mix_report(set())
    rep.chosen.route = replace(rep.chosen.route, measured_s=None)
    assert not auto._probe_unpriced(refuse, rep, plans, deadline=None, longest=0.0)
    assert rep.notes == ["no whole plan probed: no route was measured to compare it with"]
    rep = _dropped_mix_report(set())
    assert auto._probe_unpriced(refuse, rep, plans[:1], deadline=None, longest=0.0)
    assert rep.chosen.unpriced_taken is None and rep.chosen.plan.layer_policies == ("layer",) * 4
    assert "every layer on `sac`: the probe refused it (see `probe refused`)" in rep.lines()
