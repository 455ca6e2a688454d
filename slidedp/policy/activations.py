"""Activation-policy stages of AutoPolicy (method.md section 7, steps 3, 4 and PlaceLayers).

shortlist()      every policy of spec/segments.py (layer, none, sac, the 128 segment masks),
                 costed by the model (retained bytes, recompute fraction of the forward), reduced
                 to its Pareto front in (retained bytes, recompute time) and then to at most
                 `limit` policies: the front's lower convex hull first (what a mix over layers
                 cannot emulate), then other front points spread by retained bytes (layer kept).
marginal_costs() tau_j per policy with the simulator: replace the k_j tail layers of the
                 all-`layer` reference plan by policy j and
                     tau_j = tau_0 + (T_j(k_j) - T_0) / k_j,   tau_0 = T_0 / L
                 (method.md section 7 step 4; the published design measures T_j on a reduced real
                 pipeline, we simulate the whole one). Where a real probe measured a policy's
                 marginal seconds per layer in a reduced pipeline (Calibrate, policy/probe.py),
                 that replaces the simulated (T_j(k_j) - T_0) / k_j. Memory is not checked here:
                 the MILP does.
place()          counts -> per-layer policies: contiguous blocks ordered by retained bytes, the
                 lightest at the head, the GPU-retained (heaviest) at the decoder's tail, where
                 backward reaches them first and frees them soonest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from slidedp.graph.costs import flops_per_hbm_byte
from slidedp.sim.batch import StepTimes
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan
from slidedp.spec.segments import ALL_KEPT, LayerPolicy, policy_cost, recompute_fraction
from slidedp.spec.workload import Workload

# (all-`layer` reference plan, policy) -> measured seconds per step one layer on `policy` adds
# over `layer`, or None where the executor does not run the policy
Calibrate = Callable[[Plan, str], float | None]


@dataclass(frozen=True)
class PolicyProfile:
    """Model figures of one policy on one layer (per token, and as a fraction of the forward)."""

    name: str
    retained_bytes_per_token: float
    transient_bytes_per_token: float
    recompute_fraction: float


def profile_policies(hw: HardwareSpec, wl: Workload) -> list[PolicyProfile]:
    """Every policy (layer, none, sac, seg masks 0..127) costed by the model."""
    m = wl.model
    k = flops_per_hbm_byte(hw, wl)
    pols = [LayerPolicy("layer"), LayerPolicy("none"), LayerPolicy("sac")]
    pols += [LayerPolicy("seg", mask) for mask in range(ALL_KEPT)]  # ALL_KEPT is none
    out = []
    for p in pols:
        c = policy_cost(m, p, wl.seq_len)
        out.append(
            PolicyProfile(
                p.name, c.retained_bytes, c.transient_bytes, recompute_fraction(m, p, wl.seq_len, k)
            )
        )
    return out


def shortlist(profiles: list[PolicyProfile], limit: int = 6) -> list[PolicyProfile]:
    """`layer` (tau's reference, first) and points of the Pareto front in (retained bytes,
    recompute fraction), `limit` in all at most: the front's lower convex hull first, then the
    other front points spread by their order in retained bytes.

    The hull first because the MILP mixes policies across layers: a front point above the segment
    between its hull neighbours costs more recompute, for its memory, than a mix of those two, so
    it matters only through the counts' integrality; a hull point cannot be emulated (in the
    model's recompute terms: the MILP then prices each policy by its marginal step time).
    Thinning by order alone dropped `sac`, a hull point, from Qwen3-8B mb 4 on nvidia-h200.
    Where the hull has more points than fit, it is thinned by order, ends kept."""
    front = pareto_front(profiles)
    reference = next(p for p in profiles if p.name == "layer")  # tau's reference, always costed
    others = [p for p in front if p is not reference]
    keep = _spread([p for p in lower_hull(front) if p is not reference], limit - 1)
    keep += _spread([p for p in others if p not in keep], limit - 1 - len(keep))
    return [reference, *(p for p in others if p in keep)]


def pareto_front(profiles: list[PolicyProfile]) -> list[PolicyProfile]:
    """The policies no other beats in both retained bytes and recompute, by retained bytes."""
    ordered = sorted(profiles, key=lambda p: (p.retained_bytes_per_token, p.recompute_fraction))
    front, best = [], float("inf")
    for p in ordered:  # increasing memory: keep those that recompute strictly less
        if p.recompute_fraction < best - 1e-12:
            front.append(p)
            best = p.recompute_fraction
    return front


def lower_hull(front: list[PolicyProfile]) -> list[PolicyProfile]:
    """The lower convex hull of a front ordered by retained bytes (monotone chain)."""
    hull: list[PolicyProfile] = []
    for p in front:
        while len(hull) >= 2 and _turn(hull[-2], hull[-1], p) <= 0:
            hull.pop()
        hull.append(p)
    return hull


def _turn(a: PolicyProfile, b: PolicyProfile, c: PolicyProfile) -> float:
    """> 0 where a -> b -> c turns counter-clockwise in (retained bytes, recompute fraction)."""
    return ((b.retained_bytes_per_token - a.retained_bytes_per_token)
            * (c.recompute_fraction - a.recompute_fraction)
            - (b.recompute_fraction - a.recompute_fraction)
            * (c.retained_bytes_per_token - a.retained_bytes_per_token))


def _spread(points: list[PolicyProfile], n: int) -> list[PolicyProfile]:
    """At most n of `points`, evenly spaced by position, both ends kept where n >= 2."""
    if n <= 0:
        return []
    if len(points) <= n:
        return list(points)
    if n == 1:
        return [points[0]]
    picks = {round(i * (len(points) - 1) / (n - 1)) for i in range(n)}
    return [p for i, p in enumerate(points) if i in picks]


def place(counts: dict[str, int], retained_bytes_per_token: dict[str, float]) -> tuple[str, ...]:
    """Per-layer policies (layer 1 first): contiguous blocks, lightest retained memory first."""
    order = sorted(counts, key=lambda name: (retained_bytes_per_token[name], name))
    return tuple(name for name in order for _ in range(counts[name]))


def tail_plan(plan: Plan, n_layers: int, policy: str, k: int) -> Plan:
    """`plan` with its last k layers on `policy`, the others on `layer`."""
    return replace(plan, layer_policies=("layer",) * (n_layers - k) + (policy,) * k)


def marginal_costs(
    hw: HardwareSpec,
    wl: Workload,
    reference: Plan,
    names: list[str],
    k_layers: int,
    measured: dict[str, float] | None = None,
    sims: StepTimes | None = None,
) -> tuple[float, dict[str, float]]:
    """(T_0, tau_j per policy name) by simulation (module docstring); `reference` is all-layer;
    `measured`: marginal seconds per layer over `layer` measured by real probes, used as is;
    `sims`: simulated steps by plan (sim/batch.py), kept by a caller that asks again on the same
    hardware and workload (AutoPolicy re-solving after a calibration round), so nothing is
    simulated twice; the plans of one call are simulated at once where it has worker processes."""
    L = wl.model.n_layers
    k = max(1, min(L, k_layers))
    measured = measured or {}
    sims = (sims or StepTimes(hw, wl, workers=1)).check(hw, wl)
    plans = marginal_plans(reference, L, names, k, measured)
    sims.prefetch(plans)
    t0 = sims.step_s(plans[0])
    tau0 = t0 / L
    taus = {}
    for name in names:
        if name == "layer":
            taus[name] = tau0
        elif name in measured:
            taus[name] = tau0 + measured[name]
        else:
            taus[name] = tau0 + (sims.step_s(tail_plan(reference, L, name, k)) - t0) / k
    return t0, taus


def marginal_plans(reference: Plan, n_layers: int, names: list[str], k: int,
                   measured: dict[str, float]) -> list[Plan]:
    """The plans marginal_costs simulates: all `layer` first, then each policy not measured on
    the last k layers (a caller may simulate several finalists' at once: StepTimes.prefetch)."""
    return [tail_plan(reference, n_layers, "layer", 0)] + [
        tail_plan(reference, n_layers, n, k) for n in names if n != "layer" and n not in measured]
