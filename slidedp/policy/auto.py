"""AutoPolicy: choose routes, chunk sizes and per-layer activation policies for a GPU memory cap.

auto_plan(hardware, workload, cap_bytes) -> (Plan, PolicyReport), method.md section 7 with the
simulator in place of the published design's 20 minutes of real probes:
  1-2  routes.rank: route x chunk x update-sharding candidates, analytic pre-filter, simulated
       ranking; `probe` (Plan -> measured s/step) is the hook for confirming the best on real
       hardware (not called unless given).
  3-4  activations.shortlist + marginal_costs: model-costed policies, tau_j by simulation.
  5-6  milp.solve on the memory left by the chosen routes, activations.place.
  7    model/memory.py check_fits on the whole plan under the cap; on failure re-solve with a
       budget tightened by BUDGET_TIGHTEN per try, at most MAX_RESOLVES times; then fall back to
       the conservative plan: every layer `layer`, offload ratio raised through OFFLOAD_STEPS
       until it fits, or InfeasiblePlan (it cannot fit the cap at all).
The cap is applied by lowering the hardware's HBM size to min(HBM, cap) for every check.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace

from slidedp.model.memory import check_fits, gpu_footprint
from slidedp.policy.activations import marginal_costs, place, profile_policies, shortlist
from slidedp.policy.milp import PolicyData, solve
from slidedp.policy.routes import Probe, Scored, candidates, rank
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import InfeasiblePlan
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan, default_plan
from slidedp.spec.workload import Workload

GIB = 2**30
MAX_RESOLVES = 3
BUDGET_TIGHTEN = 0.02  # fraction of the activation budget removed per re-solve
OFFLOAD_STEPS = (0.25, 0.5, 0.75, 1.0)
ACTIVATION_TERMS = ("checkpoints", "reload", "transient")  # the MILP's share of gpu_footprint


@dataclass
class PolicyReport:
    """What AutoPolicy chose and why; lines() prints it."""

    cap_bytes: float
    routes: list[Scored] = field(default_factory=list)
    default_route_s: float | None = None  # simulated step of default_plan, None if it does not fit
    all_layer_s: float = 0.0  # T_0: the chosen routes, every layer `layer`
    taus_s: dict[str, float] = field(default_factory=dict)
    retained_bytes: dict[str, float] = field(default_factory=dict)  # m_j per layer
    budget_bytes: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)
    final_s: float = 0.0
    exposure: str = ""
    notes: list[str] = field(default_factory=list)
    selection_s: float = 0.0

    def lines(self) -> list[str]:
        best = self.routes[0]
        p = best.plan
        out = [
            f"GPU memory cap {self.cap_bytes / GIB:.1f} GiB per GPU",
            f"routes: params {p.param_route}, grads {p.grad_route}, update {p.update_sharding}, "
            f"chunks {p.h2d_chunk_mib:g} MiB (best of {len(self.routes)} feasible candidates; "
            f"simulated {best.simulated_s:.3f} s/step)",
        ]
        if self.default_route_s is not None:
            out.append(
                f"  saves {self.default_route_s - best.simulated_s:+.3f} s/step against the "
                f"default plan ({self.default_route_s:.3f} s, simulated)"
            )
        for s in self.routes[1:4]:
            q = s.plan
            out.append(
                f"  next: {q.param_route}/{q.grad_route}/{q.update_sharding}/"
                f"{q.h2d_chunk_mib:g} MiB  {s.best_s:.3f} s/step"
            )
        out.append(
            f"activations: budget {self.budget_bytes / GIB:.2f} GiB per GPU after weights, "
            f"buffers and runtime; all-`layer` step {self.all_layer_s:.3f} s (simulated)"
        )
        tau0 = self.taus_s.get("layer", 0.0)
        for name, tau in sorted(self.taus_s.items(), key=lambda kv: self.retained_bytes[kv[0]]):
            n = self.counts.get(name, 0)
            out.append(
                f"  {name:<15} retains {self.retained_bytes[name] / GIB:6.3f} GiB/layer, "
                f"saves {1e3 * (tau0 - tau):+7.2f} ms/layer vs layer, chosen for {n} layers"
            )
        out.append(
            f"chosen plan: {self.final_s:.3f} s/step simulated, "
            f"{self.all_layer_s - self.final_s:+.3f} s against all-`layer`"
        )
        out.append(f"exposed: {self.exposure}")
        out += [f"note: {n}" for n in self.notes]
        out.append(f"selection took {self.selection_s:.1f} s")
        return out


def capped(hw: HardwareSpec, cap_bytes: float) -> HardwareSpec:
    """`hw` with its GPU memory lowered to the cap (never raised)."""
    return replace(hw, gpu=replace(hw.gpu, hbm_bytes=min(hw.gpu.hbm_bytes, cap_bytes)))


def activation_budget_bytes(hw: HardwareSpec, wl: Workload, plan: Plan) -> float:
    """B of the MILP: GPU memory minus every non-activation term of gpu_footprint."""
    terms = gpu_footprint(wl, plan)
    return hw.gpu.hbm_bytes - sum(v for k, v in terms.items() if k not in ACTIVATION_TERMS)


def _route_ranking(
    hw: HardwareSpec, wl: Workload, base: Plan, probe: Probe | None, notes: list[str]
) -> list[Scored]:
    """Ranked feasible route candidates; raising the offload ratio when none fits at r = 0."""
    for r in (base.offload_ratio, *OFFLOAD_STEPS):
        ranked = rank(hw, wl, candidates(replace(base, offload_ratio=r), wl.gpus), probe=probe)
        if ranked:
            if r != base.offload_ratio:
                notes.append(f"nothing fits without offload: offload ratio raised to {r:g}")
            return ranked
    # the most conservative plan: check_fits raises InfeasiblePlan naming what overflows
    check_fits(hw, wl, replace(base, offload_ratio=1.0))
    raise InfeasiblePlan("GPU memory per GPU", 0.0, hw.gpu.hbm_bytes, "no route candidate fits")


def _solve_and_place(
    hw: HardwareSpec,
    wl: Workload,
    route: Plan,
    data: list[PolicyData],
    budget: float,
    notes: list[str],
) -> Plan | None:
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


def auto_plan(
    hardware: HardwareSpec, workload: Workload, cap_bytes: float, probe: Probe | None = None
) -> tuple[Plan, PolicyReport]:
    """The plan AutoPolicy chooses under `cap_bytes` of GPU memory per GPU, and its report."""
    start = time.perf_counter()
    hw, wl = capped(hardware, cap_bytes), workload
    L = wl.model.n_layers
    rep = PolicyReport(cap_bytes=min(cap_bytes, hardware.gpu.hbm_bytes))
    base = default_plan(hw.fabric.kind)
    try:
        rep.default_route_s = simulate(hw, wl, base).step_time_s  # checks the fit first
    except InfeasiblePlan:
        rep.notes.append("the default plan does not fit the cap")
    rep.routes = _route_ranking(hw, wl, base, probe, rep.notes)
    if probe is None:
        rep.notes.append("not confirmed on hardware: no probe given (routes.rank's `probe` hook)")
    route = replace(rep.routes[0].plan, layer_policies=())

    profiles = shortlist(profile_policies(hw, wl))
    rep.all_layer_s, rep.taus_s = marginal_costs(
        hw, wl, route, [p.name for p in profiles], k_layers=max(1, L // 4)
    )
    tok, tok_mb, r = wl.tokens_per_gpu_step, wl.tokens_per_micro_batch, route.offload_ratio
    data = [
        PolicyData(
            p.name,
            rep.taus_s[p.name],
            (1 - r) * tok * p.retained_bytes_per_token,
            tok_mb * p.transient_bytes_per_token,
            route.reload_ahead_layers * r * tok * p.retained_bytes_per_token,
        )
        for p in profiles
    ]
    rep.retained_bytes = {d.name: d.retained_bytes for d in data}
    rep.budget_bytes = activation_budget_bytes(hw, wl, route)
    plan = _solve_and_place(hw, wl, route, data, rep.budget_bytes, rep.notes)
    if plan is None:
        rep.notes.append("fell back to the conservative plan: every layer `layer`")
        plan = replace(route, layer_policies=("layer",) * L)
    rep.counts = {name: plan.layer_policies.count(name) for name in set(plan.layer_policies)}
    res = simulate(hw, wl, plan)
    rep.final_s = res.step_time_s
    host, host_s = res.host
    exposed = {k: v for k, v in res.exposed_by_channel_s.items() if v > 0}
    rep.exposure = (
        f"{'GPU' if res.compute_s >= host_s else 'host'}-bound, compute "
        f"{res.compute_s:.3f} s vs busiest other {host} {host_s:.3f} s per step; GPU idle "
        + (
            ", ".join(
                f"{k.lower()} {v:.3f} s" for k, v in sorted(exposed.items(), key=lambda kv: -kv[1])
            )
            or "none"
        )
    )
    rep.selection_s = time.perf_counter() - start
    return plan, rep
