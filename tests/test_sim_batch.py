"""sim/batch.py: what worker processes simulate equals what this process simulates, is memoized,
and the specs (read-only mappings included) travel to the workers."""

from pathlib import Path

import pytest

from slidedp.policy.activations import tail_plan
from slidedp.sim import batch
from slidedp.sim.batch import StepTimes, summarize
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

PROFILE = str(Path(__file__).resolve().parents[1]
              / "benchmarks/results/2026-12-01-h200-profile-0829.toml")  # has host.agent_gap_us


def test_worker_processes_give_the_steps_of_this_process(monkeypatch):
    hw = load_hardware(PROFILE)
    assert hw.host.task_gap_s  # a read-only mapping: must reach the workers as one
    wl = Workload(load_model("qwen3-0.6b"), 4096, 2, 2, 1)
    L = wl.model.n_layers
    plans = [tail_plan(Plan(window_slots=w), L, name, 4)
             for w in (2, 3) for name in ("layer", "sac", "none")]
    with StepTimes(hw, wl, workers=2) as pooled:
        pooled.prefetch(plans + plans[:2])  # repeats are simulated once
        assert pooled._pool is not None and set(pooled.memo) == set(plans)
        here = {p: summarize(hw, wl, p) for p in plans}
        assert pooled.memo == here  # deterministic: bit for bit, every figure of the summary
        assert len({s.step_time_s for s in here.values()}) > 1  # the plans differ
        calls = []
        monkeypatch.setattr(batch, "summarize", lambda *a: calls.append(a))
        pooled.prefetch(plans)
        assert [pooled.step_s(p) for p in plans] == [here[p].step_time_s for p in plans]
        assert not calls
    assert pooled._pool is None  # shut down with the context


def test_one_worker_runs_here_and_workers_are_checked(monkeypatch):
    hw, wl = load_hardware("h200x1"), Workload(load_model("tiny-qwen3"), 256, 2, 2, 1)
    sims = StepTimes(hw, wl, workers=1)
    sims.prefetch([Plan(window_slots=2), Plan(window_slots=3)])
    assert sims._pool is None and len(sims.memo) == 2
    with pytest.raises(ValueError, match="another hardware or workload"):
        sims.check(load_hardware("h200x1"), wl)
    with pytest.raises(ValueError, match="workers must be >= 1, got 0"):
        StepTimes(hw, wl, workers=0)
    monkeypatch.delenv(batch.ENV_WORKERS, raising=False)
    assert 1 <= batch.default_workers() <= batch.MAX_WORKERS
    monkeypatch.setenv(batch.ENV_WORKERS, "3")
    assert batch.default_workers() == 3
    monkeypatch.setenv(batch.ENV_WORKERS, "many")
    with pytest.raises(ValueError, match="SLIDEDP_SIM_WORKERS: a whole number"):
        batch.default_workers()


def test_workers_that_cannot_start_leave_the_batch_to_this_process(monkeypatch, capsys):
    """A pool whose workers die (e.g. a script without a __main__ guard re-run by spawn): the
    batch is simulated here, with the same figures, and the user is told once."""
    hw, wl = load_hardware("h200x1"), Workload(load_model("tiny-qwen3"), 256, 2, 2, 1)
    plans = [Plan(window_slots=2), Plan(window_slots=3)]
    monkeypatch.setattr(batch, "_worker_init", _die)
    with StepTimes(hw, wl, workers=2) as sims:
        sims.prefetch(plans)
        assert sims.workers == 1 and sims._pool is None
        assert sims.memo == {p: summarize(hw, wl, p) for p in plans}
    assert "simulating in this process" in capsys.readouterr().err


def _die(specs: bytes) -> None:
    import os

    os._exit(3)
