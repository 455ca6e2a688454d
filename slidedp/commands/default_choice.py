"""`slidedp train`'s plan where no plan file is given: the default chooser on a GPU, the documented
default plan on a CPU.

  --plan FILE, --plan auto   the file; AutoPolicy with probes (autoplan.py): not here
  --plan default             the documented default plan (spec/plan.py default_plan), any device
  no --plan, on a CPU        the same, at once: no profile and no search
  no --plan on a GPU, or     the default chooser (policy/chooser.py): AutoPolicy's simulated
  --plan auto-sim            stages without probes, the options given kept fixed
The chooser's hardware: --hardware where given; else on CUDA this machine's profile; else (a
CPU, --plan auto-sim) autoplan.selection_hardware, the h200x1 / h200x2 rates with this
machine's memory. The profile is cached by machine fingerprint (profile/cache.py); a cold start
measures it in this process with the CHOOSER sizes (`slidedp profile --chooser` for the
workload's model, sequence and micro-batch; what the machine cannot measure from the preset of
profile/measure.py base_preset). Where the profile fails (out of memory, a GPU faster than the
base preset's datasheet peak), the run takes the default plan and one warning says why.
The choice is cached per (machine, hardware, model, workload, the options, the code that
chooses: CHOICE_SOURCES). It is written as OUT/plan.toml (its report as the header comment)
with OUT/plan-report.txt, and the run, every rank included, reads that file. settle() puts the
run's plan into its options (OUT/plan.toml, or DEFAULT), so that config.toml names it and
--resume runs it again without choosing; without --resume an --out holding a plan.toml is
refused (as --plan auto). The first lines of the output say which plan and why: for a choice,
the plan, its simulated step against the default plan's, the bottleneck, the options kept as
given, and where the seconds went.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from slidedp.commands.autoplan import AUTO, PLAN_FILE, REPORT_FILE, earlier_plan, selection_hardware
from slidedp.commands.choose import cap_bytes, plan_toml
from slidedp.commands.common import AUTO_SIM, DEFAULT, fixed_fields, with_plan_options
from slidedp.profile import cache
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec, load_hardware, parse_hardware
from slidedp.spec.model import ModelSpec, load_model
from slidedp.spec.plan import default_plan, plan_dict, plan_for_clipping
from slidedp.spec.workload import Workload

if TYPE_CHECKING:
    from slidedp.profile.machine import Machine

# the sources a choice depends on beyond its inputs: a chooser of other code chooses anew
CHOICE_SOURCES = ("spec", "graph", "model", "sim", "policy", "presets/hardware")
SLOWEST_STEPS = 4  # the profile's steps a cold start names, longest first


def settle(opts: dict, precheck: Callable[[dict], object]):
    """Where no plan file is given, the run's plan into opts["plan"], so that config.toml names
    it and --resume runs it again: DEFAULT, or the default chooser's OUT/plan.toml (DEFAULT where
    the chooser's profile failed). The first lines of the output say which and why. Returns
    precheck(opts) (the model source, after the data's checks that read no data) where the
    chooser ran: bad data fails before a cold start's profile; None otherwise."""
    line = plan_line(opts)
    if line is not None:
        print(line, flush=True)
    if opts["plan"] is None and not chooses(opts):
        opts["plan"] = DEFAULT
    if not chooses(opts):
        return None
    source = precheck(opts)
    opts["plan"] = select(opts) or DEFAULT
    return source


def chooses(opts: dict) -> bool:
    """Whether the default chooser picks this run's plan (module docstring)."""
    return opts["plan"] == AUTO_SIM or (opts["plan"] is None and opts["device"] == "cuda")


def plan_line(opts: dict) -> str | None:
    """The first line of the output where no plan is chosen now: the documented default plan or
    a plan file (OUT/plan.toml of the run --resume continues); None where one is chosen (the
    chooser's summary or AutoPolicy's report says which and why)."""
    plan = opts["plan"]
    if plan == DEFAULT:
        return f"plan: the documented default plan (plan = {DEFAULT})"
    if plan is None and opts["device"] != "cuda":
        return ("plan: the documented default plan (on a CPU nothing is profiled or searched; "
                f"--plan {AUTO_SIM} simulates a choice, --plan {AUTO} probes one)")
    if plan in (None, AUTO_SIM, AUTO):
        return None
    if Path(plan) == Path(opts["out"]) / PLAN_FILE:
        return f"plan: {plan}, chosen when the run started"
    return f"plan: the plan file {plan}"


def select(opts: dict) -> str | None:
    """Choose the plan for the resolved train options (chooses(opts)): the path of OUT/plan.toml,
    or None where the profile failed (the default plan; one warning says why)."""
    if (earlier := earlier_plan(opts)) is not None:
        return str(earlier)
    out = Path(opts["out"])
    path = out / PLAN_FILE
    t0 = time.perf_counter()
    model = load_model(opts["model"])
    wl = Workload(model, opts["seq"], opts["global_batch"], opts["micro_batch"], opts["nproc"],
                  where="command line")
    from slidedp.profile.machine import probe_machine

    machine = probe_machine()
    got = chooser_hardware(opts, model, machine)
    if got is None:
        return None
    hw, hw_key, how = got
    args = argparse.Namespace(**opts)  # the plan options, as with_plan_options reads them
    base = plan_for_clipping(with_plan_options(default_plan(hw.fabric.kind), args),
                             opts["grad_clip"], opts["skip_nonfinite"])
    fixed, cap = fixed_fields(args), cap_bytes(hw, opts["gpu_memory_cap_gib"])
    key = cache.digest({"hardware": hw_key, "model": repr(model),
                        "workload": [wl.seq_len, wl.global_batch, wl.micro_batch, wl.gpus],
                        "base": plan_dict(base), "fixed": sorted(fixed), "cap": cap,
                        "device": opts["device"],
                        "code": cache.sources_digest(CHOICE_SOURCES)})
    entry = cache.machine_dir(cache.fingerprint(machine)) / "plans" / f"{key}.json"
    choice = cache.read(entry, lambda text: _choice(text, str(entry)))
    if choice is None:
        from slidedp.policy.chooser import choose

        choice = choose(hw, wl, base, fixed, cap, runs_policy=executor_runs(opts["device"]))
        cache.write(entry, json.dumps(choice.to_json(), indent=1) + "\n")
        how.append(f"plan simulated in {choice.selection_s:.1f} s")
    else:
        how.append(f"plan cached ({entry})")
    lines = choice.summary(hw.name)
    out.mkdir(parents=True, exist_ok=True)
    report = "\n".join(lines + list(choice.report))
    path.write_text(plan_toml(choice.plan, "written by slidedp train (the default chooser)\n"
                              + report))
    (out / REPORT_FILE).write_text(report + "\n")
    lines.append(f"  chosen in {time.perf_counter() - t0:.1f} s ({'; '.join(how)}): {path}, "
                 f"report {out / REPORT_FILE}; --plan default runs the default plan")
    print("\n".join(lines), flush=True)
    return str(path)


def _choice(text: str, where: str):
    from slidedp.policy.chooser import Choice

    return Choice.from_json(json.loads(text), where)


def executor_runs(device: str) -> Callable[[str], bool]:
    """Whether the executor on `device` runs an activation policy (policy/probe.py: an engine
    build each, asked once per policy)."""
    from slidedp.policy.probe import runs_policy

    return functools.cache(lambda name: runs_policy(name, device))


def chooser_hardware(opts: dict, model: ModelSpec, machine: Machine
                     ) -> tuple[HardwareSpec, str, list[str]] | None:
    """(the hardware the chooser prices, its cache key, how it was had); None where the profile
    failed (one warning)."""
    if opts["hardware"]:
        hw = load_hardware(opts["hardware"])
        return hw, cache.digest(repr(replace(hw, origin=""))), [f"--hardware {opts['hardware']}"]
    if opts["device"] != "cuda":
        hw = selection_hardware(opts)
        return hw, cache.digest(repr(replace(hw, origin=""))), [hw.name]
    return machine_profile(machine, model, opts["seq"], opts["micro_batch"])


def machine_profile(machine: Machine, model: ModelSpec, seq: int, micro_batch: int
                    ) -> tuple[HardwareSpec, str, list[str]] | None:
    """This machine's profile with `model`'s layer at (seq, micro_batch): cached, else measured
    and cached (module docstring); None where measuring failed (one warning)."""
    print_ = cache.fingerprint(machine)
    folder = cache.machine_dir(print_)
    entry = folder / "profile-{}.toml".format(cache.digest(
        {"model": repr(model), "seq": seq, "micro_batch": micro_batch}))
    cached = cache.read(entry, lambda text: (text, parse_hardware(tomllib.loads(text), str(entry))))
    if cached is not None:
        text, hw = cached
        return hw, cache.digest(text), [f"profile cached ({entry})"]
    print("plan: profiling this machine for the default chooser (once per machine and "
          "workload; --plan default skips it)", flush=True)
    try:
        text, hw, wall_s = measure_profile(machine, model, seq, micro_batch, str(entry))
    except (SpecError, RuntimeError, OSError) as e:  # torch.cuda.OutOfMemoryError included
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"slidedp train: warning: the default chooser's profile failed ({cause}): the "
              "run takes the documented default plan", file=sys.stderr, flush=True)
        return None
    cache.write(folder / "machine.json", json.dumps(print_, indent=1) + "\n")
    cache.write(entry, text)
    return hw, cache.digest(text), [f"profile measured in {wall_s:.1f} s, cached ({entry})"]


def measure_profile(machine: Machine, model: ModelSpec, seq: int, micro_batch: int, where: str
                    ) -> tuple[str, HardwareSpec, float]:
    """`slidedp profile --chooser` of this machine for one layer shape: (TOML, spec, seconds)."""
    import torch

    from slidedp.profile.measure import base_preset, measure, request
    from slidedp.profile.sizes import CHOOSER

    base_name = base_preset(machine)
    base = load_hardware(base_name)
    req, _ = request(machine, CHOOSER, (model,), (seq,), (micro_batch,), base)
    cmd = (f"slidedp profile --chooser --model {model.source or model.name} --seq {seq} "
           f"--micro-batch {micro_batch} --base {base_name} (by slidedp train)")
    prof = measure(machine, req, base, f"this machine ({machine.gpus()}, {machine.cores} cores)",
                   cmd, where)
    gc.collect()  # the run that follows gets the GPU memory the profile's last step cached
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    slowest = sorted(prof.step_s, key=lambda kv: -kv[1])[:SLOWEST_STEPS]
    print(f"plan: profiled in {prof.wall_s:.1f} s; the longest steps: "
          + "; ".join(f"{name} {s:.1f} s" for name, s in slowest), flush=True)
    return prof.text, prof.spec, prof.wall_s
