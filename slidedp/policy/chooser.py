"""The default chooser: the plan `slidedp train` runs on a GPU when no --plan is given, and the plan
of `slidedp predict` / `simulate --plan auto-sim`.

choose(hw, wl, base, fixed, cap) is AutoPolicy's simulated stages (policy/auto.py: route, chunk
and window ranking, the activation MILP) without probes or calibrations: seconds, deterministic.
  hw      the hardware the simulator prices: for train, this machine's profile
          (commands/default_choice.py); for predict and simulate, --hardware
  base    the documented default plan (spec/plan.py default_plan) with the options given
  fixed   which of routes.FIXABLE those options set: they keep base's value, the search fills in
          the rest (routes.candidates)
The choice is compared with `base` as it stands, every layer on `layer`: the fixed default plan,
simulated on the same hardware. Where the search's plan simulates slower than it beyond a tie
(routes.TIE_REL: the tie goes to larger chunks, which the executor measured faster), the default
plan is kept, and the summary says so. Nothing here is per model: the choice is the simulator's
on the hardware's rates and memory (a different preset gives a different plan where its rates or
its memory differ).
The executor is asked whether it runs a policy (runs_policy, a real engine build each) only for
the policies a choice names; a refused one leaves the search, which runs again without it, rather
than asking about all 130 policies of spec/segments.py up front.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from slidedp.policy.auto import auto_plan, exposure_line
from slidedp.policy.report import ActivationChoice
from slidedp.policy.routes import TIE_REL
from slidedp.sim.batch import summarize
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Plan, parse_plan, plan_dict
from slidedp.spec.workload import Workload

OPTION_OF = {"param_route": "--param-route", "grad_route": "--grad-route",
             "update_sharding": "--update-sharding", "chunk_mib": "--chunk-mib",
             "window_slots": "--window-slots", "offload_ratio": "--offload-ratio"}


def describe_plan(p: Plan) -> str:
    """What the chooser chooses of a plan, in one phrase."""
    counts = ActivationChoice.counts_of(p) or {str(p.activation_policy): None}
    acts = ", ".join(f"{n} x{c}" if c else f"{n} on every layer" for n, c in counts.items())
    chunks = (f"{p.h2d_chunk_mib:g}" if p.h2d_chunk_mib == p.d2h_chunk_mib
              else f"{p.h2d_chunk_mib:g}/{p.d2h_chunk_mib:g}")
    return (f"params {p.param_route}, grads {p.grad_route}, update {p.update_sharding}, chunks "
            f"{chunks} MiB, window {p.window_slots}, offload r={p.offload_ratio:g}, "
            f"activations {acts}")


@dataclass(frozen=True)
class Choice:
    """The chosen plan and why, as the first lines of `slidedp train` say it (summary)."""

    plan: Plan
    chosen_s: float  # the chosen plan's simulated step
    default_s: float | None  # the fixed default plan's simulated step; None: it does not fit
    default_plan: Plan  # base, every layer on `layer`
    exposure: str  # what bounds the chosen plan's step and where the GPU waits (simulated)
    kept_default: bool  # the search found nothing faster beyond a tie
    fixed: tuple[str, ...]  # routes.FIXABLE fields kept as given
    report: tuple[str, ...]  # AutoPolicy's report (policy/report.py lines)
    selection_s: float

    def summary(self, where: str) -> list[str]:
        """The first lines of the output: the plan, the simulated step against the default
        plan's, the bottleneck, the fields kept as given. `where`: whose hardware it priced."""
        head = (f"plan: the default plan, kept by the chooser on {where}" if self.kept_default
                else f"plan: chosen by the simulator on {where}")
        lines = [f"{head}: {describe_plan(self.plan)}"]
        if self.default_s is None:
            lines.append(f"  simulated {self.chosen_s:.4g} s/step; the default plan "
                         f"({describe_plan(self.default_plan)}) does not fit")
        else:
            gain = 1 - self.chosen_s / self.default_s
            lines.append(f"  simulated {self.chosen_s:.4g} s/step against {self.default_s:.4g} s "
                         f"for the default plan ({abs(gain):.1%} "
                         f"{'shorter' if gain >= 0 else 'longer'})"
                         + ("" if self.kept_default else
                            f"; default: {describe_plan(self.default_plan)}"))
        lines.append(f"  {self.exposure}")
        if self.fixed:
            lines.append("  kept as given: " + ", ".join(OPTION_OF[f] for f in self.fixed))
        return lines

    def to_json(self) -> dict:
        return {"plan": plan_dict(self.plan), "chosen_s": self.chosen_s,
                "default_s": self.default_s, "default_plan": plan_dict(self.default_plan),
                "exposure": self.exposure, "kept_default": self.kept_default,
                "fixed": list(self.fixed), "report": list(self.report),
                "selection_s": self.selection_s}

    @staticmethod
    def from_json(d: dict, where: str) -> Choice:
        """A Choice from to_json's dict; KeyError, TypeError or SpecError where it is not one."""
        return Choice(parse_plan({"plan": d["plan"]}, where), float(d["chosen_s"]),
                      None if d["default_s"] is None else float(d["default_s"]),
                      parse_plan({"plan": d["default_plan"]}, where), str(d["exposure"]),
                      bool(d["kept_default"]), tuple(str(f) for f in d["fixed"]),
                      tuple(str(x) for x in d["report"]), float(d["selection_s"]))


def choose(hw: HardwareSpec, wl: Workload, base: Plan, fixed: frozenset[str], cap_bytes: float,
           *, runs_policy: Callable[[str], bool] | None = None,
           sim_workers: int | None = None) -> Choice:
    """The default chooser's plan for (hw, wl) under `cap_bytes` of GPU memory per GPU (module
    docstring); runs_policy: whether the executor runs an activation policy (default: all)."""
    start = time.perf_counter()
    default = replace(base, layer_policies=())
    answers: dict[str, bool] = {}  # the executor's answer per policy, asked once each

    def refused() -> frozenset[str]:
        return frozenset(n for n, ok in answers.items() if not ok)

    while True:  # asking the executor only about the policies a choice names (module docstring)
        no = refused()
        plan, rep = auto_plan(hw, wl, cap_bytes, base=default, sim_workers=sim_workers,
                              runs_policy=(lambda n, r=no: n not in r) if no else None,
                              fixed=fixed)
        if runs_policy is None:
            break
        for n in set(plan.layer_policies) - answers.keys():
            answers[n] = runs_policy(n)
        if refused() == no:
            break
    chosen = rep.chosen.activations
    chosen_s, exposure = chosen.final_s, chosen.exposure
    default_s = rep.default_route_s
    kept = default_s is not None and chosen_s > default_s * (1 + TIE_REL)
    if kept:
        plan, chosen_s = default, default_s
        exposure = exposure_line(summarize(hw, wl, default))
    return Choice(plan, chosen_s, default_s, default, exposure, kept,
                  tuple(f for f in OPTION_OF if f in fixed), tuple(rep.lines()),
                  time.perf_counter() - start)
