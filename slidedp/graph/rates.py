"""What the hardware spec says a graph's work runs at: the helpers of the kind table's rules
(graph/kinds.py) that several rules share."""

from __future__ import annotations

import numpy as np

from slidedp.graph.tasks import Kind, TaskGraph
from slidedp.spec.elements import FP32_BYTES, PARAM_BYTES
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.plan import Moments
from slidedp.spec.segments import policy_cost, segment_costs
from slidedp.spec.workload import Workload


def layer_times_s(hw: HardwareSpec, wl: Workload, kernels: str = "eager") -> dict[str, float]:
    """Seconds of one decoder layer's fwd / bwd for one GPU's whole step (all micro-batches):
    the measured layer time for the shape and the plan's `kernels` when the hardware spec has
    one (fwd : bwd = 1 : 2, as their FLOPs), else FLOPs / achieved rate(hidden, tokens per
    micro-batch)."""
    m = wl.model
    meas = hw.gpu.measured_layer_s(m.hidden, m.ffn, wl.seq_len, wl.micro_batch, kernels)
    if meas is not None:
        per_mb = {"fwd": meas / 3, "bwd": 2 * meas / 3}
    else:
        rate = hw.gpu.achieved_flops(m.hidden, wl.tokens_per_micro_batch)
        f = m.layer_flops_per_token(wl.seq_len)
        per_mb = {k: f[k] * wl.tokens_per_micro_batch / rate for k in ("fwd", "bwd")}
    return {k: v * wl.accum_steps for k, v in per_mb.items()}


def flops_per_hbm_byte(hw: HardwareSpec, wl: Workload, kernels: str = "eager") -> float:
    """k of a RECOMPUTE (recompute_s): what one elementwise HBM byte of the forward costs in
    FLOPs of its matmuls. With policy sac's measured recompute fraction f for the shape (sac
    recomputes memory-bound ops only): the forward's elementwise bytes at sac's rate take
    f x fwd x (forward bytes / sac bytes), the matmuls the rest, never faster than the GPU's
    peak; else the achieved FLOP rate over the HBM rate."""
    m = wl.model
    f = hw.gpu.measured_sac_recompute_fraction(m.hidden, m.ffn, wl.seq_len, wl.micro_batch,
                                               kernels)
    if f is not None:
        seg, tokens = segment_costs(m, wl.seq_len), wl.tokens_per_micro_batch
        flops, hbm = sum(seg.fwd_flops) * tokens, sum(seg.fwd_hbm_bytes) * tokens
        sac_hbm = policy_cost(m, "sac", wl.seq_len).recompute_hbm_bytes * tokens
        fwd_s = layer_times_s(hw, wl, kernels)["fwd"] / wl.accum_steps  # one micro-batch
        matmul_s = max(fwd_s * (1 - f * hbm / sac_hbm), flops / hw.gpu.peak_bf16_flops)
        if matmul_s < fwd_s:
            return (fwd_s - matmul_s) / hbm * flops / matmul_s
    return hw.gpu.achieved_flops(m.hidden, wl.tokens_per_micro_batch) / hw.gpu.hbm_bps


def recompute_s(g: TaskGraph, hw: HardwareSpec, wl: Workload, idx: np.ndarray) -> np.ndarray:
    """Seconds of RECOMPUTE tasks idx: the layer's fwd time x the task's share of the forward's
    work, (recompute FLOPs + its elementwise HBM bytes x k) / (the same for the whole forward),
    k = flops_per_hbm_byte; 1 for whole-layer "layer". Where the hardware has policy sac's
    measured recompute / forward f for the shape (gpu.layer_time sac_recompute_fraction; sac
    recomputes only memory-bound ops), sac then recomputes f x fwd (PyTorch's eager elementwise
    ops reach about a tenth of the HBM rate by the bytes spec/segments.py counts: measured on
    nvidia-h200, Qwen3-4B)."""
    m, tokens = wl.model, wl.tokens_per_gpu_step
    k = flops_per_hbm_byte(hw, wl, g.meta.kernels)
    seg = segment_costs(m, wl.seq_len)
    full = (sum(seg.fwd_flops) + k * sum(seg.fwd_hbm_bytes)) * tokens
    hbm = g.meta.recompute_hbm_bytes
    work = [g.work[v] + k * hbm.get(int(g.unit[v]), 0.0) for v in idx]
    return layer_times_s(hw, wl, g.meta.kernels)["fwd"] * np.asarray(work, np.float64) / full


def dram_bps(g: TaskGraph, hw: HardwareSpec) -> float:
    """The host DRAM cap of this graph: HostSpec.team_dram_bps at its largest CPU team (the
    cast team, or the update workers' teams together, which run at once; at most the cores)
    and its upload chunk; the full dram_bps for graphs built without team sizes."""
    if g.meta.cast_threads is None:
        return hw.host.dram_bps
    team = max(g.meta.cast_threads, g.meta.update_threads)
    return hw.host.team_dram_bps(min(team, hw.host.cores), g.meta.teams_chunk_bytes)


def adam_dram_bytes(g: TaskGraph, hw: HardwareSpec) -> float:
    """Host DRAM bytes an ADAM moves per parameter: the hardware's figure (an FP32 gradient)
    with the gradient the graph's ADAMs read (GraphMeta.grad_wire_bytes) and their moments'
    format (GraphMeta.moments: compact moments move fewer bytes)."""
    moments = Moments(g.meta.moments).bytes_per_param  # read and written once each
    return (hw.host.adam_dram_bytes_per_param - FP32_BYTES + g.meta.grad_wire_bytes
            - 2 * (Moments.FP32.bytes_per_param - moments))


def update_cast_dram_bytes(g: TaskGraph, hw: HardwareSpec) -> float:
    """Host DRAM bytes an UPDATE_CAST moves per parameter: an ADAM's reads (the gradient, the
    master and the moments) and a BF16 write, where the ADAM writes the FP32 master and moments
    (3 x FP32_BYTES)."""
    return adam_dram_bytes(g, hw) - 3 * FP32_BYTES + PARAM_BYTES


def task_gaps_s(g: TaskGraph, hw: HardwareSpec) -> np.ndarray:
    """Per task, the executor's measured dispatch seconds before it on its CPU agent
    (HostSpec.task_gap_s, by kind: spec/host.py AGENT_GAP_KINDS); 0 elsewhere."""
    gaps = np.zeros(g.n_tasks)
    for key, gap_s in hw.host.task_gap_s.items():
        gaps[g.kind == int(Kind[key.upper()])] = gap_s
    return gaps
