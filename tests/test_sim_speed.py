"""Speed: one steady step of 8 ranks x 80 layers x 16 chunks per layer in under 2 s.

Timed in CPU seconds of this process (time.process_time), so that tests running beside it on
the 2-core CI machine do not count against it; the better of two runs, each after a full
collection, so that a collector pass over the garbage of earlier tests in this worker does not
count either (the same process time still grows where the two workers share caches).
"""

import gc
import time

import pytest

from slidedp.graph.build import build_graph
from slidedp.graph.costs import resource_use, task_durations
from slidedp.sim.engine import SimConfig, run_graph
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import ParamRoute, Plan
from slidedp.spec.workload import Workload


@pytest.mark.parametrize("route", list(ParamRoute))
def test_8x80x16_step_under_2s(route):
    hw, m = load_hardware("h100x8"), load_model("qwen2.5-72b")
    chunk = m.layer_params() * 2 / 16 / 2**20 * 1.0001  # 16 chunks per layer
    wl = Workload(m, 4096, 8, 1, 8)
    plan = Plan(param_route=route, h2d_chunk_mib=chunk, d2h_chunk_mib=chunk)
    g = build_graph(wl, plan, hw.host.cores, iterations=3)
    d = task_durations(g, hw, wl)
    use = resource_use(g, hw, d)
    runs_s = []
    for _ in range(2):
        gc.collect()
        t = time.process_time()
        run_graph(g, d, use, hw, SimConfig())
        runs_s.append(time.process_time() - t)
    cpu_s = min(runs_s)
    assert cpu_s / g.n_iterations < 2.0, f"{cpu_s:.2f} CPU s for {g.n_iterations} steps"
