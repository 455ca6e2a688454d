"""What AutoPolicy chose and why (policy/auto.py fills it, `slidedp plan` and `train --plan auto`
print it): the route ranking, the finalists (the best route per window size and per chunk size,
each with its own activation MILP), what each choice saved, which resource is exposed, whether
real probes confirmed the choice, and how long selection took (by stage)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from slidedp.policy.routes import Scored
from slidedp.spec.plan import Plan
from slidedp.spec.units import GIB


def _route(p: Plan) -> str:
    """params/grads/update/chunk of a plan's route, as the report names it."""
    return f"{p.param_route}/{p.grad_route}/{p.update_sharding}/{p.h2d_chunk_mib:g} MiB"


@dataclass
class ActivationChoice:
    """Steps 3-7 of AutoPolicy on one route: the MILP's policy mix and what it is worth."""

    plan: Plan  # the route with its per-layer policies
    all_layer_s: float  # T_0: the route, every layer `layer` (simulated)
    taus_s: dict[str, float]
    retained_bytes: dict[str, float]  # m_j per layer
    budget_bytes: float
    final_s: float  # simulated, with the chosen policies
    exposure: str
    notes: list[str] = field(default_factory=list)
    dropped: Plan | None = None  # the MILP's mix, where its whole plan simulated no faster
    dropped_s: float | None = None  # that whole plan, simulated
    # per policy: constraint (5)'s left side with every layer on it (milp.memory_bytes)
    uniform_bytes: dict[str, float] = field(default_factory=dict)

    @staticmethod
    def counts_of(plan: Plan) -> dict[str, int]:
        return {name: plan.layer_policies.count(name) for name in dict.fromkeys(plan.layer_policies)}

    @property
    def counts(self) -> dict[str, int]:
        """Layers per policy in `plan`."""
        return self.counts_of(self.plan)

    @property
    def milp_saving_s(self) -> float:
        """The MILP's saving against all `layer`: sum_j n_j (tau_0 - tau_j), with the measured
        tau_j where probes measured them."""
        tau0 = self.taus_s["layer"]
        return sum(n * (tau0 - self.taus_s[name]) for name, n in self.counts.items())

    @property
    def whole_plan_saving_s(self) -> float:
        """The saving of the whole plan simulated with the chosen policies: all_layer_s - final_s."""
        return self.all_layer_s - self.final_s

    @property
    def saving_s(self) -> float:
        """What the policy mix is taken to save: the smaller of the MILP's sum and the whole-plan
        simulation. The sum adds per-layer costs (measured ones bounded by a layer's own compute
        change) as if nothing else moved; the whole plan shows what the pipeline can absorb: a
        mix that frees GPU time the host then exposes saves less than its layers add up to
        (Qwen3-4B seq 16384 on nvidia-h200: the MILP's sum 0.47 s, the whole plan 0.28 s at
        window 3 and 0.42 s at window 36, where the weights stay resident and the backward
        uploads nothing; measured 2.015 s against 1.877 s; benchmarks/RESULTS.md)."""
        return min(self.milp_saving_s, self.whole_plan_saving_s)


@dataclass
class Finalist:
    """A route that went through the activation stage; probes measure `route.plan` (all
    `layer`, which the executor always runs) and, when it differs, the policy mix (probed_mix)."""

    route: Scored
    activations: ActivationChoice
    plan_measured_s: float | None = None  # probed_mix measured
    activations_rejected: bool = False  # probed_mix measured slower than its all-`layer` route
    # auto._probe_unpriced: (what was probed, measured s or None if refused, the best measured
    # step it was compared with, whether it was taken then), and the plan taken last
    unpriced_probes: list[tuple[str, float | None, float, bool]] = field(default_factory=list)
    unpriced_taken: Plan | None = None

    @property
    def last_taken_probe(self) -> int | None:
        """The index in unpriced_probes of the probe whose plan is unpriced_taken."""
        return max((i for i, x in enumerate(self.unpriced_probes) if x[3]), default=None)

    @property
    def probed_mix(self) -> Plan:
        """The mix a probe measures: the one the whole-plan simulation dropped where there is
        one (auto._probe_mix probes it only where a policy of it has a measured cost), else the
        MILP's."""
        return self.activations.dropped or self.activations.plan

    @property
    def plan(self) -> Plan:
        """The plan this finalist stands for: the route with the MILP's policies, unless the
        probes rejected them (then every layer `layer`); a dropped mix that the probe measured
        faster than all `layer` beyond a tie; where the simulator prices no policy, the plan
        auto._probe_unpriced took (one policy on every layer, or the MILP's mix), else all
        `layer`."""
        if self.unpriced_taken is not None:
            return self.unpriced_taken
        if self.activations_rejected:
            return self.activations.plan.with_overrides(
                layer_policies=("layer",) * len(self.activations.plan.layer_policies))
        return self.probed_mix if self.plan_measured_s is not None else self.activations.plan

    @property
    def simulated_score_s(self) -> float:
        return self.route.simulated_s - self.activations.saving_s

    @property
    def score_s(self) -> float:
        """The route's most trusted step (measured when probed) less the activations' saving."""
        return self.route.best_s - self.activations.saving_s

    def label(self) -> str:
        return f"window {self.route.plan.window_slots}, {_route(self.route.plan)}"


@dataclass
class PolicyReport:
    """Filled by auto_plan; finalists[0] is the choice."""

    cap_bytes: float
    n_layers: int
    base_window: int
    routes: list[Scored] = field(default_factory=list)
    default_route_s: float | None = None  # simulated step of default_plan, None if it does not fit
    finalists: list[Finalist] = field(default_factory=list)
    simulator_pick: Finalist | None = None  # the finalist the simulator alone would choose
    probe_device: str | None = None  # where the real probes ran; None: no probes
    measured_taus: set[str] = field(default_factory=set)
    notes: list[str] = field(default_factory=list)
    selection_s: float = 0.0
    stages_s: dict[str, float] = field(default_factory=dict)  # selection time by stage, in order

    def stage_timer(self, start: float):
        """lap(name): the seconds since the previous lap (or `start`) are added to
        stages_s[name] (a stage run in several rounds sums them)."""
        last = [start]

        def lap(name: str) -> None:
            now = time.perf_counter()
            self.stages_s[name] = self.stages_s.get(name, 0.0) + now - last[0]
            last[0] = now
        return lap

    @property
    def chosen(self) -> Finalist:
        return self.finalists[0]

    def lines(self) -> list[str]:
        c = self.chosen
        a, p = c.activations, c.route.plan
        out = [
            f"GPU memory cap {self.cap_bytes / GIB:.1f} GiB per GPU",
            f"routes: params {p.param_route}, grads {p.grad_route}, update {p.update_sharding}, "
            f"chunks {p.h2d_chunk_mib:g} MiB, window {p.window_slots} slots for "
            f"{self.n_layers} layers (best of {len(self.routes)} feasible candidates; "
            f"simulated {c.route.simulated_s:.4g} s/step)",
        ]
        if self.default_route_s is not None:
            out.append(f"  saves {self.default_route_s - c.route.simulated_s:+.4g} s/step against "
                       f"the default plan ({self.default_route_s:.4g} s, simulated)")
        for s in [s for s in self.routes if s.plan != p][:3]:
            out.append(f"  next: {_route(s.plan)}/window {s.plan.window_slots}  "
                       f"{s.best_s:.4g} s/step")
        measured = self.probe_device is not None
        out.append("finalists (best route per window and per chunk size; step = route "
                   + ("measured" if measured else "simulated") + " - activation saving, the "
                   "smaller of the MILP's sum and the whole plan simulated):")
        for f in self.finalists:
            seen = f" measured {f.route.measured_s:.4g} s," if f.route.measured_s is not None else ""
            out.append(
                f"  {f.label():<42} route {f.route.simulated_s:.4g} s simulated,{seen} "
                f"activations save {f.activations.saving_s:+.4g} s (MILP "
                f"{f.activations.milp_saving_s:+.4g}, whole plan "
                f"{f.activations.whole_plan_saving_s:+.4g}) -> {f.score_s:.4g} s/step"
                + ("  <- chosen" if f is c else ""))
        for f in self.finalists[1:]:
            if f.route.plan.window_slots != p.window_slots:
                out.append(f"  window {p.window_slots} over {f.label()} saves "
                           f"{f.score_s - c.score_s:+.4g} s/step")
        out.append(
            f"activations: budget {a.budget_bytes / GIB:.2f} GiB per GPU after weights, window, "
            f"buffers and runtime; all-`layer` step {a.all_layer_s:.4g} s (simulated)")
        tau0 = a.taus_s.get("layer", 0.0)
        counts = a.counts_of(c.plan)  # what the plan holds, after the probes
        for name, tau in sorted(a.taus_s.items(), key=lambda kv: a.retained_bytes[kv[0]]):
            how = "measured" if name in self.measured_taus else "simulated"
            out.append(
                f"  {name:<15} retains {a.retained_bytes[name] / GIB:6.3f} GiB/layer, saves "
                f"{1e3 * (tau0 - tau):+7.2f} ms/layer vs layer ({how}), chosen for "
                f"{counts.get(name, 0)} layers")
        if c.unpriced_taken is not None:
            label = c.unpriced_probes[c.last_taken_probe][0]
            out.append(f"policy mix: {label}, taken by its probe (the simulator prices no policy "
                       "on this step)")
        elif a.dropped is not None and c.plan == a.dropped:
            out.append(f"policy mix: {a.dropped_s:.4g} s/step simulated as a whole plan, "
                       f"{a.all_layer_s - a.dropped_s:+.4g} s against all-`layer` (dropped by the "
                       "simulation, taken by the probe)")
        else:
            out.append(f"policy mix: {a.final_s:.4g} s/step simulated as a whole plan, "
                       f"{a.whole_plan_saving_s:+.4g} s against all-`layer`")
        out.append(f"exposed: {a.exposure}")
        out += self._probe_lines()
        out += [f"note: {n}" for n in self.notes + a.notes]
        stages = ", ".join(f"{name} {t:.1f} s" for name, t in self.stages_s.items())
        out.append(f"selection took {self.selection_s:.1f} s" + (f" ({stages})" if stages else ""))
        return out

    def _probe_lines(self) -> list[str]:
        if self.probe_device is None:
            return ["not confirmed on hardware: no real probe (slidedp plan --probe)"]
        c, sim = self.chosen, self.simulator_pick
        out = []
        if sim is None or len(self.finalists) < 2:
            out.append(f"probes on {self.probe_device}: one finalist, nothing to confirm against")
        elif sim is c:
            out.append(f"probes on {self.probe_device}: confirmed, the simulator's choice "
                       f"({c.label()}) also measured fastest")
        else:
            out.append(f"probes on {self.probe_device}: overturned the simulator's choice "
                       f"({sim.label()}, {sim.score_s:.4g} s measured) for {c.label()} "
                       f"({c.score_s:.4g} s measured)")
        a = c.activations
        if c.plan_measured_s is not None and a.dropped is not None:
            mix = ", ".join(f"{n} x{k}" for n, k in a.counts_of(a.dropped).items())
            out.append(f"policy mix the whole-plan simulation dropped ({mix}) measured "
                       f"{c.plan_measured_s:.4g} s/step on {self.probe_device} (simulated "
                       f"{a.dropped_s:.4g} s), all-`layer` route {c.route.measured_s:.4g} s: "
                       + ("not faster beyond a tie, every layer kept on `layer`"
                          if c.activations_rejected
                          else "taken: the probe overturned the simulation"))
        elif c.plan_measured_s is not None:
            out.append(f"policy mix measured {c.plan_measured_s:.4g} s/step on {self.probe_device} "
                       f"(simulated {a.final_s:.4g} s), all-`layer` route "
                       f"{c.route.measured_s:.4g} s: "
                       + ("rejected, every layer kept on `layer`" if c.activations_rejected
                          else "kept"))
        last = c.last_taken_probe
        for i, (label, measured_s, against_s, taken) in enumerate(c.unpriced_probes):
            if measured_s is None:
                out.append(f"{label}: the probe refused it (see `probe refused`)")
                continue
            out.append(f"{label} measured {measured_s:.4g} s/step on {self.probe_device}, "
                       f"against {against_s:.4g} s: " + (
                           "taken" if i == last else "faster, then beaten by a later probe"
                           if taken else "not faster beyond a tie"))
        return out
