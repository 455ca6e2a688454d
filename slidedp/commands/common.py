"""Options shared by the commands that take a workload and a plan (predict, simulate, sweep, train).

Precedence: built-in defaults < the plan file (--plan) < explicit options. The default workload,
used when nothing is given, is Qwen3-8B at sequence 4096 on the h200x2 preset, micro-batch 4
per GPU on both GPUs.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from slidedp.graph.layout import grad_wire_bytes
from slidedp.spec.elements import FP32_BYTES
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import HardwareSpec, load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import (
    ClipSchedule,
    GradRoute,
    GradWiden,
    InternodeReduce,
    Kernels,
    Moments,
    ParamRoute,
    Plan,
    UpdateSharding,
    default_plan,
    load_plan,
    plan_for_clipping,
)
from slidedp.spec.workload import Workload

if TYPE_CHECKING:
    from slidedp.policy.chooser import Choice

DEFAULTS = {"hardware": "h200x2", "model": "qwen3-8b", "seq": 4096, "micro_batch": 4}
AUTO_SIM = "auto-sim"  # --plan: the default chooser's plan, simulated only (policy/chooser.py)
DEFAULT = "default"  # --plan: the documented default plan (spec/plan.py default_plan)


def add_workload_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--hardware", default=DEFAULTS["hardware"], help="preset name or TOML file (default %(default)s)")
    g.add_argument("--model", default=DEFAULTS["model"], help="preset name, config.json or model directory (default %(default)s)")
    g.add_argument("--seq", type=int, default=DEFAULTS["seq"], help="sequence length (default %(default)s)")
    g.add_argument("--gpus", type=int, help="GPUs used (default: all of the hardware's)")
    g.add_argument("--micro-batch", type=int, default=DEFAULTS["micro_batch"], help="sequences per GPU per micro-step (default %(default)s)")
    g.add_argument("--global-batch", type=int, help="sequences per optimizer step, over every node (default: micro-batch x gpus x nodes)")
    add_network_options(p)


def add_network_options(p: argparse.ArgumentParser, train: bool = False) -> None:
    """--nodes and the NIC's fields (spec/network.py); they override the hardware's [network]."""
    g = p.add_argument_group("nodes and network")
    g.add_argument("--nodes", type=int, help=(
        "nodes of --nproc ranks each, started on this host as separate nodes (torchrun agents, "
        "each with its own host state; default 1)" if train else
        "nodes the job spans, each one host of --hardware (default: the hardware's, else 1)"))
    if train:
        return
    g.add_argument("--nic-gbps", type=float, help="each node's NIC, GB/s per direction "
                   "(400 Gb/s = 50; default: the hardware's [network])")
    g.add_argument("--nic-latency-us", type=float, help="one hop between two nodes, us")
    g.add_argument("--nic-kind", help="rdma or tcp")


def add_plan_options(p: argparse.ArgumentParser, auto: bool = False) -> None:
    g = p.add_argument_group("plan (override the --plan file)")
    g.add_argument("--plan", help="plan TOML file ([plan] table)" + (
        f"; `auto`: AutoPolicy chooses it with real probes (slidedp/commands/autoplan.py); "
        f"`{AUTO_SIM}`: the default chooser's plan, simulated on this machine's profile (or on "
        f"--hardware); `{DEFAULT}`: the documented default plan. Without --plan: {AUTO_SIM} on "
        f"a GPU, {DEFAULT} on a CPU (slidedp/commands/default_choice.py)" if auto else
        f"; `{AUTO_SIM}`: the default chooser's plan on --hardware (the plan options given "
        "stay, the simulator chooses the rest; slidedp/policy/chooser.py); "
        f"`{DEFAULT}` or no --plan: the documented default plan (docs/autopolicy.md)"))
    g.add_argument("--param-route", choices=[e.value for e in ParamRoute])
    g.add_argument("--grad-route", choices=[e.value for e in GradRoute])
    g.add_argument("--update-sharding", choices=[e.value for e in UpdateSharding])
    g.add_argument("--chunk-mib", type=float, help="H2D and D2H chunk size in MiB")
    g.add_argument("--window-slots", type=int)
    g.add_argument("--offload-ratio", type=float)
    g.add_argument("--update-workers", type=int)
    g.add_argument("--host-bf16-copy", action="store_true", default=None,
                   help="keep a BF16 copy on the host written by the update (no cast pass)")
    g.add_argument("--defer-update", action="store_true", default=None,
                   help="hold every update until the whole gradient is on the host, as exact "
                   "gradient clipping needs (train defers whenever it clips)")
    g.add_argument("--clip-schedule", choices=[e.value for e in ClipSchedule],
                   help="how a deferred update (clipping) runs: split (the default: each "
                   "update is cast straight into the next step's forward upload and committed "
                   "in its backward; +2 B/param host memory) or joined (every update after "
                   "the backward, before the next step; +4 B/param; the reference)")
    g.add_argument("--no-step-join", action="store_true",
                   help="let step t+1 start under the version gates alone, without the executor's "
                   "join of every agent at the step boundary (a what-if: the executor joins)")
    g.add_argument("--grad-widen", choices=[e.value for e in GradWiden],
                   help="where a BF16 gradient chunk becomes FP32 for the CPU update: gpu "
                   "(downloaded as FP32; the default) or host (downloaded as BF16, 2 B/param, "
                   "widened by the update: more CPU time)")
    g.add_argument("--embedding-rows", action="store_true",
                   help="update the embedding in two parts, every row during the backward and "
                   "the looked-up rows after it, so that the step boundary carries only those "
                   "(docs/embedding-rows.md)")
    g.add_argument("--internode-reduce", choices=[e.value for e in InternodeReduce],
                   help="with several nodes: all_reduce of each node's aggregated gradient (every "
                   "node updates everything; the executor's) or reduce_scatter + all-gather of "
                   "the new BF16 weights (each node updates 1/K; predicted only)")
    g.add_argument("--kernels", choices=[e.value for e in Kernels],
                   help="the layers' and the LM head's kernels: eager (transformers' own), liger "
                   "(liger-kernel's fused ones, CUDA only) or auto (the default: liger on CUDA "
                   "where liger-kernel imports, else eager; exec/fused_kernels.py)")
    g.add_argument("--moments", choices=[e.value for e in Moments],
                   help="the Adam moments on the host: fp32 (the default, 8 B/param), bf16 "
                   "(4 B/param) or int8 (block-wise 8-bit, ~2 B/param); the master stays FP32")


def add_clip_option(p: argparse.ArgumentParser) -> None:
    """--grad-clip X of predict, simulate and plan (train has its own, in its optimizer group)."""
    p.add_argument("--grad-clip", type=float, metavar="X",
                   help="the plan of an optimizer that clips the global gradient norm to X, as "
                   "`slidedp train --grad-clip X` runs it (spec/plan.py plan_for_clipping: every "
                   "update deferred, by --clip-schedule); 0: no clipping, as without the option")


def grad_clip(value: float | None, where: str = "command line",
              field: str = "--grad-clip") -> float | None:
    """A max gradient norm checked: a finite number >= 0; 0 is no clipping (None), as in
    DeepSpeed and HF Trainer."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) \
            or value < 0:
        raise SpecError(where, field, f"a finite number >= 0 (0: no clipping), got {value!r}")
    return float(value) or None


@dataclass(frozen=True)
class Resolved:
    hardware: HardwareSpec
    workload: Workload
    plan: Plan
    choice: Choice | None = None  # --plan auto-sim: the default chooser's choice


# The smallest chunk a command accepts (--chunk-mib, and a plan file's h2d_chunk_mib /
# d2h_chunk_mib). A chunk is one DMA copy and one task of the graph per slice of a unit: below
# 1 MiB a PCIe copy is dominated by its fixed cost (some microseconds to issue and complete,
# against ~40 us to move 1 MiB at 25 GB/s), and the graph's task count grows as the model's bytes
# over the chunk (an 8B model's BF16 upload at 1 MiB is 16k tasks per rank; at 1e-6 MiB it would
# be 1.6e10, which no memory holds). Plans built in code (tests on tiny models) may go smaller.
MIN_CHUNK_MIB = 1.0


def check_chunk_mib(plan: Plan, where: str) -> None:
    """SpecError naming `where` when a chunk of `plan` is below MIN_CHUNK_MIB."""
    for field in ("h2d_chunk_mib", "d2h_chunk_mib"):
        got = getattr(plan, field)
        if got < MIN_CHUNK_MIB:
            name = "--chunk-mib" if where == "command line" else field
            raise SpecError(where, name, f"at least {MIN_CHUNK_MIB:g} MiB (smaller chunks "
                            f"only multiply copies and tasks), got {got:g}")


def positive(value, option: str):
    if value is not None and value < 1:
        raise SpecError("command line", option, f"a positive integer, got {value}")
    return value


def resolve_workload(args: argparse.Namespace, hw: HardwareSpec) -> Workload:
    """The workload of the workload options on hardware `hw` (SpecErrors name the option); it
    spans hw.network.nodes nodes."""
    model = load_model(args.model)
    gpus = positive(args.gpus, "--gpus") or hw.gpu.count
    mb = positive(args.micro_batch, "--micro-batch")
    nodes = hw.network.nodes
    gb = positive(args.global_batch, "--global-batch") or mb * gpus * nodes
    positive(args.seq, "--seq")
    return Workload(model, args.seq, gb, mb, gpus, where="command line", nodes=nodes)


def with_network(hw: HardwareSpec, args: argparse.Namespace) -> HardwareSpec:
    """`hw` with the network options (spec/network.py), checked."""
    net = hw.network.with_options(
        getattr(args, "nodes", None), getattr(args, "nic_gbps", None),
        getattr(args, "nic_latency_us", None), getattr(args, "nic_kind", None))
    return replace(hw, network=net)


def with_plan_options(plan: Plan, args: argparse.Namespace) -> Plan:
    """`plan` with the plan options given (SpecErrors name the option)."""
    over = {"param_route": args.param_route and ParamRoute(args.param_route),
            "grad_route": args.grad_route and GradRoute(args.grad_route),
            "update_sharding": args.update_sharding and UpdateSharding(args.update_sharding),
            "h2d_chunk_mib": args.chunk_mib, "d2h_chunk_mib": args.chunk_mib,
            "window_slots": args.window_slots, "offload_ratio": args.offload_ratio,
            "update_workers": args.update_workers, "host_bf16_copy": args.host_bf16_copy,
            "defer_update": getattr(args, "defer_update", None),  # train's options lack it
            "clip_schedule": getattr(args, "clip_schedule", None) and ClipSchedule(
                args.clip_schedule),
            "step_join": False if getattr(args, "no_step_join", False) else None,
            "embedding_rows": True if getattr(args, "embedding_rows", False) else None,
            "grad_widen": getattr(args, "grad_widen", None) and GradWiden(args.grad_widen),
            "internode_reduce": getattr(args, "internode_reduce", None)
            and InternodeReduce(args.internode_reduce),
            "kernels": getattr(args, "kernels", None) and Kernels(args.kernels),
            "moments": getattr(args, "moments", None) and Moments(args.moments)}
    try:
        return plan.with_overrides(**over)
    except SpecError as e:
        raise SpecError("command line", f"--{e.field.replace('_', '-')}", e.expected) from None


def fixed_fields(args: argparse.Namespace) -> frozenset[str]:
    """The fields of policy/routes.py FIXABLE that the options given set: a chooser keeps them."""
    from slidedp.policy.routes import FIXABLE  # the simulator's imports only where a plan is chosen

    return frozenset(f for f in FIXABLE if getattr(args, f, None) is not None)


def resolve(args: argparse.Namespace) -> Resolved:
    """Specs from the options; every failure is a SpecError naming the option or file. With
    --plan auto-sim, the default chooser's plan (policy/chooser.py) on --hardware, with the
    options given kept fixed."""
    hw = with_network(load_hardware(args.hardware), args)
    wl = resolve_workload(args, hw)
    chooser = args.plan == AUTO_SIM
    given = args.plan not in (None, DEFAULT, AUTO_SIM)  # a plan file
    plan = load_plan(args.plan) if given else default_plan(hw.fabric.kind)
    plan = with_plan_options(plan, args)
    plan = plan_for_clipping(plan, grad_clip(getattr(args, "grad_clip", None)))  # train: its own
    where = str(args.plan) if given and args.chunk_mib is None else "command line"
    check_chunk_mib(plan, where)
    if not chooser:
        return Resolved(hw, wl, plan)
    from slidedp.policy.chooser import choose

    choice = choose(hw, wl, plan, fixed_fields(args), hw.gpu.hbm_bytes)
    return Resolved(hw, wl, choice.plan, choice)


def describe_workload(hw: HardwareSpec, w: Workload) -> str:
    """Hardware and workload in one line."""
    nodes = f"{w.nodes} nodes x " if w.nodes > 1 else ""
    return (f"{hw.name} | {w.model.name} seq {w.seq_len} | {nodes}{w.gpus} GPU x micro-batch "
            f"{w.micro_batch} x accum {w.accum_steps} = global batch {w.global_batch}")


def describe(r: Resolved) -> str:
    """The resolved configuration in one line (printed at start)."""
    p = r.plan
    return (f"{describe_workload(r.hardware, r.workload)} | "
            f"params {p.param_route}, grads {p.grad_route}, update {p.update_sharding} | chunks "
            f"{p.h2d_chunk_mib:g}/{p.d2h_chunk_mib:g} MiB | window {p.window_slots} | "
            f"offload r={p.offload_ratio:g}"
            f"{f' | update deferred, {p.clip_schedule}' if p.defer_update else ''}"
            f"{' | embedding rows split' if p.splits_embedding else ''} | gradients widened "
            f"on the {_widened_on(p, r.workload.gpus)} | kernels {p.kernels} | moments {p.moments}")


def print_choice(r: Resolved) -> None:
    """The default chooser's summary, where --plan auto-sim chose the plan."""
    if r.choice is not None:
        print("\n".join(r.choice.summary(r.hardware.name)))


def with_choice(d: dict, r: Resolved) -> dict:
    """A command's JSON with the default chooser's choice under "plan_choice" (--plan auto-sim)."""
    return d if r.choice is None else d | {"plan_choice": r.choice.to_json()}


def _widened_on(p: Plan, ranks: int) -> str:
    """Where a gradient chunk becomes FP32: the host where BF16 comes down (grad_widen = host,
    or the split clipping schedule's held gradient), else the GPU."""
    return "gpu" if grad_wire_bytes(p, ranks) == FP32_BYTES else "host"
