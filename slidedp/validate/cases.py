"""The cases file: configurations to measure and predict, one `[[case]]` table each.

    [defaults]                 # optional: any case key but `name`, applied to every case
    model = "qwen3-8b"
    seq = 4096
    plan = { h2d_chunk_mib = 64.0, d2h_chunk_mib = 64.0 }

    [[case]]
    name = "8b-r2-gb8-mb4-sharded-gpu"   # the folder validation/<name>/ ([A-Za-z0-9._-])
    gpus = 2
    global_batch = 8                     # sequences per optimizer step
    micro_batch = 4                      # sequences per GPU per micro-step
    plan = { param_route = "sharded", grad_route = "gpu" }   # Plan fields; the rest default

A case's plan is the defaults' plan updated by its own, over Plan()'s defaults (not the hardware's
default plan: a measured case must not change meaning when a hardware file does). Every error is a
SpecError naming the file and the field (`case[2].plan.param_route`). A stored case's case.toml
is this format with one case and every plan field written out.
"""

from __future__ import annotations

import json
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from slidedp.spec.errors import SpecError
from slidedp.spec.model import ModelSpec, load_model
from slidedp.spec.plan import Plan, load_plan, parse_plan, plan_dict
from slidedp.spec.tomlio import Table, read_toml
from slidedp.spec.workload import Workload

CASE_KEYS = ("model", "seq", "gpus", "global_batch", "micro_batch", "plan")
NAME = re.compile(r"^[A-Za-z0-9._-]+$")


@dataclass(frozen=True)
class Case:
    name: str
    model: str  # preset name, config.json or model directory, as written in the file
    seq: int
    gpus: int
    global_batch: int
    micro_batch: int
    plan: Plan

    @property
    def spec(self) -> ModelSpec:
        return load_model(self.model)

    def workload(self) -> Workload:
        return Workload(self.spec, self.seq, self.global_batch, self.micro_batch, self.gpus,
                        where=f"case {self.name}")


def _case(t: Table, defaults: dict, where: str, label: str) -> Case:
    name = t.str("name")
    if not NAME.match(name):
        raise SpecError(where, f"{label}.name", f"letters, digits, '.', '_' or '-', got {name!r}")
    merged = {k: v for k, v in defaults.items() if k != "plan"}
    merged |= {k: t.raw(k) for k in CASE_KEYS if t.has(k) and k != "plan"}
    plan_data = dict(defaults.get("plan", {})) | dict(t.sub("plan", {}).data)
    t.done()
    m = Table(merged, where, label)
    model = m.str("model")
    ints = {k: m.int(k) for k in ("seq", "gpus", "global_batch", "micro_batch")}
    m.done()
    try:
        plan = parse_plan({"plan": plan_data}, where)
        load_model(model)
    except SpecError as e:
        field = e.field.removeprefix("plan.") if e.where == where else "model"
        sub = "plan." if e.where == where and e.field.startswith("plan.") else ""
        raise SpecError(where, f"{label}.{sub}{field}", e.expected) from None
    case = Case(name, model, plan=plan, **ints)
    try:
        case.workload()
    except SpecError as e:
        raise SpecError(where, f"{label}.{e.field}", e.expected) from None
    return case


def parse_cases(data: dict, where: str) -> list[Case]:
    """Cases of a parsed cases file (module docstring); names are unique."""
    root = Table(data, where)
    d = root.sub("defaults", {})
    defaults = {k: d.raw(k) for k in CASE_KEYS if d.has(k)}
    if "plan" in defaults:
        d.sub("plan")  # a table, or a SpecError naming defaults.plan
    d.done()
    cases = [_case(t, defaults, where, f"case[{i}]") for i, t in enumerate(root.subs("case"))]
    root.done()
    seen: set[str] = set()
    for i, c in enumerate(cases):
        if c.name in seen:
            raise SpecError(where, f"case[{i}].name", f"a name no other case has, got {c.name!r} twice")
        seen.add(c.name)
    return cases


def parse_case_spec(spec: str) -> tuple[int, int, Plan]:
    """(global batch, micro-batch, plan) of the benchmarks' one-line case syntax
    GB:MB:PARAM_ROUTE:GRAD_ROUTE:UPDATE_SHARDING[:FIELD=VALUE...] (any Plan field, value as TOML,
    over Plan()'s defaults), e.g. 16:4:sharded:gpu:rank0:window_slots=36, or
    GB:MB:plan=FILE[:FIELD=VALUE...] for a plan TOML (e.g. one `slidedp plan` chose)."""
    where = f"case {spec!r}"
    gb, mb, *rest = spec.split(":")
    table: dict = {}
    if rest and rest[0].startswith("plan="):
        table = plan_dict(load_plan(rest[0][len("plan="):]))
        rest = rest[1:]
    elif len(rest) >= 3:
        table = {"param_route": rest[0], "grad_route": rest[1], "update_sharding": rest[2]}
        rest = rest[3:]
    else:
        raise SpecError(where, "<case>", "GB:MB:PARAM_ROUTE:GRAD_ROUTE:UPDATE_SHARDING"
                        "[:FIELD=VALUE...] or GB:MB:plan=FILE[:FIELD=VALUE...]")
    for item in rest:
        key, _, text = item.partition("=")
        try:
            table[key] = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            raise SpecError(where, key, "FIELD=VALUE with a TOML value") from None
    if not (gb.isdigit() and mb.isdigit()):
        raise SpecError(where, "GB:MB", f"two positive integers, got {gb}:{mb}")
    return int(gb), int(mb), parse_plan({"plan": table}, where)


def load_cases(path: str | Path) -> list[Case]:
    return parse_cases(read_toml(path), str(path))


def case_toml(case: Case, comment: str = "") -> str:
    """A cases file holding `case` alone, every plan field written (case.toml of a stored case)."""
    lines = [f"# {line}" for line in comment.splitlines()]
    lines += ["[[case]]"] + [f"{k} = {json.dumps(getattr(case, k))}" for k in
                             ("name", "model", "seq", "gpus", "global_batch", "micro_batch")]
    lines += ["", "[case.plan]"] + [f"{k} = {json.dumps(v)}" for k, v in plan_dict(case.plan).items()]
    return "\n".join(lines) + "\n"
