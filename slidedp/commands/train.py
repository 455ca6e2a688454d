"""`slidedp train`: full-parameter fine-tuning with the streaming executor (exec/trainer.py).

Options come from built-in defaults < a config file (--config FILE.toml: top-level keys named
as the options, with underscores, e.g. `global_batch = 16`, `betas = [0.9, 0.95]`) < explicit
options < `key=value` overrides (values parsed as TOML, else taken as strings). The resolved
configuration is printed at start as a TOML table that --config accepts back.
The defaults train the tiny-qwen3 preset on the bundled tiny-markov data (seq 64) for 100 steps
(a few seconds on a CPU); for a real model set at least --model, --data, --seq and --lr.

The plan: without --plan, on a GPU the default chooser's (the simulator on this machine's
profile, measured once and cached under ~/.cache/slidedp; the plan options given stay fixed), on
a CPU the documented default plan at once; `--plan default` takes the documented default plan
anywhere and `--plan auto-sim` the chooser's anywhere (commands/default_choice.py, with
docs/autopolicy.md). --plan auto: AutoPolicy chooses the plan with real probes
(commands/autoplan.py: hardware, cap, probes). The chosen plan is written to OUT/plan.toml with
OUT/plan-report.txt, and config.toml names it: --resume runs it again without choosing.

--nproc R > 1 trains data-parallel in R rank processes on this host (GPUs: NCCL, one GPU each;
CPU: gloo): this process checks the options, the fit and --out (bad input: one line, exit 2),
then starts the ranks with torchrun (exec/dist/launch.py), passing them the resolved options,
and returns the job's exit status. Each rank (is_rank_process()) runs the Trainer with a
DistSession; local rank 0 prints and writes the output. A rank that fails stops the others
(the watchdog of exec/dist/session.py): "slidedp rank R: failed: <cause>", nonzero exit, and
the launcher's last line names the rank and the cause.
--nodes K > 1 runs K nodes of --nproc R ranks each on this host, as K torchrun agents joined by
a c10d rendezvous on localhost (launch.py): each node has its own host state, the global batch
spans every node (--global-batch: a multiple of micro-batch x nproc x nodes), and the nodes
sum their gradients over torch.distributed (exec/features/internode.py; --internode-reduce
all_reduce, the one the executor runs). On GPUs each node gets the next R GPUs. The same rank
processes run under a torchrun of each host of a real cluster (README: several hosts); the
run's end prints every node's host state and its master copy's hash, which must agree.

The run directory (exec/rundir.py): --out is locked for the run's lifetime (a second run on it is
refused, exit 2), and holds config.toml, the resolved options. `--out DIR --resume` reads them
back: every other option may be left out. Given again, an option must keep its value, except
--steps and how the run executes, not what it computes: --nproc, --timeout, --device,
--micro-batch, --hardware, the plan options, --checkpoint-every, --keep-checkpoints, --trace,
--skip-nonfinite and --no-save-on-stop (RESUME_MAY_CHANGE). --steps on --resume is
the new total: 3 steps, then `--resume --steps 6`, trains steps 4 to 6; the cosine schedule's
horizon becomes the new total (the steps after the checkpoint follow the cosine of the new total,
the ones before kept the rates they had).

Faults (exec/outcome.py: exit codes): SIGINT or SIGTERM saves a checkpoint at the next step
boundary (unless --no-save-on-stop), prints "stopped at step N; resume with: ..." and exits 130
or 143; a second signal stops at once, unsaved. A NaN or Inf loss or gradient norm stops the run
(exit 1, one line: the step and the value), with nothing saved after it; --skip-nonfinite N skips
up to N such steps instead, leaving the weights and the optimizer state untouched, at the cost of
the deferred update (as --grad-clip: the CPU update waits for the whole backward and no longer
overlaps it; the host holds a whole step's gradient, +2 to +4 B/param). Options must be finite.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from slidedp.commands import default_choice, train_data
from slidedp.commands.autoplan import AUTO, PLAN_FILE, REPORT_FILE, select_plan
from slidedp.commands.common import add_network_options, add_plan_options, resolve
from slidedp.exec.dtypes import COMPUTE_DTYPES
from slidedp.exec.outcome import RunEnd
from slidedp.exec.schedule import SCHEDULES, LrSchedule
from slidedp.spec.errors import InfeasiblePlan, SpecError
from slidedp.spec.plan import (
    ClipSchedule,
    GradWiden,
    InternodeReduce,
    Kernels,
    Moments,
    plan_for_clipping,
)
from slidedp.spec.tomlio import read_toml

if TYPE_CHECKING:
    from slidedp.exec.dist import DistSession
    from slidedp.exec.signals import StopSignals
    from slidedp.exec.trainer import TrainConfig

# torch, transformers and the executor are imported where a run needs them, so that every other
# command (`slidedp predict` above all) starts without paying for them

DEVICES = ("cpu", "cuda")
DEFAULTS = {
    "model": "tiny-qwen3", "data": "tiny-markov", "out": None, "seq": 64, "global_batch": 16,
    "micro_batch": 8, "nproc": 1, "timeout": 1800, "steps": 100, "lr": 3e-3,
    "weight_decay": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "lr_schedule": "cosine",
    "warmup_steps": 10, "grad_clip": None, "dtype": None, "device": None, "seed": 0,
    "no_shuffle": False, "checkpoint_every": 0, "keep_checkpoints": 2, "resume": False,
    "trace": None, "hardware": None, "plan": None, "gpu_memory_cap_gib": None,
    "param_route": None, "grad_route": None, "update_sharding": None, "chunk_mib": None,
    "window_slots": None, "offload_ratio": None, "update_workers": None, "host_bf16_copy": None,
    "skip_nonfinite": 0, "no_save_on_stop": False, "kernels": None, "defer_update": None,
    "grad_widen": None, "embedding_rows": None, "no_step_join": None, "clip_schedule": None,
    "nodes": 1, "internode_reduce": None,
    "moments": None, "no_checkpoint": False,
}
INTS = {"seq", "global_batch", "micro_batch", "nproc", "nodes", "timeout", "steps", "warmup_steps", "seed",
        "checkpoint_every", "keep_checkpoints", "window_slots", "update_workers", "skip_nonfinite"}
FLOATS = {"lr", "weight_decay", "eps", "grad_clip", "chunk_mib", "offload_ratio",
          "gpu_memory_cap_gib"}
BOOLS = {"no_shuffle", "resume", "host_bf16_copy", "no_save_on_stop", "defer_update",
         "embedding_rows", "no_step_join", "no_checkpoint"}
CHOICES = {"lr_schedule": SCHEDULES, "dtype": COMPUTE_DTYPES, "device": DEVICES,
           "kernels": tuple(k.value for k in Kernels),
           "grad_widen": tuple(g.value for g in GradWiden),
           "clip_schedule": tuple(c.value for c in ClipSchedule),
           "internode_reduce": tuple(r.value for r in InternodeReduce),
           "moments": tuple(m.value for m in Moments)}
MIN = {"steps": 1, "checkpoint_every": 0, "keep_checkpoints": 1, "warmup_steps": 0, "seed": 0,
       "skip_nonfinite": 0}
# what may differ from DIR/config.toml on --resume: how the run executes, where, and for how long;
# every other option (the model, the data, the batch, the optimizer and its schedule, the seed,
# the dtype, and any option added later) must keep its value
RESUME_MAY_CHANGE = ("steps", "nproc", "nodes", "internode_reduce", "timeout", "device", "micro_batch", "checkpoint_every",
                     "keep_checkpoints", "trace", "hardware", "plan", "gpu_memory_cap_gib",
                     "param_route", "grad_route", "update_sharding", "chunk_mib", "window_slots",
                     "offload_ratio", "update_workers", "host_bf16_copy", "skip_nonfinite",
                     "no_save_on_stop", "kernels", "defer_update", "grad_widen", "embedding_rows",
                     "no_step_join", "eval_data", "eval_every", "report_to", "no_checkpoint",
                     "clip_schedule")
NOT_SAVED = ("out", "resume")  # options of the invocation, not of the run: not in config.toml
# the data, eval, export and logging options (commands/train_data.py)
DEFAULTS |= train_data.DEFAULTS
INTS |= train_data.INTS
BOOLS |= train_data.BOOLS
CHOICES |= train_data.CHOICES
MIN |= train_data.MIN


def register(sub) -> None:
    p = sub.add_parser("train", help="fine-tune a model with the streaming executor",
                       description=__doc__, argument_default=argparse.SUPPRESS,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="override a config key")
    p.add_argument("--config", help="TOML file of options (keys as the option names)")
    g = p.add_argument_group("run")
    g.add_argument("--model", help="HF model directory or preset (default tiny-qwen3)")
    g.add_argument("--data", help=".npy / .jsonl / .txt file or a bundled set (default tiny-markov)")
    g.add_argument("--out", help="output directory (metrics, checkpoints, final/); required")
    g.add_argument("--seq", type=int, help="sequence length (default 64)")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step (default 16)")
    g.add_argument("--micro-batch", type=int, help="sequences per forward/backward (default 8)")
    g.add_argument("--steps", type=int, help="optimizer steps in all (default 100); on --resume "
                   "the new total: the cosine schedule's horizon becomes it")
    g.add_argument("--nproc", type=int, help="data-parallel rank processes on this host, one per "
                   "GPU (default 1: this process)")
    g.add_argument("--timeout", type=int, help="seconds a rank waits for the others before the "
                   "job fails (default 1800; a failed or dead rank stops the job at once)")
    g.add_argument("--device", choices=DEVICES, help="default: cuda when available, else cpu")
    g.add_argument("--dtype", choices=COMPUTE_DTYPES,
                   help="compute and export dtype (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--seed", type=int, help="random init and data order (default 0)")
    g.add_argument("--no-shuffle", action="store_true", help="read the data in file order")
    g.add_argument("--hardware", help="preset or TOML for the memory check and --plan auto "
                   "(default: this machine; see below)")
    g.add_argument("--gpu-memory-cap-gib", type=float,
                   help="with --plan auto: GPU memory per GPU the plan may use")
    o = p.add_argument_group("optimizer")
    o.add_argument("--lr", type=float, help="peak learning rate (default 3e-3: the demo's)")
    o.add_argument("--weight-decay", type=float, help="AdamW decoupled decay (default 0.01)")
    o.add_argument("--betas", help="B1,B2 (default 0.9,0.95)")
    o.add_argument("--eps", type=float, help="default 1e-8")
    o.add_argument("--lr-schedule", choices=SCHEDULES, help="after a linear warmup (default cosine)")
    o.add_argument("--warmup-steps", type=int, help="default 10")
    o.add_argument("--grad-clip", type=float,
                   help="clip the global L2 gradient norm to this, exactly as clip_grad_norm_ "
                   "then AdamW: the update waits for the norm and runs by --clip-schedule "
                   "(split, the default: it overlaps the next step); 0: no clipping (the "
                   "default)")
    c = p.add_argument_group("checkpoints and output")
    c.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default 0: "
                   "only after the last step)")
    c.add_argument("--keep-checkpoints", type=int, help="newest checkpoints kept (default 2)")
    c.add_argument("--no-checkpoint", action="store_true", help="write no checkpoint at all, "
                   "only final/ after the last step (a stop signal then saves nothing): for a "
                   "disk that cannot hold the state (12-16 B/param) beside the model")
    c.add_argument("--resume", action="store_true", help="continue from the newest checkpoint "
                   "in --out, with the options of OUT/config.toml (see above)")
    c.add_argument("--trace", help="write the last step's measured Timeline as a Chrome trace")
    c.add_argument("--no-save-on-stop", action="store_true", help="SIGINT / SIGTERM stop at the "
                   "next step boundary without saving a checkpoint")
    c.add_argument("--skip-nonfinite", type=int, metavar="N", help="skip up to N steps whose "
                   "gradient norm is NaN or Inf, state untouched (default 0: stop at the first; "
                   "costs the deferred update, see above)")
    add_network_options(p, train=True)
    train_data.add_options(p)
    add_plan_options(p, auto=True)
    p.set_defaults(func=run)


def _parse_override(item: str) -> tuple[str, object]:
    key, eq, text = item.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or key not in DEFAULTS:
        raise SpecError("command line", item, f"KEY=VALUE with KEY one of {', '.join(DEFAULTS)}")
    try:
        return key, tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return key, text


def _check(key: str, v, where: str):
    """Value `v` of option `key` in its type, or a SpecError naming where it came from."""
    if v is None:
        return v
    if key in INTS:
        bad = isinstance(v, bool) or not isinstance(v, int) or v < MIN.get(key, 1)
        want = f"an integer >= {MIN.get(key, 1)}"
    elif key in FLOATS:
        bad = isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v) \
            or v < 0
        want = "a finite non-negative number"
    elif key in BOOLS:
        bad, want = not isinstance(v, bool), "true or false"
    elif key == "betas":
        pair = v.split(",") if isinstance(v, str) else v
        try:
            pair = [float(b) if isinstance(b, str) else b for b in pair]
        except ValueError:
            pair = None
        bad = not (isinstance(pair, list) and len(pair) == 2
                   and all(isinstance(b, int | float) and not isinstance(b, bool)
                           and math.isfinite(b) for b in pair))
        want = "two finite numbers B1,B2"
        v = v if bad else pair
    else:
        bad = not isinstance(v, str) or (key in CHOICES and v not in CHOICES[key])
        want = f"one of {', '.join(CHOICES[key])}" if key in CHOICES else "a string"
    if bad:
        raise SpecError(where, f"--{key.replace('_', '-')}" if where == "command line" else key,
                        f"{want}, got {v!r}")
    return v


def resolve_options(args: argparse.Namespace) -> dict:
    """defaults < --config file < explicit options < key=value overrides; every value checked.
    With --resume and OUT/config.toml, the saved options replace the defaults, and a changed
    option outside RESUME_MAY_CHANGE is a SpecError naming it."""
    opts = _layered(args, dict(DEFAULTS))
    if opts["out"] is None:
        raise SpecError("command line", "--out", "an output directory (required)")
    if opts["resume"]:
        saved = read_saved_options(Path(opts["out"]))
        if saved is not None:
            opts = _layered(args, DEFAULTS | saved)
            check_resume_changes(saved, opts)
    import torch

    if opts["device"] is None:
        opts["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if opts["device"] == "cuda" and not torch.cuda.is_available():
        raise SpecError("command line", "--device", "cpu: this torch build sees no CUDA device")
    if opts["dtype"] is None:
        opts["dtype"] = "bfloat16" if opts["device"] == "cuda" else "float32"
    opts["betas"] = [float(b) for b in opts["betas"]]
    return opts


def _layered(args: argparse.Namespace, opts: dict) -> dict:
    """`opts` under the --config file, the explicit options and the key=value overrides."""
    if "config" in args:
        data = read_toml(args.config)
        for k, v in data.items():
            k = k.replace("-", "_")
            if k not in DEFAULTS:
                raise SpecError(args.config, k, f"an option name ({', '.join(DEFAULTS)})")
            opts[k] = _check(k, v, args.config)
    for k, v in vars(args).items():
        if k in DEFAULTS and v is not None:
            opts[k] = _check(k, v, "command line")
    for item in getattr(args, "overrides", []):
        k, v = _parse_override(item)
        opts[k] = _check(k, v, f"override {item}")
    opts["grad_clip"] = opts["grad_clip"] or None  # 0 is no clipping: as if not given
    return opts


def read_saved_options(out: Path) -> dict | None:
    """The options in OUT/config.toml, checked; None when the run directory has none."""
    from slidedp.exec.rundir import CONFIG

    path = out / CONFIG
    if not path.is_file():
        return None
    saved = {}
    for k, v in read_toml(path).items():
        if k not in DEFAULTS or k in NOT_SAVED:
            raise SpecError(str(path), k, f"an option name ({', '.join(DEFAULTS)})")
        saved[k] = _check(k, v, str(path))
    return saved


def check_resume_changes(saved: dict, opts: dict) -> None:
    """SpecError naming the first option whose value differs from the saved one and may not."""
    for k in DEFAULTS:
        if k in RESUME_MAY_CHANGE or k in NOT_SAVED:
            continue
        was = saved.get(k, DEFAULTS[k])
        if opts[k] != was:
            raise SpecError("command line", f"--{k.replace('_', '-')}", f"{was!r}, the value the "
                            f"run in {opts['out']} started with (config.toml): on --resume only "
                            "--steps and how the run executes (--nproc, --device, the plan, "
                            f"checkpoint and stop options) may change, got {opts[k]!r}")


def format_config(opts: dict, skip: tuple[str, ...] = ()) -> str:
    """The resolved options as TOML (unset ones left out: they take the plan's defaults)."""
    lines = ["# resolved configuration (usable as --config)"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in opts.items() if v is not None and k not in skip]
    return "\n".join(lines)


def build(opts: dict, source=None):
    """(TrainConfig, ModelSource) from resolved options; SpecErrors name the option or file.
    The workload spans opts["nproc"] ranks (global batch = micro-batch x ranks x accumulation).
    `source`: the model source when already opened (opts["model"]'s)."""
    import torch

    from slidedp.exec.adamw import AdamWConfig
    from slidedp.exec.features.internode import check_runnable
    from slidedp.exec.fused_kernels import resolve as resolve_kernels
    from slidedp.exec.io import open_model_source
    from slidedp.exec.trainer import BASE_HARDWARE, TrainConfig, local_hardware

    if opts["no_checkpoint"] and opts["checkpoint_every"]:
        raise SpecError("command line", "--checkpoint-every", "0 (the default) with "
                        f"--no-checkpoint, which writes none, got {opts['checkpoint_every']}")
    ranks, mb, gb, nodes = opts["nproc"], opts["micro_batch"], opts["global_batch"], opts["nodes"]
    if gb % (mb * ranks * nodes):
        across = f" x nodes = {mb} x {ranks} x {nodes}" if nodes > 1 else f" = {mb} x {ranks}"
        raise SpecError("command line", "global_batch", f"a multiple of micro_batch x nproc"
                        f"{across} = {mb * ranks * nodes}, got {gb}")
    local = ranks * (nodes if is_launcher_side() else 1)  # every node on this host: K x R GPUs
    if opts["device"] == "cuda" and local > torch.cuda.device_count():
        raise SpecError("command line", "--nproc", f"at most the {torch.cuda.device_count()} "
                        f"CUDA devices of this host (one per rank, nproc x nodes), got {local}")
    source = source or open_model_source(opts["model"], seed=opts["seed"])
    ns = argparse.Namespace(**{k: opts[k] for k in (
        "seq", "micro_batch", "global_batch", "plan", "param_route", "grad_route",
        "update_sharding", "chunk_mib", "window_slots", "offload_ratio", "update_workers",
        "host_bf16_copy", "kernels", "defer_update", "grad_widen", "embedding_rows",
        "no_step_join", "clip_schedule", "internode_reduce", "moments")},
        hardware=opts["hardware"] or BASE_HARDWARE, model=opts["model"], gpus=ranks)
    r = resolve(ns)
    resolve_kernels(r.plan.kernels, torch.device(opts["device"]))  # liger off CUDA: exit 2 now
    check_runnable(r.plan, nodes, "command line")
    hw = r.hardware if opts["hardware"] else local_hardware(opts["device"], ranks)
    opt = AdamWConfig(lr=opts["lr"], betas=tuple(opts["betas"]), eps=opts["eps"],
                      weight_decay=opts["weight_decay"], grad_clip=opts["grad_clip"],
                      skip_nonfinite=opts["skip_nonfinite"] > 0)
    sched = LrSchedule(opts["lr_schedule"], opts["lr"], opts["warmup_steps"], opts["steps"])
    cfg = TrainConfig(
        out=Path(opts["out"]), data=opts["data"], seq=opts["seq"],
        global_batch=r.workload.global_batch, micro_batch=mb,
        steps=opts["steps"], optimizer=opt, schedule=sched, dtype=opts["dtype"],
        device=opts["device"], seed=opts["seed"], shuffle=not opts["no_shuffle"],
        checkpoint_every=opts["checkpoint_every"], keep_checkpoints=opts["keep_checkpoints"],
        resume=opts["resume"], trace=Path(opts["trace"]) if opts["trace"] else None,
        plan=plan_for_clipping(r.plan, opts["grad_clip"], opts["skip_nonfinite"]),
        hardware=hw, skip_nonfinite=opts["skip_nonfinite"],
        save_on_stop=not (opts["no_save_on_stop"] or opts["no_checkpoint"]),
        checkpoints=not opts["no_checkpoint"], nodes=nodes,
        **train_data.config_fields(opts))
    return cfg, source


def is_launcher_side() -> bool:
    """True in `slidedp train` itself, False in a rank process."""
    from slidedp.exec.dist import is_rank_process

    return not is_rank_process()


def run(args: argparse.Namespace) -> int:
    from slidedp.exec.dist import is_rank_process
    from slidedp.exec.outcome import RunError
    from slidedp.exec.signals import Stopped, StopSignals, signal_name

    if is_rank_process():  # started by the launch below (or by torchrun directly)
        return run_rank(args)
    with StopSignals("raise") as signals:
        try:
            end = run_here(args, signals)
        except Stopped as s:  # before the training loop
            end = RunEnd(s.exit_code, f"stopped by {signal_name(s.signum)} before training: "
                                      "nothing saved")
        except RunError as e:
            end = RunEnd(1, str(e))
    end.print()
    return end.code


def run_here(args: argparse.Namespace, signals: StopSignals) -> RunEnd:
    """The run of `slidedp train` (not a rank): checks, then training in this process or the
    launch of the rank processes."""
    from slidedp.exec.rundir import RunLock, prepare_out

    opts = resolve_options(args)
    train_data.prepare(opts)
    out = Path(opts["out"])
    created = prepare_out(out)
    lock = RunLock.acquire(out)
    try:
        return _run_locked(opts, out, signals)
    except (SpecError, InfeasiblePlan):
        if created:  # bad input leaves no run directory behind
            lock.release(unlink=True)
            with contextlib.suppress(OSError):
                for name in (PLAN_FILE, REPORT_FILE):  # a plan chosen before the input failed
                    (out / name).unlink(missing_ok=True)
                out.rmdir()
        raise
    finally:
        lock.release()


def _run_locked(opts: dict, out: Path, signals: StopSignals) -> RunEnd:
    from slidedp.exec.dist import launch
    from slidedp.exec.rundir import check_trace, write_config
    from slidedp.exec.trainer import preflight, seq_warning, writing

    if opts["trace"]:
        check_trace(Path(opts["trace"]))
    source = default_choice.settle(opts, precheck_data)  # the first lines: which plan and why
    print(format_config(opts), flush=True)
    if opts["plan"] == AUTO:  # the rank processes below read the chosen plan's file
        source = precheck_data(opts)  # bad data fails now, not after the selection's probes
        opts["plan"] = str(select_plan(opts))
    cfg, source = build(opts, source)
    if opts["nproc"] > 1 or opts["nodes"] > 1:
        train_data.precheck(opts, source.model_dir)  # bad data: one line here, not in every rank
    _, _, host_bytes, _ = preflight(cfg, source, opts["nproc"])
    check_local_nodes(cfg, host_bytes)
    saved = read_saved_options(out) if opts["resume"] else None
    if saved is not None and saved.get("steps", DEFAULTS["steps"]) != opts["steps"]:
        print(f"steps: {opts['steps']} in all (the run started with {saved.get('steps')}); the "
              f"{opts['lr_schedule']} schedule's horizon is now {opts['steps']} steps", flush=True)
    if (warning := seq_warning(cfg, source)) is not None:
        print(f"slidedp train: warning: {warning}", file=sys.stderr, flush=True)
    with writing(out):
        write_config(out, format_config(opts, skip=NOT_SAVED))
    if opts["nproc"] == 1 and opts["nodes"] == 1:
        return train(cfg, source, signals=signals)
    overrides = [f"{k}={json.dumps(v)}" for k, v in opts.items() if v is not None]
    code = launch(opts["nproc"], ["-m", "slidedp.cli", "train", *overrides],
                  env={"OMP_NUM_THREADS": "1"} | dict(os.environ), prog="slidedp train",
                  nodes=opts["nodes"], gpus_per_node=opts["nproc"] if cfg.device == "cuda"
                  else None)
    return RunEnd(code)  # the launcher has printed the job's last line


def check_local_nodes(cfg: TrainConfig, host_bytes: float) -> None:
    """InfeasiblePlan when the --nodes K nodes started on this host, one host state each, do
    not fit its memory together (preflight checked one node's)."""
    K, have = cfg.nodes, cfg.hardware.host.ram_bytes
    if K > 1 and K * host_bytes > have:
        raise InfeasiblePlan(f"host memory of {K} nodes on this host (one host state each)",
                             K * host_bytes, have, f"one node needs {host_bytes / 2**30:.2f} GiB")


def run_rank(args: argparse.Namespace) -> int:
    """A rank process: the Trainer with a DistSession; the job's one-line end goes to the
    launcher's report (printed here when there is no launcher), and the process exits 0 when
    the launcher reports it (exec/dist/launch.py)."""
    from slidedp.exec.dist import DistSession, leave_rank
    from slidedp.exec.dist.launch import LAUNCHER_ENV, watch_parent, write_report
    from slidedp.exec.rundir import RunLock

    watch_parent()
    opts = resolve_options(args)
    train_data.prepare(opts)
    world = int(os.environ["WORLD_SIZE"])
    opts["nproc"] = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    opts["nodes"] = max(1, world // opts["nproc"])
    out, rank = Path(opts["out"]), int(os.environ["RANK"])
    if rank == 0 and LAUNCHER_ENV not in os.environ:  # torchrun started directly: lock here
        RunLock.acquire(out)
    RunLock.hold_rank(out, rank)
    # on the CPU every rank computes: a share of the cores each, of every rank on this host
    # (the launcher's nodes all run here; GPUs: dist/ownership.py)
    here = world if LAUNCHER_ENV in os.environ else opts["nproc"]
    threads = max(1, (os.cpu_count() or 1) // here) if opts["device"] == "cpu" else None
    try:
        session = DistSession(opts["device"], timeout_s=opts["timeout"], num_threads=threads,
                              graceful_stop=True)
    except SpecError as e:  # the nodes' rank counts differ: every rank says so and leaves
        print(f"slidedp train: error: {e}", file=sys.stderr, flush=True)
        write_report(2, str(e))
        leave_rank(2)
    with session as sess:
        cfg, source = build(opts)
        end = train(cfg, source, sess)
    reported = sess.local_rank != 0 or end.line is None or write_report(end.code, end.line)
    if not reported:
        end.print()
    leave_rank(0 if LAUNCHER_ENV in os.environ else end.code)


def precheck_data(opts: dict):
    """The model source, after the data's checks that read no data (train_data.precheck: its
    tokenizer is the model directory's)."""
    from slidedp.exec.io import open_model_source

    source = open_model_source(opts["model"], seed=opts["seed"])
    train_data.precheck(opts, source.model_dir)
    return source


def train(cfg: TrainConfig, source, session: DistSession | None = None,
          signals: StopSignals | None = None) -> RunEnd:
    """Run the Trainer; how the run ended. The lead process (see Trainer) prints and shows the
    progress bar; a second stop signal (raised by `signals`) ends it at once, unsaved."""
    from tqdm import tqdm

    from slidedp.exec.checkpoint import latest_checkpoint
    from slidedp.exec.signals import Stopped, signal_name
    from slidedp.exec.trainer import Trainer

    t0 = time.perf_counter()
    with Trainer(cfg, source, session) as tr:
        lead = tr.lead
        if lead:
            _describe(tr, cfg, source)
        reporter = train_data.reporter(cfg) if lead else None
        first = tr.step
        losses: list[float] = []
        bar = tqdm(total=cfg.steps, initial=first, unit="step", dynamic_ncols=True,
                   disable=not lead)

        def on_step(row: dict) -> None:
            losses.append(row["loss"])
            bar.set_postfix(loss=f"{row['loss']:.4f}", tok_s=f"{row['tokens_per_s']:,.0f}",
                            step_s=f"{row['step_time_s']:.3f}")
            bar.update(1)
            if reporter is not None:
                reporter.log(row)

        try:
            end = tr.run(on_step, signals)
        except Stopped as s:
            newest = latest_checkpoint(cfg.checkpoint_root)
            end = RunEnd(s.exit_code, f"stopped at step {tr.step} by a second "
                         f"{signal_name(s.signum)}, unsaved (newest checkpoint: "
                         f"{newest.name if newest else 'none'})")
        finally:
            bar.close()
            if reporter is not None:
                reporter.close()
    if not lead or end.code != 0:
        return end
    if losses:
        print(f"trained steps {first + 1}..{cfg.steps} in {time.perf_counter() - t0:.1f} s: "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"metrics {cfg.out / 'metrics.jsonl'}; model {cfg.out / 'final'}"
          + (f"; trace {cfg.trace}" if cfg.trace and losses else ""))
    return end


def _describe(tr, cfg: TrainConfig, source) -> None:
    gib = 2**30
    resumed = f"; resuming after step {tr.step}" if tr.step else ""
    ranks = f" x {tr.wl.gpus} ranks" if tr.wl.gpus > 1 else ""
    ranks += f" x {tr.wl.nodes} nodes (a host state each)" if tr.wl.nodes > 1 else ""
    print(f"model {source.where}: {source.spec.total_params():,} parameters; footprint "
          f"{tr.gpu_bytes / gib:.2f} GiB device{ranks}, {tr.host_bytes / gib:.2f} GiB "
          f"host (fits {cfg.hardware.name}){resumed}", flush=True)
    print(f"plan: params {cfg.plan.param_route}, window {cfg.plan.window_slots} slots, "
          f"chunks {cfg.plan.h2d_chunk_mib:g}/{cfg.plan.d2h_chunk_mib:g} MiB, offload r="
          f"{cfg.plan.offload_ratio:g}, {cfg.plan.update_workers} update worker(s)"
          f"{', embedding rows split' if cfg.plan.splits_embedding else ''}; kernels "
          f"{tr.engine.runner.kernels} ({tr.engine.runner.kernels_why})", flush=True)
    print(train_data.data_line(tr.batches.data), flush=True)
