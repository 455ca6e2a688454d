"""Work -> time, in one place: task durations and the shared resources each task draws on.

Durations are each task alone on its agent at the full rate of its resources (no contention):
  FWD / BWD               measured layer time for the shape when the hardware spec has one
                          (fwd : bwd = 1 : 2, as their FLOPs), else
                          FLOPs / achieved rate(hidden, tokens per micro-batch)
  RECOMPUTE               fwd time x the policy's recompute fraction: (recompute FLOPs + its
                          elementwise HBM bytes x k) / (the same for the whole forward); 1 for
                          whole-layer "layer". k (flops_per_hbm_byte): where the hardware has
                          policy sac's measured recompute / forward f for the shape (gpu.layer_time
                          sac_recompute_fraction; sac recomputes only memory-bound ops), the
                          forward splits into elementwise time E = its elementwise bytes at sac's
                          rate and matmul time M = fwd - E (at most the GPU's peak rate), and
                          k = (1 / sac's rate) / (M / the forward's FLOPs): sac then recomputes
                          f x fwd (nvidia-h200, Qwen3-4B: PyTorch's eager elementwise ops reach
                          ~350-530 GB/s by the bytes spec/segments.py counts, a tenth of the
                          HBM rate); else k = achieved rate / HBM rate
  HEAD_LOSS               FLOPs / achieved rate;  EMBED_FWD / EMBED_BWD  bytes / HBM rate
  H2D, ACT_RELOAD         bytes / per-GPU H2D rate;  D2H, ACT_OFFLOAD  bytes / per-GPU D2H rate
  CAST                    elements / (cast rate(threads, chunk) x share);  ADAM  parameters /
                          (Adam rate(threads) x share), share = the task's team's
                          (task_core_share: build.team_share of the cast team or of an update
                          worker's team: a team larger than the cores left to it waits on its
                          preempted threads). The cast rate is the hardware's rate for a chunk of
                          the task's elements when it has host.cast_chunk_gelem_per_s (measured
                          by chunk size into a pinned ring, interpolated in log chunk size),
                          else its thread curve (large buffers): HostSpec.cast_rate. With
                          host_bf16_copy (meta.adam_writes_copy) each ADAM also writes the
                          BF16 copy from the updated master, a cast pass of its chunk by the
                          update worker's team (engine._run_adam): + elements / (cast rate x
                          share) and the cast's DRAM bytes. Both + the executor's dispatch
                          cost per task on its CPU agents where measured (HostSpec.task_gap_s,
                          profile/agents.py): it delays the task on its agent by that much
                          (host.cores counts the kernel's time only). The simulator runs the
                          gap at the task's contended speed s, stretching it by 1/s (at s =
                          0.5 by the whole gap: ~0.1 ms of a 2-4 ms task) and holding the
                          team's cores through it
  HOST_SUM                bytes / host DRAM rate (dram_bps)
  ALLGATHER, REDUCE       the fabric's collective time (ring bytes / bus rate + latency)
Resources (each with a capacity per second; the analytic lower bound sums work over them, the
simulator shares them between concurrent tasks):
  gpu{r}.compute (seconds), gpu{r}.h2d, gpu{r}.d2h (bytes, per-GPU link per direction),
  gpu{r}.duplex (bytes, both directions), host.h2d, host.d2h, host.pcie (bytes, all GPUs:
  the host-side caps), host.dram (bytes; dram_bps: what the graph's largest CPU team reaches,
  HostSpec.team_dram_bps: the CPU kernels, and the DMA too unless host.mem exists; beside
  host.mem, the copies cost the CPU kernels: the simulator caps every CPU kernel beside copies
  of D bytes/s at S / (S + D) of its speed, S = HostSpec.dma_slowdown_bps, the profile's paired
  cost at the teams' cap that also holds far below it (a lone update beside a D2H stream: +32-36%
  at S = 125-140 GB/s, +44% measured): ResourceUse.dma_slowdown_bps. The bound takes its linear
  part: as S / (S + D) <= 1 - D / (S + D_max), D_max = min(host.mem, host.pcie), each DMA byte
  draws host.dram's cap / (S + D_max) of a byte of host.dram (the simulator leaves that draw
  out: its slowdown stands for it); a profile with the weight but not S has each DMA byte draw
  HostSpec.dram_dma_weight of a byte of host.dram, in both), host.mem (bytes, only with a measured
  HostSpec.memory_bps, at least host.dram's cap: all host-memory traffic, the DMA's and the CPU
  kernels'), host.cores (core-seconds), fabric (seconds; on a `pcie` fabric collectives also
  load each GPU's PCIe links and, since peer traffic crosses the root complex, the host-side
  all-GPU cap host.pcie).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slidedp.graph.sizes import FP32_BYTES
from slidedp.graph.tasks import COLLECTIVE_OPS, Kind, TaskGraph
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.segments import policy_cost, segment_costs
from slidedp.spec.workload import Workload


@dataclass(frozen=True)
class ResourceUse:
    """Per-task resource draws in CSR form: task v uses res[ptr[v]:ptr[v+1]] with `amount`."""

    names: list[str]
    capacity: np.ndarray  # units of amount per second
    ptr: np.ndarray
    res: np.ndarray
    amount: np.ndarray
    # the copies' slowdown of the CPU kernels (HostSpec.dma_slowdown_bps; 0: none) and the
    # resources it reads and scales (the simulator's FluidShare): `copy_traffic`, where the
    # copies' host-memory bytes are drawn (host.mem), and `kernel_dram`, the CPU kernels' cap
    # (host.dram)
    dma_slowdown_bps: float = 0.0
    copy_traffic: int = -1
    kernel_dram: int = -1

    def index(self, name: str) -> int:
        return self.names.index(name)


def layer_times_s(hw: HardwareSpec, wl: Workload) -> dict[str, float]:
    """Seconds of one decoder layer's fwd / bwd for one GPU's whole step (all micro-batches)."""
    m = wl.model
    meas = hw.gpu.measured_layer_s(m.hidden, m.ffn, wl.seq_len, wl.micro_batch)
    if meas is not None:
        per_mb = {"fwd": meas / 3, "bwd": 2 * meas / 3}
    else:
        rate = hw.gpu.achieved_flops(m.hidden, wl.tokens_per_micro_batch)
        f = m.layer_flops_per_token(wl.seq_len)
        per_mb = {k: f[k] * wl.tokens_per_micro_batch / rate for k in ("fwd", "bwd")}
    return {k: v * wl.accum_steps for k, v in per_mb.items()}


def dram_bps(g: TaskGraph, hw: HardwareSpec) -> float:
    """The host DRAM cap of this graph: HostSpec.team_dram_bps at its largest CPU team (the
    cast team, or the update workers' teams together, which run at once; at most the cores)
    and its upload chunk; the full dram_bps for graphs built without team sizes."""
    if g.meta.cast_threads is None:
        return hw.host.dram_bps
    team = max(g.meta.cast_threads, g.meta.update_threads)
    return hw.host.team_dram_bps(min(team, hw.host.cores), g.meta.teams_chunk_bytes)


def task_core_share(g: TaskGraph) -> np.ndarray:
    """Per task, the fraction of its threads' speed its team keeps (build.team_share): the cast
    team's for CAST, an update worker's for ADAM, 1 for the rest (HOST_SUM runs at the DRAM
    rate) and for graphs built without the shares."""
    share = np.ones(g.n_tasks)
    share[g.kind == int(Kind.CAST)] = g.meta.cast_share
    share[g.kind == int(Kind.ADAM)] = g.meta.update_share
    return share


def held_cores(g: TaskGraph) -> np.ndarray:
    """Cores each task holds while it runs: its team's threads x its share (0 for GPU tasks)."""
    return g.threads * task_core_share(g)


def grad_bytes(g: TaskGraph) -> int:
    """Bytes per element of the gradient the graph's ADAMs read (graph.build.grad_wire_bytes)."""
    return g.meta.grad_wire_bytes


def adam_dram_bytes(g: TaskGraph, hw: HardwareSpec) -> float:
    """Host DRAM bytes an ADAM moves per parameter: the hardware's figure (an FP32 gradient)
    with the gradient the graph's ADAMs read (2 B BF16 with plan.grad_widen = host)."""
    return hw.host.adam_dram_bytes_per_param - FP32_BYTES + grad_bytes(g)


def task_durations(g: TaskGraph, hw: HardwareSpec, wl: Workload) -> np.ndarray:
    """Seconds per task, alone on its agent (see the module docstring)."""
    kind, work = g.kind, g.work
    d = np.zeros(g.n_tasks)
    lt = layer_times_s(hw, wl)
    sel = {k: kind == int(k) for k in Kind}
    d[sel[Kind.FWD]] = lt["fwd"]
    d[sel[Kind.BWD]] = lt["bwd"]
    d[sel[Kind.RECOMPUTE]] = _recompute_s(g, hw, wl, lt["fwd"])
    head_rate = hw.gpu.achieved_flops(wl.model.hidden, wl.tokens_per_micro_batch)
    d[sel[Kind.HEAD_LOSS]] = work[sel[Kind.HEAD_LOSS]] / head_rate
    emb = sel[Kind.EMBED_FWD] | sel[Kind.EMBED_BWD]
    d[emb] = work[emb] / hw.gpu.hbm_bps
    up = sel[Kind.H2D] | sel[Kind.ACT_RELOAD]
    d[up] = work[up] / hw.pcie.h2d_bps
    down = sel[Kind.D2H] | sel[Kind.ACT_OFFLOAD]
    d[down] = work[down] / hw.pcie.d2h_bps
    share = task_core_share(g)

    def cast_s(idx: np.ndarray) -> np.ndarray:  # a cast of each task's elements by its team
        rates = [hw.host.cast_rate(t, e) for t, e in zip(g.threads[idx], work[idx], strict=True)]
        return work[idx] / (np.array(rates) * share[idx])

    idx = np.flatnonzero(sel[Kind.CAST])
    if len(idx):
        d[idx] = cast_s(idx)
    idx = np.flatnonzero(sel[Kind.ADAM])
    if len(idx):
        gb = grad_bytes(g)
        rates = np.array([hw.host.adam_rate(t, gb) for t in g.threads[idx]]) * share[idx]
        d[idx] = work[idx] / rates
        if g.meta.adam_writes_copy:
            d[idx] += cast_s(idx)
    d += task_gaps_s(g, hw)
    d[sel[Kind.HOST_SUM]] = work[sel[Kind.HOST_SUM]] / dram_bps(g, hw)
    for v in np.flatnonzero(sel[Kind.ALLGATHER] | sel[Kind.REDUCE]):
        d[v] = hw.fabric.collective_s(COLLECTIVE_OPS[g.op[v]], work[v], g.n_ranks)
    return d


def task_gaps_s(g: TaskGraph, hw: HardwareSpec) -> np.ndarray:
    """Per task, the executor's measured dispatch seconds before it on its CPU agent
    (HostSpec.task_gap_s, by kind: spec/hardware.py AGENT_GAP_KINDS); 0 elsewhere."""
    gaps = np.zeros(g.n_tasks)
    for key, gap_s in hw.host.task_gap_s.items():
        gaps[g.kind == int(Kind[key.upper()])] = gap_s
    return gaps


def flops_per_hbm_byte(hw: HardwareSpec, wl: Workload) -> float:
    """k of a RECOMPUTE (module docstring): what one elementwise HBM byte of the forward costs in
    FLOPs of its matmuls. With policy sac's measured recompute fraction f for the shape (sac
    recomputes memory-bound ops only): the forward's elementwise bytes at sac's rate take
    f x fwd x (forward bytes / sac bytes), the matmuls the rest, never faster than the GPU's
    peak; else the achieved FLOP rate over the HBM rate."""
    m = wl.model
    f = hw.gpu.measured_sac_recompute_fraction(m.hidden, m.ffn, wl.seq_len, wl.micro_batch)
    if f is not None:
        seg, tokens = segment_costs(m, wl.seq_len), wl.tokens_per_micro_batch
        flops, hbm = sum(seg.fwd_flops) * tokens, sum(seg.fwd_hbm_bytes) * tokens
        sac_hbm = policy_cost(m, "sac", wl.seq_len).recompute_hbm_bytes * tokens
        fwd_s = layer_times_s(hw, wl)["fwd"] / wl.accum_steps  # one micro-batch
        matmul_s = max(fwd_s * (1 - f * hbm / sac_hbm), flops / hw.gpu.peak_bf16_flops)
        if matmul_s < fwd_s:
            return (fwd_s - matmul_s) / hbm * flops / matmul_s
    return hw.gpu.achieved_flops(m.hidden, wl.tokens_per_micro_batch) / hw.gpu.hbm_bps


def _recompute_s(g: TaskGraph, hw: HardwareSpec, wl: Workload, fwd_s: float) -> np.ndarray:
    """RECOMPUTE seconds: fwd_s scaled by the task's share of the forward's work (docstring)."""
    m, tokens = wl.model, wl.tokens_per_gpu_step
    k = flops_per_hbm_byte(hw, wl)
    seg = segment_costs(m, wl.seq_len)
    full = (sum(seg.fwd_flops) + k * sum(seg.fwd_hbm_bytes)) * tokens
    idx = np.flatnonzero(g.kind == int(Kind.RECOMPUTE))
    hbm = g.meta.recompute_hbm_bytes
    work = [g.work[v] + k * hbm.get(int(g.unit[v]), 0.0) for v in idx]
    return fwd_s * np.asarray(work, np.float64) / full


def resource_use(g: TaskGraph, hw: HardwareSpec, durations: np.ndarray) -> ResourceUse:
    """Which shared resources each task draws on and how much (see the module docstring)."""
    R = g.n_ranks
    names = [f"gpu{r}.{x}" for r in range(R) for x in ("compute", "h2d", "d2h", "duplex")]
    names += ["host.h2d", "host.d2h", "host.pcie", "host.dram", "host.cores", "fabric"]
    memory_bps = hw.host.memory_bps()
    if memory_bps is not None:
        names.append("host.mem")
    dma_dram = "host.dram" if memory_bps is None else "host.mem"  # where the DMA draws
    idx = {n: i for i, n in enumerate(names)}
    p, h = hw.pcie, hw.host
    cap = {f"gpu{r}.compute": 1.0 for r in range(R)}
    for r in range(R):
        cap[f"gpu{r}.h2d"], cap[f"gpu{r}.d2h"], cap[f"gpu{r}.duplex"] = p.h2d_bps, p.d2h_bps, p.duplex_bps
    cap.update({"host.h2d": p.all_h2d_bps, "host.d2h": p.all_d2h_bps, "host.pcie": p.all_total_bps,
                "host.dram": dram_bps(g, hw), "host.cores": float(h.cores), "fabric": 1.0})
    if memory_bps is not None:  # all traffic: never a tighter cap than the CPU kernels' alone
        cap["host.mem"] = max(memory_bps, cap["host.dram"])
    pcie_fabric = hw.fabric.kind == "pcie"
    ptr, res, amt = [0], [], []

    def use(name, a):
        res.append(idx[name])
        amt.append(a)

    def host_bytes(a):  # a CPU kernel's DRAM traffic: the teams' cap, and all traffic's
        use("host.dram", a)
        if memory_bps is not None:
            use("host.mem", a)

    slowdown = h.dma_slowdown_bps() if memory_bps is not None else None
    dma_weight = h.dram_dma_weight if memory_bps is not None else 0.0
    if slowdown is not None:  # the slowdown's linear bound (module docstring)
        dma_weight = cap["host.dram"] / (slowdown + min(cap["host.mem"], cap["host.pcie"]))

    def dma_bytes(a):  # a copy's host-memory traffic, and what it costs the CPU kernels' cap
        use(dma_dram, a)
        if dma_weight > 0:
            use("host.dram", dma_weight * a)

    kinds, ranks, work = g.kind.tolist(), g.rank.tolist(), g.work.tolist()
    threads = held_cores(g).tolist()
    copy_pass = bool(g.meta.adam_writes_copy)
    adam_bytes = adam_dram_bytes(g, hw)
    kernel_s = (durations - task_gaps_s(g, hw)).tolist()  # cores: the team idles in the gap
    dur = durations.tolist()
    for v, k in enumerate(kinds):
        r, w = ranks[v], work[v]
        if k in (Kind.FWD, Kind.BWD, Kind.RECOMPUTE, Kind.HEAD_LOSS, Kind.EMBED_FWD, Kind.EMBED_BWD):
            use(f"gpu{r}.compute", dur[v])
        elif k in (Kind.H2D, Kind.ACT_RELOAD):
            use(f"gpu{r}.h2d", w), use(f"gpu{r}.duplex", w), use("host.h2d", w)
            use("host.pcie", w), dma_bytes(w)
        elif k in (Kind.D2H, Kind.ACT_OFFLOAD):
            use(f"gpu{r}.d2h", w), use(f"gpu{r}.duplex", w), use("host.d2h", w)
            use("host.pcie", w), dma_bytes(w)
        elif k == Kind.CAST:
            host_bytes(w * h.cast_dram_bytes_per_elem)
            use("host.cores", threads[v] * kernel_s[v])
        elif k == Kind.ADAM:
            host_bytes(w * (adam_bytes + (h.cast_dram_bytes_per_elem if copy_pass else 0)))
            use("host.cores", threads[v] * kernel_s[v])
        elif k == Kind.HOST_SUM:
            host_bytes(w)
            use("host.cores", threads[v] * dur[v])
        elif k in (Kind.ALLGATHER, Kind.REDUCE):
            use("fabric", dur[v])
            if pcie_fabric:
                per_gpu = w * (R - 1) / R
                for q in range(R):
                    use(f"gpu{q}.h2d", per_gpu), use(f"gpu{q}.d2h", per_gpu)
                    use(f"gpu{q}.duplex", 2 * per_gpu)
                # peer traffic crosses the host's root complex: it shares the host-side cap
                use("host.pcie", R * per_gpu)
        ptr.append(len(res))
    return ResourceUse(names, np.array([cap[n] for n in names]), np.asarray(ptr, np.int64),
                       np.asarray(res, np.int64), np.asarray(amt, np.float64),
                       slowdown or 0.0, idx.get("host.mem", -1), idx["host.dram"])
