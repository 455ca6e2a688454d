"""`slidedp train --plan auto`: AutoPolicy chooses the plan, then training runs with it.

The choice (commands/choose.py, policy/auto.py) is made before anything large is allocated:
  hardware   --hardware (a preset or a `slidedp profile` TOML) when given; else the h200x1 (one
             rank) or h200x2 (two ranks) preset's rates with this machine's memory sizes and core
             count (exec/trainer.py local_hardware: on --device cpu the "GPU" memory is the
             available host RAM); more ranks need --hardware. On a CPU the simulated ranking is
             thus an H200's, and the real probes (below) are what measures this machine.
  cap        --gpu-memory-cap-gib (default: the hardware's whole GPU memory).
  moments    --moments when given; else the cheapest format whose host state fits host RAM,
             fp32 first (model/state_tier.py), and the report's first note says why.
  fixed      --offload-ratio, --update-workers, --host-bf16-copy and --grad-clip (which defers
             the update) are kept; routes, chunks and the window are AutoPolicy's to choose, so
             passing them with --plan auto is refused.
  policies   only the activation policies the executor runs on --device (policy/probe.py
             runs_policy: every policy of spec/segments.py since the executor runs them all).
  probes     one rank (--nproc 1): the finalists run a few real steps each on --device, best
             simulated first, within choose.DEFAULT_TIME_LIMIT_S of selection (random
             weights, one host state closed again before training); with --nproc > 1 nothing is
             probed and the report says so.
OUT/plan.toml (the plan, with the report as its header comment) and OUT/plan-report.txt are
written, the report and the selection time printed, and the plan file is what training (and every
rank process) reads. --resume reuses OUT/plan.toml; without --resume an --out holding one is
refused, like an --out holding an earlier run.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from slidedp.commands.choose import cap_bytes, choose_plan, write_plan
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec, load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Moments, default_plan, plan_for_clipping
from slidedp.spec.workload import Workload

AUTO = "auto"
PLAN_FILE = "plan.toml"
REPORT_FILE = "plan-report.txt"
CHOSEN = ("param_route", "grad_route", "update_sharding", "chunk_mib", "window_slots")
RATES = {1: "h200x1", 2: "h200x2"}  # default rates by rank count


def selection_hardware(opts: dict) -> HardwareSpec:
    """The hardware AutoPolicy plans for (module docstring)."""
    if opts["hardware"]:
        return load_hardware(opts["hardware"])
    from slidedp.exec.trainer import local_hardware

    ranks = opts["nproc"]
    if ranks not in RATES:
        raise SpecError("command line", "--hardware", f"a preset or a `slidedp profile` TOML of "
                        f"this machine for --plan auto with --nproc {ranks} (without it, 1 or 2 "
                        "ranks plan with the h200x1 / h200x2 rates)")
    rates, here = load_hardware(RATES[ranks]), local_hardware(opts["device"], ranks)
    return replace(rates, name=f"{rates.name} rates, {here.name} memory",
                   gpu=replace(rates.gpu, hbm_bytes=here.gpu.hbm_bytes),
                   host=replace(rates.host, ram_bytes=here.host.ram_bytes, cores=here.host.cores))


def earlier_plan(opts: dict) -> Path | None:
    """OUT/plan.toml where --resume continues a run that chose it (the plan is not chosen
    again); None where OUT holds none; SpecError naming --out where it holds one without
    --resume."""
    out = Path(opts["out"])
    path = out / PLAN_FILE
    if not path.exists():
        return None
    if opts["resume"]:
        print(f"plan: {path}, chosen when the run started", flush=True)
        return path
    raise SpecError(str(out), "--out", f"a directory without an earlier run (it holds "
                    f"{PLAN_FILE}; pass --resume to continue it, or choose another --out)")


def select_plan(opts: dict) -> Path:
    """Choose the plan for the resolved train options; the path of OUT/plan.toml."""
    for key in CHOSEN:
        if opts[key] is not None:
            raise SpecError("command line", f"--{key.replace('_', '-')}", "unset with --plan "
                            "auto (AutoPolicy chooses routes, chunks and the window; give a plan "
                            "file to fix them)")
    if (earlier := earlier_plan(opts)) is not None:
        return earlier
    out = Path(opts["out"])
    path = out / PLAN_FILE
    hw = selection_hardware(opts)
    wl = Workload(load_model(opts["model"]), opts["seq"], opts["global_batch"],
                  opts["micro_batch"], opts["nproc"], where="command line")
    base = plan_for_clipping(default_plan(hw.fabric.kind).with_overrides(
        offload_ratio=opts["offload_ratio"], update_workers=opts["update_workers"],
        host_bf16_copy=opts["host_bf16_copy"], moments=opts["moments"] and Moments(opts["moments"])),
        opts["grad_clip"], opts["skip_nonfinite"])
    print(f"choosing the plan (AutoPolicy) for {hw.name}, probes on {opts['device']}", flush=True)
    plan, report = choose_plan(hw, wl, cap_bytes(hw, opts["gpu_memory_cap_gib"]), base=base,
                               probe_device=opts["device"], executor_device=opts["device"],
                               choose_moments=not opts["moments"])
    lines = report.lines()
    out.mkdir(parents=True, exist_ok=True)
    write_plan(path, plan, report, "slidedp train --plan auto")
    (out / REPORT_FILE).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"plan chosen in {report.selection_s:.1f} s: {path} (report {out / REPORT_FILE})",
          flush=True)
    return path
