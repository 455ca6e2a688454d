"""AutoPolicy: choose routes, chunk sizes, the window and per-layer activation policies for a GPU
memory cap.

auto_plan(hardware, workload, cap_bytes) -> (Plan, PolicyReport), method.md section 7 with the
simulator ranking in seconds and real probes spent only on confirming the finalists:
  1-2  routes.rank: route x chunk x update-sharding x window candidates, analytic pre-filter,
       simulated ranking.
       Finalists: the best route for each window size and for each chunk size.
  3-4  activations.shortlist + marginal_costs: model-costed policies (only those `runs_policy`
       accepts, e.g. the ones the executor runs, when given), tau_j by simulation.
  5-6  per finalist, milp.solve on the memory its route and window leave, activations.place:
       a bigger window trades activation memory for fewer uploads, decided on whole plans.
       With `calibrate` (policy/probe.py: a reduced real pipeline, bounded by one layer's
       profile), the policies the finalists' MILPs chose (kept or dropped in step 7) get
       measured tau_j and the MILPs are solved again, for at most CALIBRATION_ROUNDS rounds (a
       round measures only policies newly chosen): real runs go to the policies that can
       matter, not the whole shortlist. With a time limit, a policy's calibration starts only
       where, at the longest calibration so far, it ends within CALIBRATION_SHARE of the limit:
       the rest is kept for the probes, which come after (on nvidia-h200 the calibrations took
       15-22 s and the probes 30 s of a 56-67 s selection); a policy left out keeps
       its simulated tau_j, and the report says so. With probes, where the simulator prices no
       policy on the best simulated finalist (host-bound), nothing is measured per layer: the
       MILP's pick among equal costs says nothing then, and per-layer savings do not add up on
       such a step (_priced_none); whole plans are probed instead (below). The simulations of these
       stages (tens of plans, ~0.2 s each at 8B) run several at once in worker processes
       (sim/batch.py StepTimes).
  7    model/memory.py check_fits on the whole plan under the cap; on failure re-solve with a
       budget tightened by BUDGET_TIGHTEN per try, at most MAX_RESOLVES times; then fall back to
       the conservative plan: every layer `layer`, offload ratio raised through OFFLOAD_STEPS
       until it fits, or InfeasiblePlan (it cannot fit the cap at all). A mix whose whole plan
       simulates no faster than all `layer` on its route (an offload ratio above 0 can make the
       summed per-layer savings positive and the whole plan slower; a step the simulator calls
       host-bound credits no GPU saving) is dropped for all `layer`, and kept for a probe.
  Choice: the finalist with the smallest route step minus activation saving (the smaller of the
  MILP's sum and the whole plan simulated with its policies, ActivationChoice.saving_s;
  simulated: within routes.TIE_REL of it, the largest chunks, routes.best_first); with `probe`
  (Plan -> measured s/step on this device, policy/probe.py) the finalists' routes are measured,
  best simulated first, as long as the selection's time limit allows (the unmeasured ones leave
  the choice), the measured step replaces the simulated one, and the chosen finalist's policy mix
  is measured too (_probe_mix) when the longest probe so far still ends within the limit and the
  executor runs it: the MILP's mix, or the one step 7 dropped where a policy of it has a measured
  tau_j (the measured per-layer costs and the whole-plan simulation disagree: the probe decides).
  Measured slower than its all-`layer` route, the mix is rejected and every layer kept on
  `layer`; a dropped mix measured faster is taken. Where nothing is priced, instead of the mix
  probe, the chosen route is probed with every layer on each of up to UNPRICED_POLICIES hull
  policies that fit (those that would save the most GPU time; _hull_fitting), then with the
  MILP's mix, and the fastest beyond a tie is taken (_probe_unpriced; the route probes keep time
  for these). The report says whether the probes confirmed or overturned the simulator's choice.
A probe with a prepare() method (policy/probe.py) is asked to start building what it runs on
once the route ranking has found a plan that fits, so that the build overlaps the simulated
stages.
The cap is applied by lowering the hardware's HBM size to min(HBM, cap) for every check.
The fields named in `fixed` (routes.FIXABLE: the options a user gave) keep the base plan's value
through every stage; AutoPolicy chooses the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace

from slidedp.model.memory import check_fits, gpu_footprint
from slidedp.policy.activations import (
    Calibrate,
    PolicyProfile,
    lower_hull,
    marginal_costs,
    marginal_plans,
    pareto_front,
    place,
    profile_policies,
    shortlist,
)
from slidedp.policy.milp import PolicyData, memory_bytes, solve
from slidedp.policy.report import GIB, ActivationChoice, Finalist, PolicyReport
from slidedp.policy.routes import (
    FIXABLE,
    TIE_REL,
    Probe,
    Scored,
    best_first,
    candidates,
    fits,
    rank,
    window_candidates,
)
from slidedp.sim.batch import SimSummary, StepTimes
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan, default_plan
from slidedp.spec.workload import Workload

__all__ = ["GIB", "PolicyReport", "auto_plan", "capped"]

MAX_RESOLVES = 3
CALIBRATION_ROUNDS = 2  # measure the policies the MILPs chose, solve again (method.md 7, step 6)
CALIBRATION_SHARE = 0.5  # of the time limit: calibrations end within it, the probes get the rest
UNPRICED_S = 1e-4  # seconds per layer: a simulated saving below this is none (_priced_none)
UNPRICED_POLICIES = 2  # policies probed on every layer where the simulator prices none
BUDGET_TIGHTEN = 0.02  # fraction of the activation budget removed per re-solve
OFFLOAD_STEPS = (0.25, 0.5, 0.75, 1.0)
ACTIVATION_TERMS = ("checkpoints", "reload", "transient")  # the MILP's share of gpu_footprint


def capped(hw: HardwareSpec, cap_bytes: float) -> HardwareSpec:
    """`hw` with its GPU memory lowered to the cap (never raised)."""
    return replace(hw, gpu=replace(hw.gpu, hbm_bytes=min(hw.gpu.hbm_bytes, cap_bytes)))


def activation_budget_bytes(hw: HardwareSpec, wl: Workload, plan: Plan) -> float:
    """B of the MILP: GPU memory minus every non-activation term of gpu_footprint."""
    terms = gpu_footprint(wl, plan)
    return hw.gpu.hbm_bytes - sum(v for k, v in terms.items() if k not in ACTIVATION_TERMS)


def _route_ranking(hw: HardwareSpec, wl: Workload, base: Plan, notes: list[str],
                   sims: StepTimes, fixed: frozenset[str]) -> list[Scored]:
    """Ranked feasible route candidates; raising the offload ratio when none fits at r = 0
    (unless the ratio is fixed)."""
    ratios = (base.offload_ratio,) if "offload_ratio" in fixed else (base.offload_ratio,
                                                                       *OFFLOAD_STEPS)
    for r in ratios:
        b = replace(base, offload_ratio=r)
        windows = window_candidates(hw, wl, b, fixed)
        ranked = rank(hw, wl, candidates(b, wl.gpus, windows, fixed), sims=sims)
        if ranked:
            if r != base.offload_ratio:
                notes.append(f"nothing fits without offload: offload ratio raised to {r:g}")
            return ranked
    # the most conservative plan: check_fits raises InfeasiblePlan naming what overflows
    check_fits(hw, wl, replace(base, offload_ratio=1.0))
    raise InfeasiblePlan("GPU memory per GPU", 0.0, hw.gpu.hbm_bytes, "no route candidate fits")


def _finalist_routes(ranked: list[Scored], sims: StepTimes) -> list[Scored]:
    """The best route of each window size and of each chunk size, all simulated.

    Chunk sizes get their own finalists because the simulator barely tells them apart while the
    executor does: each chunk is a cast, a copy and an update dispatched from Python, whose host
    cost the model leaves out (measured on nvidia-h200-x2, Qwen3-4B mb 4, `sac`: 256 MiB chunks
    6% faster than 64 MiB at window 3; AutoPolicy, probing only its 16 MiB finalists, reached 0.97
    of the best swept plan; benchmarks/RESULTS.md). The probes then decide."""
    out: list[Scored] = []
    for key in (lambda p: p.window_slots, lambda p: p.h2d_chunk_mib):
        picks: dict[float, Scored] = {}
        for s in ranked:
            picks.setdefault(key(s.plan), s)
        out += [s for s in picks.values() if s not in out]
    sims.prefetch([s.plan for s in out if s.simulated_s is None])
    return [s if s.simulated_s is not None else replace(s, simulated_s=sims.step_s(s.plan))
            for s in out]


def _solve_and_place(hw: HardwareSpec, wl: Workload, route: Plan, data: list[PolicyData],
                     budget: float, notes: list[str]) -> Plan | None:
    """MILP + placement, validated on the whole model; re-solved with a tighter budget."""
    retained = {d.name: d.retained_bytes for d in data}
    for attempt in range(MAX_RESOLVES + 1):
        counts = solve(data, wl.model.n_layers, budget * (1 - BUDGET_TIGHTEN * attempt))
        if counts is None:
            notes.append("the MILP found no policy mix within the activation budget")
            return None
        names = {d.name: n for d, n in zip(data, counts, strict=True) if n}
        plan = replace(route, layer_policies=place(names, retained))
        try:
            check_fits(hw, wl, plan)
            return plan
        except InfeasiblePlan as e:
            notes.append(f"re-solving with a tighter budget: {e}")
    return None


def exposure_line(res: SimSummary) -> str:
    """Which resource a simulated step exposes and where the GPU waits, in one line."""
    host, host_s = res.host
    exposed = {k: v for k, v in res.exposed_by_channel_s.items() if v > 0}
    idle = ", ".join(f"{k.lower()} {v:.3f} s" for k, v in sorted(exposed.items(), key=lambda kv: -kv[1]))
    return (f"{'GPU' if res.compute_s >= host_s else 'host'}-bound, compute {res.compute_s:.3f} s "
            f"vs busiest other {host} {host_s:.3f} s per step; GPU idle {idle or 'none'}")


def _exposure(sims: StepTimes, plan: Plan) -> tuple[float, str]:
    """(simulated step, which resource is exposed and where the GPU waits)."""
    res = sims.summary(plan)
    return res.step_time_s, exposure_line(res)


def _activations(hw: HardwareSpec, wl: Workload, routes: list[Plan],
                 profiles: list[PolicyProfile], measured: dict[str, float],
                 sims: StepTimes) -> list[ActivationChoice]:
    """Steps 3-7 on each finalist route (module docstring); every route's marginal-cost plans,
    then every route's whole plan, simulated at once (sims)."""
    L, names = wl.model.n_layers, [p.name for p in profiles]
    k = max(1, L // 4)
    routes = [replace(r, layer_policies=()) for r in routes]
    sims.prefetch([p for r in routes for p in marginal_plans(r, L, names, k, measured)])
    staged = []
    for route in routes:
        notes: list[str] = []
        t0, taus = marginal_costs(hw, wl, route, names, k, measured, sims)
        tok, tok_mb, r = wl.tokens_per_gpu_step, wl.tokens_per_micro_batch, route.offload_ratio
        data = [
            PolicyData(p.name, taus[p.name], (1 - r) * tok * p.retained_bytes_per_token,
                       tok_mb * p.transient_bytes_per_token,
                       route.reload_ahead_layers * r * tok * p.retained_bytes_per_token)
            for p in profiles
        ]
        budget = activation_budget_bytes(hw, wl, route)
        plan = _solve_and_place(hw, wl, route, data, budget, notes)
        if plan is None:
            notes.append("fell back to the conservative plan: every layer `layer`")
            plan = replace(route, layer_policies=("layer",) * L)
        staged.append((route, t0, taus, data, budget, plan, notes))
    sims.prefetch([plan for _, _, _, _, _, plan, _ in staged])
    out = []
    for route, t0, taus, data, budget, plan, notes in staged:
        final_s, exposure = _exposure(sims, plan)
        dropped, dropped_s = None, None
        if final_s >= t0 and set(plan.layer_policies) != {"layer"}:
            notes.append(f"the MILP's mix simulated {final_s:.4g} s as a whole plan, no faster "
                         f"than all `layer` ({t0:.4g} s): dropped for all `layer` (a real probe "
                         "measures it where a policy of it has a measured saving)")
            dropped, dropped_s = plan, final_s
            plan = replace(route, layer_policies=("layer",) * L)
            final_s, exposure = _exposure(sims, plan)
        out.append(ActivationChoice(plan, t0, taus, {d.name: d.retained_bytes for d in data},
                                    budget, final_s, exposure, notes, dropped, dropped_s,
                                    {d.name: memory_bytes([d], [L]) for d in data}))
    return out


def _priced_none(finalist: Finalist, profiles: list[PolicyProfile]) -> bool:
    """Whether the simulator credits no policy a saving on `finalist` (a step it calls
    host-bound: no simulated tau_j more than UNPRICED_S below `layer`'s). The MILP is then
    indifferent and its pick says nothing, and per-layer costs measured in the reduced pipeline
    do not add up either: on Qwen3-8B mb 4 on nvidia-h200 the MILP's indifferent pick,
    seg:0b1101110, measured 4% slower as a whole plan and `sac`, never measured, 2% faster;
    measured per layer, they saved 13.1 and 9.6 ms a layer, the MILP took
    seg:0b1101110 again, and its whole plan was again no faster. A reduced-pipeline measurement
    at that size costs as much as a whole-plan probe (~10 s): whole plans are probed instead
    (_hull_fitting, _probe_unpriced)."""
    a = finalist.activations
    return not any(a.taus_s[p.name] < a.taus_s["layer"] - UNPRICED_S for p in profiles)


def _hull_fitting(finalist: Finalist, profiles: list[PolicyProfile]) -> list[str]:
    """The policies worth probing on every layer where nothing is priced: those that would save
    the most GPU time should the simulator's host-bound verdict be wrong within its error, i.e.
    the lower convex hull's (activations.lower_hull) whose every-layer plan fits `finalist`'s
    activation budget (the MILP's constraint 5: retained, transient and reload bytes), least
    recompute first, at most UNPRICED_POLICIES."""
    a = finalist.activations
    fitting = [p for p in lower_hull(pareto_front(profiles)) if p.name != "layer"
               and a.uniform_bytes[p.name] <= a.budget_bytes]
    return [p.name for p in sorted(fitting, key=lambda p: p.recompute_fraction)][:UNPRICED_POLICIES]


def _simulated_first(finalists: list[Finalist]) -> list[Finalist]:
    """Best simulated first; a tie goes to the larger chunks (routes.best_first)."""
    return best_first(finalists, lambda f: f.simulated_score_s, lambda f: f.route.plan)


def _calibrated(calibrate: Calibrate, reference: Plan, names: list[str], notes: list[str],
                until: float | None, longest: float,
                setup_s: Callable[[], float]) -> tuple[dict[str, float], float]:
    """Measured marginal seconds per layer over `layer` for `names`, where the probe gives one;
    with `until` (time.perf_counter() seconds), a calibration starts only where one as long as
    the longest so far (`longest` seconds, from earlier rounds too; the probe's one-off setup,
    `setup_s()` so far, left out as in _confirm) still ends by then. (The measured costs, the
    longest calibration's seconds.)"""
    out, late = {}, []
    for n in names:
        if until is not None and time.perf_counter() + longest > until:
            late.append(n)
            continue
        t, setup = time.perf_counter(), setup_s()
        d = calibrate(reference, n)
        longest = max(longest, time.perf_counter() - t - (setup_s() - setup))
        if d is not None:
            out[n] = d
    refused = [n for n in names if n not in out and n not in late]
    if refused:
        notes.append(f"tau_j simulated, not measured, for {', '.join(refused)}: the probe did not "
                     "measure them (a policy the executor does not run, or a refused run)")
    if late:
        notes.append(f"tau_j simulated, not measured, for {', '.join(late)}: the calibrations "
                     f"keep within {CALIBRATION_SHARE:.0%} of the selection's time limit, the "
                     "rest is the probes'")
    return out, longest


def _setup_s(probe: Probe) -> float:
    """The probe's one-off setup seconds so far (its `setup_s`; 0 for a probe without one)."""
    return getattr(probe, "setup_s", 0.0)


def _confirm(probe: Probe, finalists: list[Finalist], notes: list[str],
             deadline: float | None, after: int = 1) -> tuple[list[Finalist], int, float]:
    """Measure the finalists' routes (all `layer`) in the order given (best simulated first);
    (those kept, probes run, the longest probe's seconds). Those the executor refuses are
    dropped while any was measured. With a deadline
    (time.perf_counter() seconds), a probe starts only while the selection can still end in
    time: the longest probe so far, for this one and for the `after` probes that follow (the
    chosen mix's, or the whole plans of _probe_unpriced), fits before it; until a finalist has
    been measured, probes always run. A probe's one-off setup (building the host
    state, or waiting for its background build: the probe's `setup_s`, where it has one) does
    not count as its cost.
    Finalists left unprobed leave the choice, and the report says so."""
    out, longest = [], 0.0
    for f in finalists:
        measured_any = any(x.route.measured_s is not None for x in out)
        if deadline is not None and measured_any and (
                time.perf_counter() + (1 + after) * longest > deadline):
            notes.append(f"finalist {f.label()} not probed: the selection's time limit")
            continue
        t, setup = time.perf_counter(), _setup_s(probe)
        out.append(replace(f, route=replace(f.route, measured_s=probe(f.route.plan))))
        longest = max(longest, time.perf_counter() - t - (_setup_s(probe) - setup))
    kept = [f for f in out if f.route.measured_s is not None]
    for f in out:
        if f.route.measured_s is None:
            notes.append(f"finalist {f.label()} not measured: the executor refused it"
                         + (" (dropped)" if kept else ""))
    return kept or out, len(out), longest


def auto_plan(
    hardware: HardwareSpec,
    workload: Workload,
    cap_bytes: float,
    *,
    base: Plan | None = None,
    probe: Probe | None = None,
    probe_device: str | None = None,
    calibrate: Calibrate | None = None,
    runs_policy: Callable[[str], bool] | None = None,
    time_limit_s: float | None = None,
    sim_workers: int | None = None,
    fixed: frozenset[str] = frozenset(),
) -> tuple[Plan, PolicyReport]:
    """The plan AutoPolicy chooses under `cap_bytes` of GPU memory per GPU, and its report.

    base: the fields AutoPolicy does not choose (default: default_plan of the fabric);
    fixed: chosen fields that keep base's value instead (routes.FIXABLE: the options a user gave);
    probe / probe_device: real probes and where they run; calibrate: measured tau_j;
    runs_policy: the activation policies allowed (default: every policy of spec/segments.py);
    time_limit_s: the probes stop where the next would end the selection past it (_confirm;
    the simulated stages and the measured policy costs always run: seconds);
    sim_workers: processes simulating at once (sim/batch.py; default default_workers())."""
    start = time.perf_counter()
    hw = capped(hardware, cap_bytes)
    with StepTimes(hw, workload, sim_workers) as sims:
        return _auto_plan(hw, workload, cap_bytes, sims, start, base, probe, probe_device,
                          calibrate, runs_policy, time_limit_s, fixed)


def _auto_plan(hw: HardwareSpec, wl: Workload, cap_bytes: float, sims: StepTimes, start: float,
               base: Plan | None, probe: Probe | None, probe_device: str | None,
               calibrate: Calibrate | None, runs_policy: Callable[[str], bool] | None,
               time_limit_s: float | None, fixed: frozenset[str]) -> tuple[Plan, PolicyReport]:
    """auto_plan's stages on the capped hardware (module docstring)."""
    deadline = None if time_limit_s is None else start + time_limit_s
    base = replace(base or default_plan(hw.fabric.kind), layer_policies=())
    rep = PolicyReport(cap_bytes=min(cap_bytes, hw.gpu.hbm_bytes),
                       n_layers=wl.model.n_layers, base_window=base.window_slots,
                       probe_device=probe_device if probe is not None else None)
    try:
        rep.default_route_s = simulate(hw, wl, base).step_time_s  # checks the fit first
    except InfeasiblePlan:
        rep.notes.append("the default plan does not fit the cap")
    if set(fixed) - set(FIXABLE):
        raise ValueError(f"fixed: fields of {FIXABLE}, got {sorted(fixed)}")
    if fixed:
        rep.notes.append("kept as given: " + ", ".join(f for f in FIXABLE if f in fixed))
    rep.routes = _route_ranking(hw, wl, base, rep.notes, sims, frozenset(fixed))
    if probe is not None and hasattr(probe, "prepare"):  # a plan fits: build what probes run on
        probe.prepare()
    routes = _finalist_routes(rep.routes, sims)
    lap = rep.stage_timer(start)
    lap("route ranking")

    allowed = [p for p in profile_policies(hw, wl)
               if p.name == "layer" or runs_policy is None or runs_policy(p.name)]
    profiles = shortlist(allowed)
    if runs_policy is not None and len(allowed) < len(profile_policies(hw, wl)):
        rep.notes.append(f"activation policies limited to those the executor runs: "
                         f"{', '.join(p.name for p in profiles)} (of the shortlist)")
    measured: dict[str, float] = {}

    def solved() -> list[Finalist]:  # every finalist route's MILP on the tau_j known so far
        choices = _activations(hw, wl, [s.plan for s in routes], profiles, measured, sims)
        return [Finalist(s, a) for s, a in zip(routes, choices, strict=True)]

    finalists = solved()
    lap("activation MILPs")
    unpriced = probe is not None and _priced_none(_simulated_first(finalists)[0], profiles)
    if unpriced:
        rep.notes.append("the simulator prices no activation policy on the best finalist (a "
                         "step it calls host-bound): nothing is measured per layer, whole plans "
                         "are probed instead")
    tried: set[str] = set()
    calibrated_by = None if time_limit_s is None else start + CALIBRATION_SHARE * time_limit_s
    longest = 0.0
    for _ in range(CALIBRATION_ROUNDS if calibrate is not None and not unpriced else 0):
        # with probes, a dropped mix's policies too: a probe may take it (_probe_mix)
        picked = sorted({n for f in finalists for n in (
            f.probed_mix.layer_policies if probe is not None else f.activations.counts)}
            - {"layer"} - tried)
        if not picked:
            break
        tried.update(picked)
        costs, longest = _calibrated(calibrate, routes[0].plan, picked, rep.notes,
                                     calibrated_by, longest,
                                     lambda: _setup_s(probe))
        measured |= costs
        lap("policy costs measured")
        finalists = solved()
        lap("activation MILPs")
    rep.measured_taus = set(measured)
    sims.close()  # the simulated stages are over: no idle workers beside the probes
    finalists = _simulated_first(finalists)
    simulated_best = finalists[0].route.plan
    longest = 0.0  # the longest probe, from here on
    if probe is not None:  # time kept for the probes after these: the mix's, or the whole plans'
        after = UNPRICED_POLICIES if unpriced else 1
        finalists, probed, longest = _confirm(probe, finalists, rep.notes, deadline, after)
        lap(f"probes of {probed} of {len(routes)} finalists")
    rep.simulator_pick = next((f for f in finalists if f.route.plan == simulated_best), None)
    if probe is None:  # simulated scores: a tie goes to the larger chunks (routes.best_first)
        rep.finalists = best_first(finalists, lambda f: f.score_s, lambda f: f.route.plan)
    else:  # measured: the fastest
        rep.finalists = sorted(finalists, key=lambda f: (f.score_s, f.route.plan.window_slots))
    if unpriced:
        route = rep.chosen.route.plan
        plans = [replace(route, layer_policies=(n,) * wl.model.n_layers)
                 for n in _hull_fitting(rep.chosen, profiles)]
        if _probe_unpriced(probe, rep, [q for q in plans if fits(hw, wl, q)], deadline, longest):
            lap("probes of whole plans")
    elif probe is not None and _probe_mix(probe, rep, deadline, longest):
        lap("probe of the chosen mix")
    rep.selection_s = time.perf_counter() - start
    return rep.chosen.plan, rep


def _probe_unpriced(probe: Probe, rep: PolicyReport, plans: list[Plan],
                    deadline: float | None, longest: float) -> bool:
    """Where the simulator prices no policy (_priced_none): measure the chosen finalist's route
    with every layer on one policy, for each of `plans` in order (_hull_fitting), then the
    MILP's mix where it is not all `layer` and not one of those; each only where the longest
    probe so far still ends within the deadline. A plan faster beyond a tie (routes.TIE_REL)
    than the best measured so far (the all-`layer` route, an earlier plan of these) is taken;
    the MILP's mix, priced by nothing, is kept only so (else every layer on `layer`). The
    report says what each probe measured and what was left out. Whether it ran a probe."""
    c = rep.chosen
    mix = c.activations.plan
    candidates = plans + ([mix] if set(mix.layer_policies) != {"layer"} and mix not in plans
                          else [])
    if c.route.measured_s is None or not candidates:
        rep.notes.append("no whole plan probed: " + (
            "no route was measured to compare it with" if c.route.measured_s is None
            else "no hull policy fits on every layer"))
        c.activations_rejected = mix in candidates
        return False
    best_s, ran = c.route.measured_s, False
    for plan in candidates:
        label = (f"every layer on `{plan.layer_policies[0]}`" if plan is not mix
                 else "the MILP's policy mix")
        if deadline is not None and time.perf_counter() + longest > deadline:
            rep.notes.append(f"{label} was not probed: the selection's time limit")
            continue
        t = time.perf_counter()
        measured_s, ran = probe(plan), True
        longest = max(longest, time.perf_counter() - t)
        taken = measured_s is not None and measured_s < best_s * (1 - TIE_REL)
        c.unpriced_probes.append((label, measured_s, best_s, taken))
        if taken:
            c.unpriced_taken, best_s = plan, measured_s
    c.activations_rejected = c.unpriced_taken is not mix
    return ran


def _probe_mix(probe: Probe, rep: PolicyReport, deadline: float | None, longest: float) -> bool:
    """Measure the chosen finalist's policy mix against its measured all-`layer` route: the
    MILP's mix, or the one the whole-plan simulation dropped where the probes measured a saving
    for one of its policies (the measured per-layer costs and the simulator's verdict on the
    whole plan disagree, e.g. a step the simulator calls host-bound within its error: Qwen3-8B mb
    4 on nvidia-h200, where `sac` measured 3.5% faster). Only where the longest probe
    so far still ends within the deadline. Whether it ran a probe."""
    chosen = rep.chosen
    a = chosen.activations
    dropped = a.dropped is not None and any(
        n in rep.measured_taus and a.taus_s[n] < a.taus_s["layer"] for n in a.dropped.layer_policies)
    what = "the policy mix the whole-plan simulation dropped" if dropped else "the chosen policy mix"
    if a.counts == {"layer": rep.n_layers} and not dropped:
        return False
    if chosen.route.measured_s is None:
        rep.notes.append(f"{what} was not probed: no route was measured to compare it with (the "
                         "probe refused them)")
    elif deadline is not None and time.perf_counter() + longest > deadline:
        rep.notes.append(f"{what} was not probed: the selection's time limit (the longest probe "
                         "so far would end past it; kept as the simulator chose it)")
    else:
        chosen.plan_measured_s = probe(chosen.probed_mix)
        if chosen.plan_measured_s is None:
            rep.notes.append(f"{what} itself was not measured: the probe refused it (see `probe "
                             "refused`; its all-`layer` route was measured)")
        else:  # a dropped mix only where faster beyond a tie: the simulator saw no gain
            chosen.activations_rejected = chosen.plan_measured_s > chosen.route.measured_s * (
                1 - TIE_REL if dropped else 1)
        return True
    return False
