"""One profile of the machine at hand, as `slidedp profile` and the default chooser take it.

request()      the measurement request for this machine (its GPU topology read here), after the
               checks that measure nothing: what it cannot measure needs a base, every model's
               layer must be buildable
measure()      run it (run.py), assemble the hardware TOML (assemble.py) and parse it back with
               the schema's own checks: a Profile (text, spec, wall seconds by step)
base_preset()  the hardware preset the default chooser takes what a machine cannot measure from
               (datasheet figures; with one GPU, the fabric): the preset of the machine's GPU
               kind with the nearest GPU count, else the H200 preset with the nearest count
"""

from __future__ import annotations

import re
import time
import tomllib
from dataclasses import dataclass

from slidedp.profile.assemble import Assembler, require_base, unmeasured
from slidedp.profile.compute import one_layer_config
from slidedp.profile.fabric import fabric_kind, gpu_link_matrix, read_topology
from slidedp.profile.machine import Machine
from slidedp.profile.run import Profiler, Request, Results
from slidedp.profile.sizes import Sizes
from slidedp.profile.tomlw import dumps
from slidedp.spec.hardware import HardwareSpec, hardware_presets, load_hardware, parse_hardware
from slidedp.spec.model import ModelSpec

FALLBACK_KIND = "H200"  # the GPU kind whose presets stand in for a kind without one


@dataclass(frozen=True)
class Profile:
    text: str  # the hardware TOML
    spec: HardwareSpec
    results: Results
    step_s: tuple[tuple[str, float], ...]  # each measurement step's wall seconds, in order
    wall_s: float


def request(machine: Machine, sizes: Sizes, models: tuple[ModelSpec, ...], seqs: tuple[int, ...],
            micro_batches: tuple[int, ...], base: HardwareSpec | None
            ) -> tuple[Request, dict[str, str]]:
    """(the request, what this machine cannot measure -> why); SpecError before anything is
    measured where that needs a base and none is given, or a model's layer cannot be built."""
    topology = read_topology() if machine.gpu_count >= 2 else ""
    kind = fabric_kind(gpu_link_matrix(topology)) if topology else None
    missing = unmeasured(machine, kind)
    require_base(missing, base)
    if machine.gpu_count:
        for spec in models:
            one_layer_config(spec)
    return Request(sizes, models if machine.gpu_count else (), seqs, micro_batches, topology,
                   kind), missing


def measure(machine: Machine, req: Request, base: HardwareSpec | None, name: str, command: str,
            where: str, progress: bool = True) -> Profile:
    """Run the request and assemble its hardware TOML (`command` heads its comment; `where`
    names it in a SpecError of the schema's checks)."""
    t0 = time.perf_counter()
    profiler = Profiler(machine, req)
    res = profiler.run(progress)
    doc = Assembler(machine, req, res, base).document(name)
    text = dumps(doc, f"Written by: {command}\n{machine.source('see each section')}")
    spec = parse_hardware(tomllib.loads(text), where)
    return Profile(text, spec, res, tuple(profiler.step_s), time.perf_counter() - t0)


def _gpu_kind(model: str) -> str:
    """The first word of a GPU model name with a digit in it, upper case ("H200", "A800",
    "4090"); "" if none."""
    return next((w.upper() for w in re.split(r"[\s-]+", model) if any(c.isdigit() for c in w)), "")


def base_preset(machine: Machine) -> str:
    """The preset name for what `machine` cannot measure (module docstring); ties go to the
    name first in order (a800x4 before a800x4-nobridge)."""
    presets = {n: load_hardware(n).gpu for n in hardware_presets()}
    here = machine.gpu_model.upper()
    kind = [n for n, g in presets.items() if _gpu_kind(g.model) and _gpu_kind(g.model) in here]
    pool = kind or [n for n, g in presets.items() if _gpu_kind(g.model) == FALLBACK_KIND]
    return min(sorted(pool), key=lambda n: abs(presets[n].count - machine.gpu_count))
