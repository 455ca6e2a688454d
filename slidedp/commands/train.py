"""`slidedp train`: full-parameter fine-tuning with the streaming executor (exec/trainer.py).

Options come from built-in defaults < a config file (--config FILE.toml: top-level keys named
as the options, with underscores, e.g. `global_batch = 16`, `betas = [0.9, 0.95]`) < explicit
options < `key=value` overrides (values parsed as TOML, else taken as strings). The resolved
configuration is printed at start as a TOML table that --config accepts back.
The defaults train the tiny-qwen3 preset on the bundled tiny-markov data (seq 64) for 100 steps
(a few seconds on a CPU); for a real model set at least --model, --data, --seq and --lr.

--plan auto: AutoPolicy chooses the plan first (commands/autoplan.py: hardware, cap, probes)
and writes OUT/plan.toml and OUT/plan-report.txt.

--nproc R > 1 trains data-parallel in R rank processes on this host (GPUs: NCCL, one GPU each;
CPU: gloo): this process checks the options, the fit and --out (bad input: one line, exit 2),
then starts the ranks with torchrun (exec/dist/launch.py), passing them the resolved options,
and returns torchrun's exit status. Each rank (is_rank_process()) runs the Trainer with a
DistSession; local rank 0 prints and writes the output. A rank that fails stops the others
(the watchdog of exec/dist/session.py): "slidedp rank R: failed: <cause>", nonzero exit.
"""

from __future__ import annotations

import argparse
import json
import os
import time
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING

from slidedp.commands import train_data
from slidedp.commands.autoplan import AUTO, select_plan
from slidedp.commands.common import add_plan_options, resolve
from slidedp.exec.dtypes import COMPUTE_DTYPES
from slidedp.exec.schedule import SCHEDULES, LrSchedule
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import Kernels
from slidedp.spec.tomlio import read_toml

if TYPE_CHECKING:
    from slidedp.exec.dist import DistSession
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
    "kernels": None,
}
INTS = {"seq", "global_batch", "micro_batch", "nproc", "timeout", "steps", "warmup_steps", "seed",
        "checkpoint_every", "keep_checkpoints", "window_slots", "update_workers"}
FLOATS = {"lr", "weight_decay", "eps", "grad_clip", "chunk_mib", "offload_ratio",
          "gpu_memory_cap_gib"}
BOOLS = {"no_shuffle", "resume", "host_bf16_copy"}
CHOICES = {"lr_schedule": SCHEDULES, "dtype": COMPUTE_DTYPES, "device": DEVICES,
           "kernels": tuple(k.value for k in Kernels)}
MIN = {"steps": 1, "checkpoint_every": 0, "keep_checkpoints": 1, "warmup_steps": 0, "seed": 0}
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
    g.add_argument("--steps", type=int, help="optimizer steps in all (default 100)")
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
                   help="clip the global L2 gradient norm to this (exact: defers the update)")
    c = p.add_argument_group("checkpoints and output")
    c.add_argument("--checkpoint-every", type=int, help="steps between checkpoints (default 0: "
                   "only after the last step)")
    c.add_argument("--keep-checkpoints", type=int, help="newest checkpoints kept (default 2)")
    c.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    c.add_argument("--trace", help="write the last step's measured Timeline as a Chrome trace")
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
        bad = isinstance(v, bool) or not isinstance(v, int | float) or v < 0
        want = "a non-negative number"
    elif key in BOOLS:
        bad, want = not isinstance(v, bool), "true or false"
    elif key == "betas":
        pair = v.split(",") if isinstance(v, str) else v
        try:
            pair = [float(b) if isinstance(b, str) else b for b in pair]
        except ValueError:
            pair = None
        bad = not (isinstance(pair, list) and len(pair) == 2
                   and all(isinstance(b, int | float) and not isinstance(b, bool) for b in pair))
        want = "two numbers B1,B2"
        v = v if bad else pair
    else:
        bad = not isinstance(v, str) or (key in CHOICES and v not in CHOICES[key])
        want = f"one of {', '.join(CHOICES[key])}" if key in CHOICES else "a string"
    if bad:
        raise SpecError(where, f"--{key.replace('_', '-')}" if where == "command line" else key,
                        f"{want}, got {v!r}")
    return v


def resolve_options(args: argparse.Namespace) -> dict:
    """defaults < --config file < explicit options < key=value overrides; every value checked."""
    opts = dict(DEFAULTS)
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
    if opts["out"] is None:
        raise SpecError("command line", "--out", "an output directory (required)")
    import torch

    if opts["device"] is None:
        opts["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    if opts["device"] == "cuda" and not torch.cuda.is_available():
        raise SpecError("command line", "--device", "cpu: this torch build sees no CUDA device")
    if opts["dtype"] is None:
        opts["dtype"] = "bfloat16" if opts["device"] == "cuda" else "float32"
    opts["betas"] = [float(b) for b in opts["betas"]]
    return opts


def format_config(opts: dict) -> str:
    """The resolved options as TOML (unset ones left out: they take the plan's defaults)."""
    lines = ["# resolved configuration (usable as --config)"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in opts.items() if v is not None]
    return "\n".join(lines)


def build(opts: dict, source=None):
    """(TrainConfig, ModelSource) from resolved options; SpecErrors name the option or file.
    The workload spans opts["nproc"] ranks (global batch = micro-batch x ranks x accumulation).
    `source`: the model source when already opened (opts["model"]'s)."""
    import torch

    from slidedp.exec.adamw import AdamWConfig
    from slidedp.exec.io import open_model_source
    from slidedp.exec.kernels import resolve as resolve_kernels
    from slidedp.exec.trainer import BASE_HARDWARE, TrainConfig, local_hardware

    ranks, mb, gb = opts["nproc"], opts["micro_batch"], opts["global_batch"]
    if gb % (mb * ranks):
        raise SpecError("command line", "global_batch", f"a multiple of micro_batch x nproc = "
                        f"{mb} x {ranks} = {mb * ranks}, got {gb}")
    if opts["device"] == "cuda" and ranks > torch.cuda.device_count():
        raise SpecError("command line", "--nproc", f"at most the {torch.cuda.device_count()} "
                        f"CUDA devices of this host (one per rank), got {ranks}")
    source = source or open_model_source(opts["model"], seed=opts["seed"])
    ns = argparse.Namespace(**{k: opts[k] for k in (
        "seq", "micro_batch", "global_batch", "plan", "param_route", "grad_route",
        "update_sharding", "chunk_mib", "window_slots", "offload_ratio", "update_workers",
        "host_bf16_copy", "kernels")}, hardware=opts["hardware"] or BASE_HARDWARE, model=opts["model"],
        gpus=ranks)
    r = resolve(ns)
    resolve_kernels(r.plan.kernels, torch.device(opts["device"]))  # liger off CUDA: exit 2 now
    hw = r.hardware if opts["hardware"] else local_hardware(opts["device"], ranks)
    opt = AdamWConfig(lr=opts["lr"], betas=tuple(opts["betas"]), eps=opts["eps"],
                      weight_decay=opts["weight_decay"], grad_clip=opts["grad_clip"])
    sched = LrSchedule(opts["lr_schedule"], opts["lr"], opts["warmup_steps"], opts["steps"])
    cfg = TrainConfig(
        out=Path(opts["out"]), data=opts["data"], seq=opts["seq"],
        global_batch=r.workload.global_batch, micro_batch=mb,
        steps=opts["steps"], optimizer=opt, schedule=sched, dtype=opts["dtype"],
        device=opts["device"], seed=opts["seed"], shuffle=not opts["no_shuffle"],
        checkpoint_every=opts["checkpoint_every"], keep_checkpoints=opts["keep_checkpoints"],
        resume=opts["resume"], trace=Path(opts["trace"]) if opts["trace"] else None,
        plan=r.plan.with_overrides(defer_update=True if opts["grad_clip"] else None), hardware=hw,
        **train_data.config_fields(opts))
    return cfg, source


def run(args: argparse.Namespace) -> int:
    from slidedp.exec.dist import DistSession, is_rank_process, launch, leave_rank
    from slidedp.exec.trainer import preflight

    opts = resolve_options(args)
    train_data.prepare(opts)
    if is_rank_process():  # started by the launch below (or by torchrun directly)
        opts["nproc"] = int(os.environ["WORLD_SIZE"])
        # on the CPU every rank computes: a share of the cores each (GPUs: dist/ownership.py)
        threads = (max(1, (os.cpu_count() or 1) // opts["nproc"]) if opts["device"] == "cpu"
                   else None)
        with DistSession(opts["device"], timeout_s=opts["timeout"], num_threads=threads) as sess:
            cfg, source = build(opts)
            rc = train(cfg, source, sess)
        leave_rank(rc)
    print(format_config(opts), flush=True)
    source = None
    if opts["plan"] == AUTO:  # the rank processes below read the chosen plan's file
        source = precheck_data(opts)  # bad data fails now, not after the selection's probes
        opts["plan"] = str(select_plan(opts))
    cfg, source = build(opts, source)
    if opts["nproc"] == 1:
        return train(cfg, source)
    train_data.precheck(opts, source.model_dir)  # bad data: one line here, not in every rank
    preflight(cfg, source, opts["nproc"])
    overrides = [f"{k}={json.dumps(v)}" for k, v in opts.items() if v is not None]
    return launch(opts["nproc"], ["-m", "slidedp.cli", "train", *overrides],
                  env={"OMP_NUM_THREADS": "1"} | dict(os.environ))


def precheck_data(opts: dict):
    """The model source, after the data's checks that read no data (train_data.precheck: its
    tokenizer is the model directory's)."""
    from slidedp.exec.io import open_model_source

    source = open_model_source(opts["model"], seed=opts["seed"])
    train_data.precheck(opts, source.model_dir)
    return source


def train(cfg: TrainConfig, source, session: DistSession | None = None) -> int:
    """Run the Trainer; the lead process (see Trainer) prints and shows the progress bar."""
    from tqdm import tqdm

    from slidedp.exec.trainer import Trainer

    t0 = time.perf_counter()
    with Trainer(cfg, source, session) as tr:
        lead = tr.lead
        gib = 2**30
        resumed = f"; resuming after step {tr.step}" if tr.step else ""
        ranks = f" x {tr.wl.gpus} ranks" if tr.wl.gpus > 1 else ""
        if lead:
            print(f"model {source.where}: {source.spec.total_params():,} parameters; footprint "
                  f"{tr.gpu_bytes / gib:.2f} GiB device{ranks}, {tr.host_bytes / gib:.2f} GiB "
                  f"host (fits {cfg.hardware.name}){resumed}", flush=True)
            print(f"plan: params {cfg.plan.param_route}, window {cfg.plan.window_slots} slots, "
                  f"chunks {cfg.plan.h2d_chunk_mib:g}/{cfg.plan.d2h_chunk_mib:g} MiB, offload r="
                  f"{cfg.plan.offload_ratio:g}, {cfg.plan.update_workers} update worker(s)"
                  f"{', embedding rows split' if cfg.plan.splits_embedding else ''}; kernels "
                  f"{tr.engine.runner.kernels} ({tr.engine.runner.kernels_why})", flush=True)
            print(train_data.data_line(tr.batches.data), flush=True)
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
            tr.run(on_step)
        finally:
            bar.close()
            if reporter is not None:
                reporter.close()
    if not lead:
        return 0
    if losses:
        print(f"trained steps {first + 1}..{cfg.steps} in {time.perf_counter() - t0:.1f} s: "
              f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"metrics {cfg.out / 'metrics.jsonl'}; model {cfg.out / 'final'}"
          + (f"; trace {cfg.trace}" if cfg.trace and losses else ""))
    return 0
