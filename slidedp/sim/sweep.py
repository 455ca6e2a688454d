"""Grids of simulations: GPUs x global batch x routes x chunk sizes, from a TOML file or options.

Sweep file (every key optional; a grid key takes one value or a list):
    [sweep]
    hardware = "h100x8"        model = "qwen3-14b"      seq = 4096       micro_batch = 1
    gpus = [1, 2, 4, 8]        global_batch = [8]       chunk_mib = [64]
    param_route = ["replicated", "sharded"]             grad_route = ["gpu", "cpu"]
    update_workers = 1         iterations = 3           contention = true
Unknown keys and malformed values are a SpecError naming the file and the key. A grid point that
cannot run (global batch not a multiple of micro_batch x gpus, memory overflow) becomes a row
with its one-line reason in `error`, and the sweep goes on.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, fields

from slidedp.sim.engine import SimConfig
from slidedp.sim.result import result_row
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import InfeasiblePlan, SpecError
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import GradRoute, ParamRoute, default_plan
from slidedp.spec.tomlio import Table, read_toml
from slidedp.spec.workload import Workload

GRID_KEYS = ("gpus", "global_batch", "param_route", "grad_route", "chunk_mib")


@dataclass(frozen=True)
class SweepSpec:
    hardware: str = "h200x2"
    model: str = "qwen3-8b"
    seq: int = 4096
    micro_batch: int = 1
    gpus: tuple = (1, 2)
    global_batch: tuple = (8,)
    param_route: tuple = ("replicated", "sharded")
    grad_route: tuple = ("gpu",)
    chunk_mib: tuple = (64.0,)
    update_workers: int = 1
    iterations: int = 3
    contention: bool = True

    def points(self) -> list[dict]:
        return [dict(zip(GRID_KEYS, p, strict=True)) for p in
                itertools.product(*(getattr(self, k) for k in GRID_KEYS))]


def _grid(t: Table, key: str, kind: str, choices: tuple[str, ...] = ()) -> tuple:
    raw = t.raw(key)
    values = raw if isinstance(raw, list) else [raw]
    if not values:
        raise SpecError(t.where, f"sweep.{key}", "a value or a non-empty list")
    out = []
    for v in values:
        one = Table({key: v}, t.where, "sweep")
        if kind == "int":
            out.append(one.int(key))
        elif kind == "num":
            out.append(one.num(key))
        else:
            out.append(one.str(key, choices=choices))
    return tuple(out)


def parse_sweep(data: dict, where: str) -> SweepSpec:
    root = Table(data, where)
    t = root.sub("sweep")
    kinds = {"gpus": ("int", ()), "global_batch": ("int", ()), "chunk_mib": ("num", ()),
             "param_route": ("str", tuple(e.value for e in ParamRoute)),
             "grad_route": ("str", tuple(e.value for e in GradRoute))}
    kw = {}
    for f in fields(SweepSpec):
        if not t.has(f.name):
            continue
        if f.name in kinds:
            kw[f.name] = _grid(t, f.name, *kinds[f.name])
        elif f.type == "bool":
            kw[f.name] = t.bool(f.name)
        elif f.type == "int":
            kw[f.name] = t.int(f.name)
        else:
            kw[f.name] = t.str(f.name)
    t.done()
    root.done()
    if kw.get("iterations", 3) < 3:
        raise SpecError(where, "sweep.iterations", f"an integer >= 3, got {kw['iterations']}")
    return SweepSpec(**kw)


def load_sweep(path: str) -> SweepSpec:
    return parse_sweep(read_toml(path), path)


def run_sweep(spec: SweepSpec, progress: Callable | None = None) -> list[dict]:
    """One row per grid point; `progress` wraps the point iterator (e.g. tqdm)."""
    hw, model = load_hardware(spec.hardware), load_model(spec.model)
    cfg = SimConfig(iterations=spec.iterations, contention=spec.contention)
    points = spec.points()
    rows = []
    for p in (progress(points) if progress else points):
        row = {"hardware": spec.hardware, "model": spec.model, "seq": spec.seq,
               "micro_batch": spec.micro_batch, **p}
        try:
            wl = Workload(model, spec.seq, p["global_batch"], spec.micro_batch, p["gpus"],
                          where=f"sweep point {p}")
            plan = default_plan(hw.fabric.kind).with_overrides(
                param_route=ParamRoute(p["param_route"]), grad_route=GradRoute(p["grad_route"]),
                h2d_chunk_mib=p["chunk_mib"], d2h_chunk_mib=p["chunk_mib"],
                update_workers=spec.update_workers)
            res = simulate(hw, wl, plan, cfg)
        except (SpecError, InfeasiblePlan) as e:
            rows.append(row | {"error": str(e)})
            continue
        rows.append(result_row(res, **row) | {"error": ""})
    return rows
