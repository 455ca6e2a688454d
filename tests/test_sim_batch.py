"""sim/batch.py: step times simulated in worker processes equal those simulated here, are
memoized, and the specs (read-only mappings included) travel to the workers."""

import pytest

from slidedp.policy.activations import tail_plan
from slidedp.sim import batch
from slidedp.sim.batch import StepTimes
from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

PROFILE = "benchmarks/results/2026-12-01-h200-profile-0829.toml"  # has host.agent_gap_us


def test_worker_processes_give_the_steps_of_this_process(monkeypatch):
    hw = load_hardware(PROFILE)
    assert hw.host.task_gap_s  # a read-only mapping: must reach the workers as one
    wl = Workload(load_model("tiny-qwen3"), 256, 2, 2, 1)
    L = wl.model.n_layers
    plans = [tail_plan(Plan(window_slots=w), L, name, 2)
             for w in (2, 3) for name in ("layer", "sac", "none")]
    with StepTimes(hw, wl, workers=2) as pooled:
        pooled.prefetch(plans + plans[:2])  # repeats are simulated once
        assert pooled._pool is not None and set(pooled.memo) == set(plans)
        here = {p: simulate(hw, wl, p, check_memory=False).step_time_s for p in plans}
        assert pooled.memo == here  # deterministic: bit for bit
        calls = []
        monkeypatch.setattr(batch, "_step_s", lambda *a: calls.append(a) or 0.0)
        pooled.prefetch(plans)
        assert [pooled.step_s(p) for p in plans] == [here[p] for p in plans] and not calls
    assert pooled._pool is None  # shut down with the context


def test_one_worker_runs_here_and_workers_are_checked():
    hw, wl = load_hardware("h200x1"), Workload(load_model("tiny-qwen3"), 256, 2, 2, 1)
    sims = StepTimes(hw, wl, workers=1)
    sims.prefetch([Plan(window_slots=2), Plan(window_slots=3)])
    assert sims._pool is None and len(sims.memo) == 2
    assert 1 <= batch.default_workers() <= batch.MAX_WORKERS
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        StepTimes(hw, wl, workers=0)
