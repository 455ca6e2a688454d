"""Studies the notebooks show, from the simulator alone: strong scaling and route choice.

naive_plan()    the published multi-GPU baseline: replicated upload, gradients summed on the CPU,
                one whole-layer chunk (no cast/copy overlap inside a layer), one update worker
slidedp_plan()  sharded upload + all-gather, GPU reduce, 64 MiB chunks
host_idle_s     GPU idle charged to host channels (upload, activations, download, update): the
                exposed host time
"""

from __future__ import annotations

import pandas as pd

from slidedp.sim.engine import SimConfig
from slidedp.sim.result import result_row
from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import GradRoute, ParamRoute, Plan
from slidedp.spec.units import MIB
from slidedp.spec.workload import Workload


def naive_plan(model: str) -> Plan:
    """Chunks as large as the largest unit (BF16), so every unit moves in one piece."""
    whole = max(load_model(model).unit_params()) * 2 / MIB
    return Plan(param_route=ParamRoute.REPLICATED, grad_route=GradRoute.CPU,
                h2d_chunk_mib=whole, d2h_chunk_mib=whole, update_workers=1)


def slidedp_plan() -> Plan:
    return Plan(param_route=ParamRoute.SHARDED, grad_route=GradRoute.GPU, h2d_chunk_mib=64.0,
                d2h_chunk_mib=64.0)


def strong_scaling(hardware: str, model: str, global_batch: int, gpus: list[int],
                   plans: dict[str, Plan], seq: int = 4096, micro_batch: int = 1) -> pd.DataFrame:
    """Fixed global batch, more GPUs (fewer accumulation steps each): one row per (plan, GPUs)."""
    hw, m = load_hardware(hardware), load_model(model)
    rows = []
    for name, plan in plans.items():
        for r in gpus:
            res = simulate(hw, Workload(m, seq, global_batch, micro_batch, r), plan, SimConfig())
            rows.append(result_row(res, plan=name, gpus=r))
    return pd.DataFrame(rows)


def route_choice(hardware: list[str], model: str, gpus: int, micro_batch: int,
                 seq: int = 4096) -> pd.DataFrame:
    """Both upload routes on each hardware (GPU reduce, 64 MiB chunks): one row per pair."""
    m = load_model(model)
    rows = []
    for name in hardware:
        hw = load_hardware(name)
        for route in ParamRoute:
            plan = Plan(param_route=route, grad_route=GradRoute.GPU)
            res = simulate(hw, Workload(m, seq, micro_batch * gpus, micro_batch, gpus), plan)
            rows.append(result_row(res, hardware=name, param_route=route.value))
    return pd.DataFrame(rows)
