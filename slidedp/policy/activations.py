"""Activation-policy stages of AutoPolicy (method.md section 7, steps 3, 4 and PlaceLayers).

shortlist()      every policy of spec/segments.py (layer, none, sac, the 128 segment masks),
                 costed by the model (retained bytes, recompute fraction of the forward), reduced
                 to its Pareto front in (retained bytes, recompute time) and then to at most
                 `limit` policies spread over the front by retained bytes (layer and none kept).
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
from slidedp.sim.simulator import simulate
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
    """Pareto front in (retained bytes, recompute fraction), thinned to `limit` by retained bytes."""
    ordered = sorted(profiles, key=lambda p: (p.retained_bytes_per_token, p.recompute_fraction))
    front, best = [], float("inf")
    for p in ordered:  # increasing memory: keep those that recompute strictly less
        if p.recompute_fraction < best - 1e-12:
            front.append(p)
            best = p.recompute_fraction
    if len(front) > limit - 1:
        picks = {round(i * (len(front) - 1) / (limit - 2)) for i in range(limit - 1)}
        front = [p for i, p in enumerate(front) if i in picks]
    reference = next(p for p in profiles if p.name == "layer")  # tau's reference, always costed
    return front if reference in front else [reference, *front]


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
    memo: dict[Plan, float] | None = None,
) -> tuple[float, dict[str, float]]:
    """(T_0, tau_j per policy name) by simulation (module docstring); `reference` is all-layer;
    `measured`: marginal seconds per layer over `layer` measured by real probes, used as is;
    `memo`: simulated steps by plan, kept by a caller that asks again on the same hardware and
    workload (AutoPolicy re-solving after a calibration round), so nothing is simulated twice."""
    L = wl.model.n_layers
    k = max(1, min(L, k_layers))
    measured = measured or {}
    memo = {} if memo is None else memo

    def step_s(plan: Plan) -> float:
        if plan not in memo:
            memo[plan] = simulate(hw, wl, plan, check_memory=False).step_time_s
        return memo[plan]

    t0 = step_s(tail_plan(reference, L, "layer", 0))
    tau0 = t0 / L
    taus = {}
    for name in names:
        if name == "layer":
            taus[name] = tau0
        elif name in measured:
            taus[name] = tau0 + measured[name]
        else:
            taus[name] = tau0 + (step_s(tail_plan(reference, L, name, k)) - t0) / k
    return t0, taus
