"""graph/kinds.py's table and machine interface: every kind has one rule, the builder runs each
kind on the agent kind its rule names, and a machine registered ahead of the flat one (what a
host topology does) gets every task's draws, which the bound and the simulator then use."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from strategies import small_plans, small_workloads

from slidedp.graph import build_graph, costs
from slidedp.graph.flat_host import FlatHost
from slidedp.graph.kinds import KINDS, Load, TaskLoad
from slidedp.graph.tasks import AGENT_KINDS, Kind
from slidedp.model.predict import predict
from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload


def test_every_kind_has_one_rule():
    assert list(KINDS) == list(Kind)
    assert all(rule.agent in AGENT_KINDS for rule in KINDS.values())
    cpu = {k for k, r in KINDS.items() if r.load is Load.CPU}
    assert cpu == {Kind.CAST, Kind.ADAM, Kind.HOST_SUM, Kind.UPDATE_CAST}
    assert all(KINDS[k].dram_bytes is not None for k in cpu)


def _agent_kind(name: str) -> str:
    """gpu0.compute -> compute, cpu.update3 -> update, fabric -> fabric."""
    return name.split(".")[-1].rstrip("0123456789")


@settings(max_examples=30, deadline=None)
@given(small_workloads(), small_plans())
def test_tasks_run_on_the_agent_kind_of_their_rule(wl, plan):
    g = build_graph(wl, replace(plan, embedding_rows=bool(wl.gpus % 2)), cores=8, iterations=2)
    agent_kind = [_agent_kind(a) for a in g.agents]
    for v, k in enumerate(g.kind.tolist()):
        assert agent_kind[g.agent[v]] == KINDS[Kind(k)].agent, g.label(v)


class Switched(FlatHost):
    """A flat machine with one PCIe switch uplink of `switch_bps` above every GPU: each copy's
    bytes also cross it (the shape of a topology's routed copy)."""

    def __init__(self, hw, g, switch_bps: float):
        super().__init__(hw, g)
        self.names = [*self.names, "switch0.up"]
        self.capacity = {**self.capacity, "switch0.up": switch_bps}
        self.seen: list[TaskLoad] = []

    def draws(self, t: TaskLoad):
        self.seen.append(t)
        out = super().draws(t)
        return out + [("switch0.up", t.work)] if t.load in (Load.H2D, Load.D2H) else out


@pytest.fixture
def switched(monkeypatch):
    """Registers Switched ahead of the flat machine; returns (the machines made, settings)."""
    made, setting = [], {"bps": 5e9}

    def make(hw, g):
        made.append(Switched(hw, g, setting["bps"]))
        return made[-1]

    monkeypatch.setattr(costs, "MACHINES", (make, FlatHost.of))
    return made, setting


def test_a_registered_machine_gets_every_task_and_slows_the_step(switched):
    made, setting = switched
    hw = load_hardware("h200x2")
    wl = Workload(load_model("qwen3-0.6b"), 1024, 4, 2, 2)
    plan = Plan()
    fast = simulate(hw, wl, plan, check_memory=False).step_time_s
    g = build_graph(wl, plan, hw.host.cores, iterations=1)
    use = costs.resource_use(g, hw, costs.task_durations(g, hw, wl))
    assert [t.task for t in made[-1].seen] == list(range(g.n_tasks))  # every task, in order
    j = use.index("switch0.up")
    copies = np.isin(g.kind, [int(k) for k, r in KINDS.items() if r.load in (Load.H2D, Load.D2H)])
    drawn = np.array([use.amount[use.ptr[v]:use.ptr[v + 1]][use.res[use.ptr[v]:use.ptr[v + 1]] == j]
                      .sum() for v in range(g.n_tasks)])
    assert np.array_equal(drawn[copies], g.work[copies]) and not drawn[~copies].any()
    # a slower switch uplink: the simulated step gets longer, the bound at least its copy time
    setting["bps"] = 1e9
    slow = simulate(hw, wl, plan, check_memory=False).step_time_s
    bound = predict(hw, wl, plan).lower_bound_s
    assert slow > fast
    assert bound == pytest.approx(max(bound, g.work[copies].sum() / 1e9), rel=1e-9)
