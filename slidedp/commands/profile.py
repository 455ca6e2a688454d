"""`slidedp profile`: measure the machine at hand and write a hardware TOML (slidedp/profile/).

What this machine cannot measure (no CUDA: GPU, PCIe, fabric; datasheet figures; one GPU: the
fabric) comes from --base, and its source says so; without --base that is an error naming what
is missing, raised before anything is measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

from slidedp.commands.common import DEFAULTS, positive
from slidedp.profile import sizes as sizes_mod
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model


def register(sub) -> None:
    p = sub.add_parser("profile", help="measure this machine, write a hardware TOML",
                       description="Microbenchmarks of this machine (host DRAM, cast and CPU "
                       "Adam against threads; the cast by chunk size; PCIe by chunk size, duplex and "
                       "all GPUs; one decoder layer's compute, short and sustained; NCCL "
                       "collectives) written as a hardware TOML "
                       "in which every number names its source, and every round's sample of the "
                       "host rates beside it (OUT with the suffix .rounds.json).")
    p.add_argument("--out", required=True, help="hardware TOML file to write")
    p.add_argument("--model", nargs="+", default=[DEFAULTS["model"]],
                   help="preset names, config.json files or model directories whose decoder "
                   "layer is timed (CUDA only; default %(default)s)")
    p.add_argument("--seq", type=int, nargs="+", default=[DEFAULTS["seq"]],
                   help="sequence lengths of the layer timing (default %(default)s)")
    p.add_argument("--micro-batch", type=int, nargs="+",
                   help="micro-batches of the layer timing (default 1 4 16; --quick 1 4; "
                   "--chooser 4)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help="fewer sizes and threads")
    size.add_argument("--chooser", action="store_true", help="the default chooser's profile "
                      "(`slidedp train` on a GPU without --plan): 3 host rounds at 1 thread, the "
                      "team size and all cores; give the workload's --model, --seq and "
                      "--micro-batch (default 4)")
    p.add_argument("--host-rounds", type=int, help="rounds of the host rates over the thread "
                   "counts, each on fresh buffers (default: 7 with --quick, else 9); more on a "
                   "machine whose host speed varies with where its memory lands")
    p.add_argument("--name", help="the hardware's name (default: the --out file's stem)")
    p.add_argument("--base", help="hardware preset or TOML for what this machine cannot measure")
    p.set_defaults(func=run)


def command_line(args: argparse.Namespace, micro_batches: tuple[int, ...], name: str) -> str:
    """The resolved options, as a command line."""
    line = (f"slidedp profile --out {args.out} --model {' '.join(args.model)} --seq "
            f"{' '.join(map(str, args.seq))} --micro-batch {' '.join(map(str, micro_batches))} "
            f"--name {name}")
    return (line + (" --quick" if args.quick else "") + (" --chooser" if args.chooser else "")
            + (f" --host-rounds {args.host_rounds}" if args.host_rounds else "")
            + (f" --base {args.base}" if args.base else ""))


def run(args: argparse.Namespace) -> int:
    # torch and transformers load here, not when the CLI starts
    from slidedp.profile.machine import probe_machine
    from slidedp.profile.measure import measure, request
    from slidedp.profile.summary import summary

    for v in args.seq:
        positive(v, "--seq")
    for v in args.micro_batch or ():
        positive(v, "--micro-batch")
    sizes = (sizes_mod.CHOOSER if args.chooser else sizes_mod.QUICK if args.quick
             else sizes_mod.FULL)
    if positive(args.host_rounds, "--host-rounds"):
        sizes = dataclasses.replace(sizes, host_rounds=args.host_rounds)
    micro_batches = tuple(args.micro_batch or sizes.micro_batches)
    name = args.name or Path(args.out).stem
    base = load_hardware(args.base) if args.base else None
    models = tuple(load_model(m) for m in args.model)
    machine = probe_machine()
    req, missing = request(machine, sizes, models, tuple(args.seq), micro_batches, base)

    cmd = command_line(args, micro_batches, name)
    print(cmd)
    print(f"{machine.hostname}: {machine.cpu_model}, {machine.cores} cores, {machine.gpus()}")
    if missing:
        print(f"from {base.origin}, not measurable here: "
              + "; ".join(f"{k} ({why})" for k, why in missing.items()))
    prof = measure(machine, req, base, name, cmd, args.out)
    Path(args.out).write_text(prof.text)
    rounds = rounds_path(args.out)
    rounds.write_text(json.dumps({"hardware": name, "command": cmd, "units": ROUNDS_UNITS,
                                  "samples": prof.results.host_rounds.rows()}, indent=1) + "\n")
    print(summary(req, prof.results, prof.spec, args.out))
    print(f"every round's sample of the host rates: {rounds}")
    print(f"profiled in {prof.wall_s:.1f} s")
    return 0


ROUNDS_UNITS = ("copy, teams, teams cast (the cast team's part of teams), teams with dma, "
                "teams beside dma (the teams' part of teams with dma): bytes/s; cast, cast chunk: "
                "elements/s; adam, adam bf16 grad: parameters/s; dma weight: bytes of the teams' "
                "traffic lost per copied byte; where: threads (cast chunk: chunk BF16 bytes, "
                "threads; teams, teams cast: cast threads, update threads; teams with dma, teams "
                "beside dma, dma weight: cast threads, update threads, GPUs)")


def rounds_path(out: str) -> Path:
    """Where `slidedp profile --out OUT` keeps every round's host samples: beside OUT, its
    suffix replaced by .rounds.json."""
    return Path(out).with_suffix(".rounds.json")
