"""gpu_idle_s beside E in the JSON of predict and simulate (slidedp/model/idle.py): one figure per
rank, the step minus that rank's compute; never below E for the busiest rank; both in --help."""

from __future__ import annotations

import json

import pytest

from slidedp.cli import main
from slidedp.model.idle import gpu_idle_s

ARGS = ["--model", "qwen3-0.6b", "--gpus", "2", "--json"]


def test_gpu_idle_is_the_step_minus_each_ranks_compute():
    busy = {"agent:gpu0.compute": 3.0, "agent:gpu1.compute": 2.5, "host.dram": 4.0}
    assert gpu_idle_s(4.0, busy, 2) == [1.0, 1.5]


@pytest.mark.parametrize("verb", ["predict", "simulate"])
def test_json_gives_gpu_idle_per_rank_beside_e(verb, capsys):
    assert main([verb, *ARGS]) == 0
    d = json.loads(capsys.readouterr().out)
    step, busy, idle = d["step_time_s"], d["busy_s"], d["gpu_idle_s"]
    assert len(idle) == 2
    for r, x in enumerate(idle):
        assert x == pytest.approx(step - busy[f"agent:gpu{r}.compute"], abs=1e-12)
    busiest = max(range(2), key=lambda r: busy[f"agent:gpu{r}.compute"])
    assert idle[busiest] >= d["exposed_s"] - 1e-12
    assert d["exposed_s"] == pytest.approx(max(0.0, step - max(d["compute_s"], d["host_s"])))


@pytest.mark.parametrize("verb", ["predict", "simulate"])
def test_help_explains_both(verb, capsys):
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "gpu_idle_s" in text and "E (exposed_s) = step - max(C, H)" in text
    assert "model feature" in text
