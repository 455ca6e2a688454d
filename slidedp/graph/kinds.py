"""Rules per task kind, in one table: who runs it, how long it takes, what it loads.

KINDS[kind] is a KindRule; graph/costs.py (task_durations, resource_use), the simulator
(sim/resources.py), the traffic sums (model/traffic.py), the reports and the executor's template
read it, never a ladder of their own over kinds:
    channel     its logical channel (method.md section 4)
    agent       the agent kind that runs it (tasks.AGENT_KINDS): gpu{r}.compute, gpu{r}.h2d,
                gpu{r}.d2h, fabric, cpu.cast{w}, cpu.update{w}
    work        the unit of TaskGraph.work
    seconds     its duration alone on its agent at the full rate of its resources, for the tasks
                idx of the kind: seconds(c: KindInputs, idx) -> array (the rules below)
    load        how it loads the machine: GPU (its rank's compute stream), H2D / D2H (a copy
                between the host and its rank's GPU), CPU (a kernel of a team of threads on the
                host's cores and memory), COLLECTIVE (over the GPU fabric), NIC (over the node's
                network interface, both directions: graph/nic.py adds it to every machine)
    team        CPU kinds: the team share it runs at (sizes.team_share of the cast team or of an
                update worker's team: a team larger than the cores left to it waits on its
                preempted threads); None: 1
    dram_bytes  CPU kinds: host-memory bytes per unit of work, dram_bytes(g, hw)
    rate        CPU kinds: its rate against threads, rate(hw, g, threads, work), which the
                simulator shares the cores by (None: linear in threads)
    weight      its weight on a saturated resource in the simulator, weight(hw, g) (None: 1)

Durations (rates.py holds the shared helpers):
  FWD / BWD     rates.layer_times_s: the measured layer time for the shape, else FLOPs / the
                achieved rate
  RECOMPUTE     rates.recompute_s: fwd time x the policy's share of the forward's work
  HEAD_LOSS     FLOPs / achieved rate;  EMBED_FWD / EMBED_BWD  bytes / HBM rate
  H2D, ACT_RELOAD  bytes / per-GPU H2D rate;  D2H, ACT_OFFLOAD  bytes / per-GPU D2H rate
  CAST          elements / (cast rate(threads, chunk) x share): the hardware's rate for a chunk of
                the task's elements where it has host.cast_chunk_gelem_per_s (measured by chunk
                size into a pinned ring, interpolated in log chunk size), else its thread curve
                (HostSpec.cast_rate)
  ADAM          parameters / (Adam rate(threads, gradient bytes) x share); with host_bf16_copy
                (GraphMeta.adam_writes_copy) each ADAM also writes the BF16 copy from the updated
                master, a cast pass of its chunk by the update worker's team (engine._run_adam):
                + elements / (cast rate x share) and the cast's DRAM bytes
  UPDATE_CAST   parameters / (Adam rate(threads, gradient bytes) x its DRAM bytes ratio x share):
                a pending AdamW of the chunk computed in cache and written as BF16 only
                (features/split_update.py), reading what an ADAM reads and writing 2 B instead
                of the FP32 master and moments; Adam's rate on this host is bound by the bytes it
                moves, so it runs at Adam's rate x (ADAM's DRAM bytes / its own) (an estimate
                until profiled: rates.update_cast_dram_bytes)
  HOST_SUM      bytes / host DRAM rate (rates.dram_bps)
  ALLGATHER, REDUCE  the fabric's collective time (ring bytes / bus rate + latency)
CAST and ADAM also get the executor's dispatch cost per task on its CPU agent where measured
(HostSpec.task_gap_s, profile/agents.py; rates.task_gaps_s): it delays the task on its agent by
that much, with the team's cores idle (host.cores counts the kernel's time only). The simulator
runs the gap at the task's contended speed s, stretching it by 1/s.

The machine (resource draws). Every task's draws on shared resources come from one function of
(hardware, task): Machine.draws(t: TaskLoad) -> [(resource name, amount)], amount in the
resource's units (capacity per second). The analytic lower bound sums the draws per resource;
the simulator shares each resource between the tasks drawing on it at once. A Machine is made
from (hw, g) by the first factory of graph/costs.py MACHINES that accepts the hardware spec and
has:
    names       its resource names, in a fixed order
    capacity    {name: capacity per second}
    draws(t)    the task's draws: a copy's along its path (link, switch, root port, socket
                memory), a CPU kernel's on the cores and memory it runs on, a collective's on the
                fabric; t carries the task id, so a machine may read anything else of the graph
    slowdowns   the copies' slowdown of the CPU kernels, one (S, copy_traffic, kernel_dram)
                per memory where measured (HostSpec.dma_slowdown_bps): S in bytes/s, the
                resource the copies' bytes of that memory are drawn on and the CPU kernels' cap
                on it that the slowdown scales; [] where none
Names every machine keeps, as the simulator and the reports read them: gpu{r}.compute is GPU r's
compute stream (capacity 1, drawn in seconds), and a core pool is a resource named `*.cores`
(drawn in core-seconds; the simulator shares it by threads). flat_host.FlatHost is the flat
hardware spec's machine; a host topology is another one, registered ahead of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import cached_property
from typing import NamedTuple, Protocol

import numpy as np

from slidedp.graph.rates import (
    adam_dram_bytes,
    dram_bps,
    layer_times_s,
    recompute_s,
    update_cast_dram_bytes,
)
from slidedp.graph.tasks import AGENT_KINDS, COLLECTIVE_OPS, Channel, GraphMeta, Kind, TaskGraph
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.workload import Workload


class Load(Enum):
    """How a task loads the machine (KindRule.load)."""

    GPU = "gpu"
    H2D = "h2d"
    D2H = "d2h"
    CPU = "cpu"
    COLLECTIVE = "collective"
    NIC = "nic"


class TaskLoad(NamedTuple):
    """What Machine.draws sees of one task."""

    task: int  # its id in the graph
    kind: Kind
    load: Load
    rank: int  # its GPU (-1: a host or fabric task)
    work: float  # TaskGraph.work: bytes for copies and collectives
    seconds: float  # its duration alone (task_durations)
    dram_bytes: float  # CPU kinds: host-memory bytes it moves (0 otherwise)
    core_s: float  # CPU kinds: core-seconds its team holds while its kernel runs (0 otherwise)


class Machine(Protocol):
    """The shared resources of a machine and each task's draws on them (module docstring)."""

    names: list[str]
    capacity: dict[str, float]
    slowdowns: list[tuple[float, str, str]]

    def draws(self, t: TaskLoad) -> list[tuple[str, float]]: ...


class KindInputs:
    """What the duration rules read: the graph, the hardware, the workload and the team shares."""

    def __init__(self, g: TaskGraph, hw: HardwareSpec, wl: Workload):
        self.g, self.hw, self.wl = g, hw, wl
        self.share = task_core_share(g)

    @cached_property
    def layer_s(self) -> dict[str, float]:
        return layer_times_s(self.hw, self.wl, self.g.meta.kernels)

    def cast_s(self, idx: np.ndarray) -> np.ndarray:
        """A cast of each task's elements by its team."""
        g, host = self.g, self.hw.host
        rates = [host.cast_rate(t, e) for t, e in zip(g.threads[idx], g.work[idx], strict=True)]
        return g.work[idx] / (np.array(rates) * self.share[idx])


@dataclass(frozen=True)
class KindRule:
    channel: Channel
    agent: str
    work: str
    seconds: Callable[[KindInputs, np.ndarray], np.ndarray]
    load: Load
    team: Callable[[GraphMeta], float] | None = None
    dram_bytes: Callable[[TaskGraph, HardwareSpec], float] | None = None
    rate: Callable[[HardwareSpec, TaskGraph, float, float], float] | None = None
    weight: Callable[[HardwareSpec, TaskGraph], float] | None = None

    def __post_init__(self):
        if self.agent not in AGENT_KINDS:
            raise ValueError(f"agent kind {self.agent!r}: one of {AGENT_KINDS}")


# ---- duration rules (module docstring)
def _fwd_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return np.full(len(idx), c.layer_s["fwd"])


def _bwd_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return np.full(len(idx), c.layer_s["bwd"])


def _recompute_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return recompute_s(c.g, c.hw, c.wl, idx)


def _head_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return c.g.work[idx] / c.hw.gpu.achieved_flops(c.wl.model.hidden, c.wl.tokens_per_micro_batch)


def _hbm_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return c.g.work[idx] / c.hw.gpu.hbm_bps


def _h2d_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return c.g.work[idx] / c.hw.pcie.h2d_bps


def _d2h_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return c.g.work[idx] / c.hw.pcie.d2h_bps


def _cast_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return c.cast_s(idx)


def _adam_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    g, host = c.g, c.hw.host
    rates = np.array([host.adam_rate(t, g.meta.grad_wire_bytes, g.meta.moments)
                      for t in g.threads[idx]])
    s = g.work[idx] / (rates * c.share[idx])
    return s + c.cast_s(idx) if g.meta.adam_writes_copy else s


def _update_cast_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    g = c.g
    rates = np.array([_update_cast_rate(c.hw, g, t, 0.0) for t in g.threads[idx]])
    return g.work[idx] / (rates * c.share[idx])


def _host_sum_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    return c.g.work[idx] / dram_bps(c.g, c.hw)


def _collective_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    g, fabric = c.g, c.hw.fabric
    return np.array([fabric.collective_s(COLLECTIVE_OPS[g.op[v]], g.work[v], g.n_ranks)
                     for v in idx])


def _node_collective_s(c: KindInputs, idx: np.ndarray) -> np.ndarray:
    g, net = c.g, c.hw.network
    return np.array([net.collective_s(COLLECTIVE_OPS[g.op[v]], g.work[v]) for v in idx])


# ---- CPU kinds: host-memory bytes per unit of work, rate against threads, weight
def _cast_dram(g: TaskGraph, hw: HardwareSpec) -> float:
    return hw.host.cast_dram_bytes_per_elem


def _adam_dram(g: TaskGraph, hw: HardwareSpec) -> float:
    return adam_dram_bytes(g, hw) + (hw.host.cast_dram_bytes_per_elem if g.meta.adam_writes_copy
                                     else 0)


def _update_cast_dram(g: TaskGraph, hw: HardwareSpec) -> float:
    return update_cast_dram_bytes(g, hw)


def _sum_dram(g: TaskGraph, hw: HardwareSpec) -> float:
    return 1  # its work is the bytes it moves


def _cast_rate(hw: HardwareSpec, g: TaskGraph, threads: float, work: float) -> float:
    return hw.host.cast_rate(threads, chunk_elems=work)  # the chunk size's thread curve


def _adam_rate(hw: HardwareSpec, g: TaskGraph, threads: float, work: float) -> float:
    return hw.host.adam_rate(threads, g.meta.grad_wire_bytes, g.meta.moments)


def _update_cast_rate(hw: HardwareSpec, g: TaskGraph, threads: float, work: float) -> float:
    bytes_ratio = adam_dram_bytes(g, hw) / update_cast_dram_bytes(g, hw)
    return hw.host.adam_rate(threads, g.meta.grad_wire_bytes) * bytes_ratio


def _cast_weight(hw: HardwareSpec, g: TaskGraph) -> float:
    return hw.host.cast_weight(g.meta.teams_chunk_bytes)


def _cast_team(meta: GraphMeta) -> float:
    return meta.cast_share


def _update_team(meta: GraphMeta) -> float:
    return meta.update_share


C, GPU = Channel, Load.GPU
KINDS: dict[Kind, KindRule] = {
    Kind.CAST: KindRule(C.UPLOAD, "cast", "elements", _cast_s, Load.CPU, _cast_team, _cast_dram,
                        _cast_rate, _cast_weight),
    Kind.H2D: KindRule(C.UPLOAD, "h2d", "bytes", _h2d_s, Load.H2D),
    Kind.ALLGATHER: KindRule(C.UPLOAD, "fabric", "bytes", _collective_s, Load.COLLECTIVE),
    Kind.ACT_OFFLOAD: KindRule(C.ACTIVATION, "d2h", "bytes", _d2h_s, Load.D2H),
    Kind.ACT_RELOAD: KindRule(C.ACTIVATION, "h2d", "bytes", _h2d_s, Load.H2D),
    Kind.EMBED_FWD: KindRule(C.COMPUTE, "compute", "HBM bytes", _hbm_s, GPU),
    Kind.FWD: KindRule(C.COMPUTE, "compute", "FLOPs", _fwd_s, GPU),
    Kind.HEAD_LOSS: KindRule(C.COMPUTE, "compute", "FLOPs", _head_s, GPU),
    Kind.RECOMPUTE: KindRule(C.COMPUTE, "compute", "FLOPs", _recompute_s, GPU),
    Kind.BWD: KindRule(C.COMPUTE, "compute", "FLOPs", _bwd_s, GPU),
    Kind.EMBED_BWD: KindRule(C.COMPUTE, "compute", "HBM bytes", _hbm_s, GPU),
    Kind.REDUCE: KindRule(C.REDUCTION, "fabric", "bytes", _collective_s, Load.COLLECTIVE),
    Kind.HOST_SUM: KindRule(C.UPDATE, "update", "DRAM bytes", _host_sum_s, Load.CPU,
                            dram_bytes=_sum_dram),
    Kind.D2H: KindRule(C.DOWNLOAD, "d2h", "bytes", _d2h_s, Load.D2H),
    Kind.ADAM: KindRule(C.UPDATE, "update", "parameters", _adam_s, Load.CPU, _update_team,
                        _adam_dram, _adam_rate),
    Kind.UPDATE_CAST: KindRule(C.UPLOAD, "cast", "parameters", _update_cast_s, Load.CPU,
                               _cast_team, _update_cast_dram, _update_cast_rate),
    Kind.NODE_REDUCE: KindRule(C.REDUCTION, "nic", "bytes", _node_collective_s, Load.NIC),
    Kind.NODE_GATHER: KindRule(C.UPLOAD, "nic", "bytes", _node_collective_s, Load.NIC),
}

# derived views of the table
CHANNELS = np.array([int(KINDS[k].channel) for k in Kind])  # CHANNELS[g.kind]: channel per task
CHANNEL_NAMES = [KINDS[k].channel.name for k in Kind]  # CHANNEL_NAMES[kind]
COPY_KINDS = frozenset(k for k, r in KINDS.items() if r.load in (Load.H2D, Load.D2H))
COLLECTIVE_KINDS = frozenset(k for k, r in KINDS.items() if r.load == Load.COLLECTIVE)
NIC_KINDS = frozenset(k for k, r in KINDS.items() if r.load == Load.NIC)
# bytes between devices, and between nodes
MOVING_KINDS = tuple(k for k in Kind if k in COPY_KINDS | COLLECTIVE_KINDS | NIC_KINDS)


def task_core_share(g: TaskGraph) -> np.ndarray:
    """Per task, the fraction of its threads' speed its team keeps (KindRule.team): 1 for kinds
    without a team (HOST_SUM runs at the DRAM rate) and for graphs built without the shares."""
    share = np.ones(g.n_tasks)
    for k, rule in KINDS.items():
        if rule.team is not None:
            share[g.kind == int(k)] = rule.team(g.meta)
    return share
