"""Hardware spec: GPUs, PCIe, host (DRAM, cores, cast and Adam rate curves) and the GPU fabric.

Loaded from TOML (a preset name under slidedp/presets/hardware/ or a file). Every number carries a
source: each section has a `source` string and may override it per field in a `sources` sub-table
(`[pcie.sources] h2d_gbps = "..."`). Rates are converted once at load to bytes/s, FLOP/s, elements/s.

Schema (units in names):
  [hardware]  name, description
  [gpu]       model, count, hbm_gib, hbm_gbps (memory bandwidth), peak_bf16_tflops, source
              achieved = [[hidden, tokens, tflops], ...]   achieved dense rate of one decoder layer
              [[gpu.layer_time]] hidden, ffn, seq, micro_batch, fwd_bwd_s (one micro-batch),
                                 source, sac_recompute_fraction (optional: policy sac's
                                 recompute / its forward)   (optional)
  [pcie]      h2d_gbps, d2h_gbps (one GPU, one direction), duplex_gbps (one GPU, both directions),
              all_h2d_gbps, all_d2h_gbps, all_total_gbps (all GPUs at once: host-side caps), source
              chunk_gbps = [[chunk_mib, h2d, d2h], ...]  (optional) one GPU alone, by copy size
  [host]      cores, ram_gib, dram_gbps, cast_gelem_per_s = [[threads, rate]],
              adam_gparam_per_s = [[threads, rate]], adam_dram_bytes_per_param,
              cast_dram_bytes_per_elem, source
              dram_teams_gbps = [cast threads, update threads, GB/s]  (optional) the DRAM traffic
              of a cast team and an update team at once (slidedp profile; HostSpec.team_dram_bps)
              dram_teams_cast_gbps  (optional, with dram_teams_gbps) the cast team's own share of
              that traffic (the rest is the update team's; HostSpec.cast_weight)
              dram_dma_gbps = [cast threads, update threads, GPUs, GB/s]  (optional) the same with
              every GPU copying both ways beside them: all host-memory traffic (HostSpec.memory_bps)
              dram_dma_weight  (optional, with dram_dma_gbps) in [0, 1]: the teams' traffic a
              copied byte costs in that run, against the teams alone on the same buffers
              (HostSpec.dram_dma_weight)
              dram_dma_teams_gbps  (optional, with dram_dma_weight) the teams' own traffic in that
              run, beside the copies (HostSpec.dma_slowdown_bps)
              cast_chunk_gelem_per_s = [[chunk_mib, threads, rate], ...]  (optional) the cast by
              chunk size: chunk_mib is the chunk's BF16 size (what H2D moves, as pcie.chunk_gbps;
              elements = chunk_mib MiB / 2 B); rows by chunk_mib, threads strictly increasing
              within a chunk. When present, CAST tasks take it (cast_rate with chunk_elems)
              adam_bf16_grad_gparam_per_s = [[threads, rate]]  (optional) Adam on a BF16
              gradient widened in cache (plan.grad_widen = host; HostSpec.adam_rate)
              agent_gap_us = { cast = us, adam = us }  (optional) the executor's dispatch cost
              per CAST / ADAM task on its CPU agents (profile/agents.py; HostSpec.task_gap_s)
              rate_range = { adam = [slow, fast], cast = [slow, fast] }  (optional) how far the
              profile's rounds of a kernel at the executor's team size read from its rate, as
              factors (slow <= 1 <= fast): the host's own spread, which brackets a host-bound
              prediction (HardwareSpec.host_corners)
  [fabric]    kind = pcie | nvlink-pairs | nvswitch, link_gbps (per GPU, per direction),
              cross_pair_gbps (nvlink-pairs: rate between pairs, over PCIe), latency_us,
              efficiency = {all_gather, reduce_scatter, reduce, all_reduce}  (fraction of link_gbps)
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from slidedp.spec.curves import RateCurve
from slidedp.spec.errors import SpecError
from slidedp.spec.model import BF16
from slidedp.spec.tomlio import Table, read_toml

GB = 1e9
GIB = 2**30
MIB = 2**20
FABRIC_KINDS = ("pcie", "nvlink-pairs", "nvswitch")
COLLECTIVES = ("all_gather", "reduce_scatter", "reduce", "all_reduce")


def log_between(keys: list[float], x: float, value: Callable[[float], float]) -> float:
    """value(x) from its values at sorted `keys`: linear in log x between the two keys around x,
    clamped at the first and last key (the measured range)."""
    if x <= keys[0]:
        return value(keys[0])
    if x >= keys[-1]:
        return value(keys[-1])
    i = bisect.bisect_right(keys, x)
    k0, k1 = keys[i - 1], keys[i]
    w = (math.log(x) - math.log(k0)) / (math.log(k1) - math.log(k0))
    return (1 - w) * value(k0) + w * value(k1)


@dataclass(frozen=True)
class LayerTime:
    """A measured forward+backward time of one decoder layer of a given shape (seconds, one
    micro-batch), and optionally policy sac's recompute as a fraction of its own forward."""

    hidden: int
    ffn: int
    seq: int
    micro_batch: int
    fwd_bwd_s: float
    source: str
    # policy sac's recompute time / its forward time, both timed in one run of the executor's
    # policy code (sac recomputes only memory-bound ops: it prices the elementwise bytes of every
    # recompute, graph/costs.py flops_per_hbm_byte); in (0, 1); None: not measured
    sac_recompute_fraction: float | None = None


@dataclass(frozen=True)
class GpuSpec:
    model: str
    count: int
    hbm_bytes: float
    hbm_bps: float
    peak_bf16_flops: float
    achieved: tuple[tuple[float, float, float], ...]  # (hidden, tokens, flop/s), sorted
    layer_times: tuple[LayerTime, ...]
    sources: MappingProxyType

    def achieved_flops(self, hidden: int, tokens: float) -> float:
        """Achieved dense rate for a layer of width `hidden` on `tokens` tokens (FLOP/s).

        Bilinear interpolation in (log hidden, log tokens) over the `achieved` table, clamped at
        the table's edges (the rate saturates).
        """
        hs = sorted({h for h, _, _ in self.achieved})

        def at_hidden(h: float) -> float:
            rows = sorted((t, r) for hh, t, r in self.achieved if hh == h)
            ts = [math.log(t) for t, _ in rows]
            return RateCurve(tuple(ts), tuple(r for _, r in rows), "flop/s", "").at(
                math.log(max(tokens, 1.0))
            )

        return log_between(hs, hidden, at_hidden)

    def measured_layer_s(self, hidden: int, ffn: int, seq: int, micro_batch: float) -> float | None:
        """Measured fwd+bwd time of one layer of this shape, linear in micro-batch; None if absent."""
        return self._per_shape("fwd_bwd_s", hidden, ffn, seq, micro_batch)

    def measured_sac_recompute_fraction(self, hidden: int, ffn: int, seq: int,
                                        micro_batch: float) -> float | None:
        """Measured sac recompute / forward of one layer of this shape, linear between measured
        micro-batches, the nearest one's outside them; None if absent."""
        return self._per_shape("sac_recompute_fraction", hidden, ffn, seq, micro_batch,
                               proportional=False)

    def _per_shape(self, field: str, hidden: int, ffn: int, seq: int, micro_batch: float,
                   proportional: bool = True) -> float | None:
        """A LayerTime field at this layer shape, linear in micro-batch (proportional to it from
        a single row; a fraction is not: held at the measured micro-batches' ends)."""
        rows = sorted(
            (lt.micro_batch, getattr(lt, field))
            for lt in self.layer_times
            if (lt.hidden, lt.ffn, lt.seq) == (hidden, ffn, seq) and getattr(lt, field) is not None
        )
        if not rows:
            return None
        if not proportional:
            micro_batch = min(max(micro_batch, rows[0][0]), rows[-1][0])
        if len(rows) == 1:
            return rows[0][1] * micro_batch / rows[0][0]
        # time per sample from the curve of time against batch (linear between points,
        # extrapolated with the nearest segment's slope)
        bs = [b for b, _ in rows]
        i = min(max(bisect.bisect_right(bs, micro_batch), 1), len(rows) - 1)
        (b0, t0), (b1, t1) = rows[i - 1], rows[i]
        return max(t0 + (t1 - t0) * (micro_batch - b0) / (b1 - b0), 0.0)


@dataclass(frozen=True)
class PcieSpec:
    """Per-GPU link rates and the host-side caps they share (bytes/s)."""

    h2d_bps: float
    d2h_bps: float
    duplex_bps: float
    all_h2d_bps: float
    all_d2h_bps: float
    all_total_bps: float
    sources: MappingProxyType
    chunk_bps: tuple[tuple[float, float, float], ...] = ()  # (chunk bytes, h2d, d2h), by chunk




@dataclass(frozen=True)
class HostSpec:
    cores: int
    ram_bytes: float
    dram_bps: float
    cast_elems_per_s: RateCurve  # against threads
    adam_params_per_s: RateCurve  # against threads
    adam_dram_bytes_per_param: float
    cast_dram_bytes_per_elem: float
    sources: MappingProxyType
    # (chunk elements, elem/s against threads), by chunk; () when the file has no such table
    cast_chunk: tuple[tuple[float, RateCurve], ...] = ()
    # (cast threads, update threads, DRAM bytes/s) of the two teams at once; None: not measured
    dram_teams: tuple[float, float, float] | None = None
    # the cast team's bytes/s in that run; None: not measured (profiles before 2026-12-01 01:50)
    dram_teams_cast_bps: float | None = None
    # the same with every GPU's copies: (cast threads, update threads, GPUs, bytes/s); None: not
    # measured
    dram_dma: tuple[float, float, float, float] | None = None
    # the teams' traffic lost per copied byte, measured beside dram_dma against the teams alone
    # on the same buffers: with dram_dma_teams_bps (or the totals) it gives dma_slowdown_bps,
    # else each DMA byte draws this share of a byte of the CPU kernels' cap (graph/costs.py); 0
    # where not measured (profiles before 2026-12-01 21:00, presets: the DMA draws only on
    # memory_bps). On nvidia-h200-x4 the teams kept their traffic beside four
    # GPUs' copies (memory_bps); on one nvidia-h200 (2026-12-01 20:27,
    # benchmarks/adam_after_d2h_probe.py) a D2H stream beside the update took its 64 MiB chunks
    # from 7.6 to 10.9 ms, a 5 ms pause after each copy to 8.5 ms
    dram_dma_weight: float = 0.0
    # the teams' own bytes/s beside the copies in the dram_dma run; None: not measured (profiles
    # before 2026-12-01 23:00: dma_slowdown_bps derives it from the totals)
    dram_dma_teams_bps: float | None = None
    # Adam on a BF16 gradient widened in cache (plan.grad_widen = host), against threads; None:
    # not measured (profiles before 2026-12-01, presets): the FP32 gradient's curve stands in
    adam_bf16_grad_params_per_s: RateCurve | None = None
    # the executor's dispatch seconds per task on its CPU agents, by kind ("cast", "adam"): added
    # to those tasks' durations (graph/costs.py); empty: not measured (profiles before
    # 2026-12-01 08:00, presets), no dispatch cost
    task_gap_s: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # the host's spread, {kernel: (slow, fast)} factors over the kernel's rate, for "adam" and
    # "cast" (module docstring); empty: not measured (profiles before 2026-12-01 20:40, presets)
    rate_range: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    def with_rates(self, adam: float = 1.0, cast: float = 1.0) -> HostSpec:
        """This host with its AdamW curves (FP32 and BF16 gradient) times `adam` and its cast
        curves (by threads and by chunk) times `cast`; every other figure as measured (what is
        derived from the rates follows them: cast_weight, team_dram_bps without dram_teams)."""
        bf16 = self.adam_bf16_grad_params_per_s
        return replace(self, adam_params_per_s=self.adam_params_per_s.scaled(adam),
                       adam_bf16_grad_params_per_s=None if bf16 is None else bf16.scaled(adam),
                       cast_elems_per_s=self.cast_elems_per_s.scaled(cast),
                       cast_chunk=tuple((c, curve.scaled(cast)) for c, curve in self.cast_chunk))

    def cast_rate(self, threads: float, chunk_elems: float | None = None) -> float:
        """Elements/s of the FP32 -> BF16 cast with `threads` threads; with `chunk_elems` and a
        cast_chunk table, that chunk size's rate: each measured chunk's curve at `threads`
        (saturating, as RateCurve), linear in log chunk size between the measured chunks and
        clamped at the smallest and largest; else the thread curve (large buffers)."""
        if chunk_elems is None or not self.cast_chunk:
            return self.cast_elems_per_s.at(threads)
        curves = dict(self.cast_chunk)
        return log_between(list(curves), chunk_elems, lambda c: curves[c].at(threads))

    def adam_rate(self, threads: float, grad_bytes: int = 4) -> float:
        """Parameters/s of the CPU Adam with `threads` threads on a gradient of `grad_bytes`
        per element: 2, a BF16 gradient widened in cache (its own curve where measured)."""
        if grad_bytes == 2 and self.adam_bf16_grad_params_per_s is not None:
            return self.adam_bf16_grad_params_per_s.at(threads)
        return self.adam_params_per_s.at(threads)

    def team_dram_bps(self, threads: float) -> float:
        """DRAM bytes/s the host reaches when its CPU work runs in teams of `threads` threads,
        at most dram_bps (the most traffic any measured kernel moved, at any thread count):
        measured, where the profile ran the cast and update teams at once (dram_teams) with
        teams at least this large; else the most traffic the measured kernels (Adam, the cast)
        moved at `threads`. Fewer threads keep fewer memory requests in flight: on
        nvidia-h200-x2, Adam moves 150 GB/s at 24 threads against 164 at 32, and the executor's
        measured traces draw about 150 GB/s while its 24-thread update team runs (validation
        h200x2-8b-*)."""
        if self.dram_teams is not None and threads >= min(self.dram_teams[:2]):
            return min(self.dram_bps, self.dram_teams[2])
        kernels = max(self.adam_rate(threads) * self.adam_dram_bytes_per_param,
                      self.cast_rate(threads) * self.cast_dram_bytes_per_elem)
        return min(self.dram_bps, kernels)

    def cast_weight(self) -> float:
        """How much of a saturated host-memory cap a CAST gets beside the update's ADAM, relative
        to it (the simulator's stage-2 weight, sim/resources.py): from the teams-at-once run,
        (the cast team's bytes there / its bytes alone) / (the update team's bytes there / its
        bytes alone), each alone at its own team size. 1 (equal fractions of their own rates)
        where the profile did not record the split. On nvidia-h200-x2 (24 + 24 threads on 32
        cores) a 64 MiB cast took 2.15 ms alone and 7.5 ms beside the update
        (benchmarks/chunk_cost_probe.py): the cast is the weaker of the two.
        Approximations: the cast's rate alone is the large-buffer one (a CAST task runs at its
        chunk size's, a few percent apart), and the one weight stands for every team size and
        against the DMA too, though measured against Adam at the profile's teams only."""
        if self.dram_teams is None or self.dram_teams_cast_bps is None:
            return 1.0
        cast_t, update_t, total = self.dram_teams
        if not 0 < self.dram_teams_cast_bps < total:
            raise ValueError(f"dram_teams_cast_bps {self.dram_teams_cast_bps:g} outside (0, "
                             f"{total:g}), the teams' total")
        cast_alone = self.cast_rate(cast_t) * self.cast_dram_bytes_per_elem
        adam_alone = self.adam_rate(update_t) * self.adam_dram_bytes_per_param
        return ((self.dram_teams_cast_bps / cast_alone)
                / ((total - self.dram_teams_cast_bps) / adam_alone))

    def memory_bps(self) -> float | None:
        """Bytes/s of all host-memory traffic at once, the GPUs' DMA included: measured where
        the profile ran the teams with every GPU's copies (dram_dma); None when not measured
        (the model then counts the DMA against the teams' cap; graph/costs.py never lets this
        cap fall below that one). On nvidia-h200-x4 the host sum and Adam moved 209 and 145
        GB/s of their own while four GPUs downloaded 131 GB of gradients beside them: more
        host-memory traffic than the 163 GB/s the teams reached alone."""
        return None if self.dram_dma is None else self.dram_dma[3]

    def dma_slowdown_bps(self) -> float | None:
        """S: with the GPUs' copies moving D bytes/s of host memory, every CPU kernel is capped
        at S / (S + D) of the speed it has without them (the simulator's FluidShare; a kernel
        held lower by a shared cap may lose less): the copies lengthen each memory access, and
        a kernel's rate follows its latency. From the profile's paired run: the teams moved T'
        bytes/s beside copies of D' and T' + w D' without them (w: dram_dma_weight), so S =
        T' / w. T' is the measured dram_dma_teams_bps, or, before it was recorded, memory_bps -
        D' with D' = (memory_bps - the teams alone (dram_teams)) / (1 - w), the teams alone
        then from other allocations (a few % there move S by tens of %). None where there is
        no weight, or where that derivation gives no positive D' and T' (w = 1, copies that
        added no traffic): the copies then draw w of their bytes on the kernels' cap. On
        nvidia-h200 2026-12-01: S 125-254 GB/s; a lone update's 64 MiB chunks beside a ~45 GB/s
        D2H stream measured +44% (7.6 -> 10.9 ms), where S / (S + D) at S = 140 GB/s says +32%."""
        w = self.dram_dma_weight
        if w <= 0 or self.dram_dma is None:
            return None
        teams_beside = self.dram_dma_teams_bps
        if teams_beside is None:
            if self.dram_teams is None or w >= 1:
                return None
            copies = (self.dram_dma[3] - self.dram_teams[2]) / (1 - w)
            if copies <= 0:
                return None
            teams_beside = self.dram_dma[3] - copies
        return teams_beside / w if teams_beside > 0 else None


@dataclass(frozen=True)
class FabricSpec:
    kind: str
    link_bps: float
    cross_pair_bps: float
    latency_s: float
    efficiency: MappingProxyType  # collective -> fraction of link rate
    sources: MappingProxyType

    def bus_bps(self, op: str, ranks: int) -> float:
        """Achieved bus rate of a collective among `ranks` GPUs (bytes/s per GPU per direction).

        nvlink-pairs: beyond one pair the ring crosses the PCIe path between pairs.
        """
        link = self.link_bps
        if self.kind == "nvlink-pairs" and ranks > 2:
            link = min(link, self.cross_pair_bps)
        return link * self.efficiency[op]

    def collective_s(self, op: str, nbytes: float, ranks: int) -> float:
        """Time of a collective over a buffer of `nbytes` (the full, unsharded size).

        Bytes each GPU sends (ring algorithms, NCCL's bus-bandwidth convention):
        all_gather and reduce_scatter (R-1)/R * B, all_reduce 2 (R-1)/R * B, reduce B (pipelined
        chain: each link carries the whole buffer once).
        """
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        f = {"all_gather": (ranks - 1) / ranks, "reduce_scatter": (ranks - 1) / ranks,
             "all_reduce": 2 * (ranks - 1) / ranks, "reduce": 1.0}[op]
        return self.latency_s + nbytes * f / self.bus_bps(op, ranks)


@dataclass(frozen=True)
class HardwareSpec:
    name: str
    description: str
    gpu: GpuSpec
    pcie: PcieSpec
    host: HostSpec
    fabric: FabricSpec
    origin: str = field(default="", compare=False)

    def source_of(self, section: str, key: str) -> str:
        return getattr(self, section).sources[key]

    def with_host_rates(self, label: str, adam: float = 1.0, cast: float = 1.0) -> HardwareSpec:
        """This hardware, named "<name> (<label>)", with HostSpec.with_rates(adam, cast)."""
        return replace(self, name=f"{self.name} ({label})",
                       host=self.host.with_rates(adam=adam, cast=cast))

    def host_corners(self) -> tuple[HardwareSpec, HardwareSpec] | None:
        """(slow, fast): this hardware with its AdamW and cast at the slowest and at the
        fastest of the profile's rounds (host.rate_range), None where the file has no range.
        A host-bound step predicted on each brackets where it may land on this machine."""
        r = self.host.rate_range
        if not r:
            return None
        adam, cast = r.get("adam", (1.0, 1.0)), r.get("cast", (1.0, 1.0))
        slow, fast = (self.with_host_rates(f"{which} host rounds", adam[i], cast[i])
                      for i, which in enumerate(("slowest", "fastest")))
        return slow, fast


def _sources(t: Table, keys: list[str]) -> MappingProxyType:
    default = t.str("source")
    over = t.sub("sources", {})
    out = {k: (over.str(k) if over.has(k) else default) for k in keys}
    over.done()
    return MappingProxyType(out)


def _gpu(t: Table) -> GpuSpec:
    keys = ["count", "hbm_gib", "hbm_gbps", "peak_bf16_tflops", "achieved"]
    model = t.str("model")
    count = t.int("count")
    hbm = t.num("hbm_gib") * GIB
    hbm_bps = t.num("hbm_gbps") * GB
    peak = t.num("peak_bf16_tflops") * 1e12
    rows = t.raw("achieved")
    if not isinstance(rows, list) or not rows:
        raise SpecError(t.where, "gpu.achieved", "a non-empty list of [hidden, tokens, tflops]")
    ach = []
    for r in rows:
        if not (isinstance(r, list) and len(r) == 3 and all(isinstance(v, int | float) and v > 0 for v in r)):
            raise SpecError(t.where, "gpu.achieved", f"[hidden, tokens, tflops] positive numbers, got {r!r}")
        if r[2] * 1e12 > peak * 1.001:
            raise SpecError(t.where, "gpu.achieved", f"achieved <= peak_bf16_tflops, got {r!r}")
        ach.append((float(r[0]), float(r[1]), float(r[2]) * 1e12))
    lts = []
    if t.has("layer_time"):
        for s in t.subs("layer_time"):
            sac = None
            if s.has("sac_recompute_fraction"):
                sac = s.num("sac_recompute_fraction")
                if not sac < 1:
                    raise SpecError(s.where, s._name("sac_recompute_fraction"),
                                    f"a fraction of the forward in (0, 1), got {sac!r}")
            lts.append(LayerTime(s.int("hidden"), s.int("ffn"), s.int("seq"), s.int("micro_batch"),
                                 s.num("fwd_bwd_s"), s.str("source"), sac))
            s.done()
    src = _sources(t, keys)
    t.done()
    return GpuSpec(model, count, hbm, hbm_bps, peak, tuple(sorted(ach)), tuple(lts), src)


def _pcie(t: Table) -> PcieSpec:
    keys = ["h2d_gbps", "d2h_gbps", "duplex_gbps", "all_h2d_gbps", "all_d2h_gbps", "all_total_gbps"]
    vals = [t.num(k) * GB for k in keys]
    chunks = [(r[0] * MIB, r[1] * GB, r[2] * GB) for r in _triples(
        t.raw("chunk_gbps", []), t.where, "pcie.chunk_gbps", "[chunk_mib, h2d, d2h]")]
    if any(b[0] <= a[0] for a, b in zip(chunks, chunks[1:], strict=False)):
        raise SpecError(t.where, "pcie.chunk_gbps", "chunk_mib strictly increasing")
    src = _sources(t, keys + (["chunk_gbps"] if chunks else []))
    t.done()
    return PcieSpec(*vals, sources=src, chunk_bps=tuple(chunks))


def _host(t: Table) -> HostSpec:
    keys = ["cores", "ram_gib", "dram_gbps", "cast_gelem_per_s", "adam_gparam_per_s",
            "adam_dram_bytes_per_param", "cast_dram_bytes_per_elem"]
    src = _sources(t, keys + [k for k in ("cast_chunk_gelem_per_s", "dram_teams_gbps",
                                          "dram_teams_cast_gbps", "dram_dma_gbps",
                                          "dram_dma_weight", "dram_dma_teams_gbps",
                                          "adam_bf16_grad_gparam_per_s", "agent_gap_us",
                                          "rate_range")
                          if t.has(k)])
    teams = dma = None
    if t.has("dram_teams_gbps"):
        (cast_t, update_t, gbps), = _triples([t.raw("dram_teams_gbps")], t.where,
                                             "host.dram_teams_gbps",
                                             "[cast threads, update threads, GB/s]")
        teams = (cast_t, update_t, gbps * GB)
    teams_cast = None
    if t.has("dram_teams_cast_gbps"):
        if teams is None:
            raise SpecError(t.where, "host.dram_teams_cast_gbps",
                            "only beside host.dram_teams_gbps (the run it splits)")
        teams_cast = t.num("dram_teams_cast_gbps") * GB
        if not 0 < teams_cast < teams[2]:
            raise SpecError(t.where, "host.dram_teams_cast_gbps",
                            f"between 0 and dram_teams_gbps ({teams[2] / GB:g}), exclusive, "
                            f"got {teams_cast / GB:g}")
    if t.has("dram_dma_gbps"):
        (cast_t, update_t, gpus, gbps), = _triples([t.raw("dram_dma_gbps")], t.where,
                                                   "host.dram_dma_gbps",
                                                   "[cast threads, update threads, GPUs, GB/s]", 4)
        dma = (cast_t, update_t, gpus, gbps * GB)
    dma_weight = 0.0
    if t.has("dram_dma_weight"):
        if dma is None:
            raise SpecError(t.where, "host.dram_dma_weight",
                            "only beside host.dram_dma_gbps (the run it was measured in)")
        dma_weight = t.num("dram_dma_weight")
        if not 0 <= dma_weight <= 1:
            raise SpecError(t.where, "host.dram_dma_weight",
                            f"a number in [0, 1], got {dma_weight!r}")
    dma_teams = None
    if t.has("dram_dma_teams_gbps"):
        if not t.has("dram_dma_weight"):
            raise SpecError(t.where, "host.dram_dma_teams_gbps",
                            "only beside host.dram_dma_weight (the run it was measured in)")
        dma_teams = t.num("dram_dma_teams_gbps") * GB
        if not 0 < dma_teams <= dma[3]:
            raise SpecError(t.where, "host.dram_dma_teams_gbps",
                            f"between 0 (exclusive) and dram_dma_gbps ({dma[3] / GB:g}), got "
                            f"{dma_teams / GB:g}")
    cast = RateCurve.from_pairs(t.raw("cast_gelem_per_s"), t.where, "host.cast_gelem_per_s",
                                "elem/s", src["cast_gelem_per_s"]).scaled(1e9)
    adam = RateCurve.from_pairs(t.raw("adam_gparam_per_s"), t.where, "host.adam_gparam_per_s",
                                "param/s", src["adam_gparam_per_s"]).scaled(1e9)
    adam_bf16 = (RateCurve.from_pairs(t.raw("adam_bf16_grad_gparam_per_s"), t.where,
                                      "host.adam_bf16_grad_gparam_per_s", "param/s",
                                      src["adam_bf16_grad_gparam_per_s"]).scaled(1e9)
                 if t.has("adam_bf16_grad_gparam_per_s") else None)
    h = HostSpec(t.int("cores"), t.num("ram_gib") * GIB, t.num("dram_gbps") * GB, cast, adam,
                 t.num("adam_dram_bytes_per_param"), t.num("cast_dram_bytes_per_elem"), src,
                 _cast_chunks(t.raw("cast_chunk_gelem_per_s", []), t.where,
                              src.get("cast_chunk_gelem_per_s", "")), teams, teams_cast, dma,
                 dma_weight, dma_teams, adam_bf16, _agent_gaps(t.raw("agent_gap_us", {}), t.where),
                 _rate_range(t.raw("rate_range", {}), t.where))
    t.done()
    return h


RANGE_KERNELS = ("adam", "cast")  # the host kernels a rate_range may give


def _rate_range(table, where: str) -> MappingProxyType:
    """host.rate_range -> {kernel: (slow, fast)}: kernels of RANGE_KERNELS, each [slow, fast]
    with 0 < slow <= 1 <= fast."""
    name = "host.rate_range"
    if not isinstance(table, dict):
        raise SpecError(where, name, f"a table {{ adam = [slow, fast], cast = [slow, fast] }}, "
                                     f"got {table!r}")
    out = {}
    for k, v in table.items():
        if k not in RANGE_KERNELS:
            raise SpecError(where, f"{name}.{k}", f"one of {', '.join(RANGE_KERNELS)}")
        ok = isinstance(v, list) and len(v) == 2 and all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in v)
        if not (ok and 0 < v[0] <= 1 <= v[1]):
            raise SpecError(where, f"{name}.{k}",
                            f"[slow, fast] factors with 0 < slow <= 1 <= fast, got {v!r}")
        out[k] = (float(v[0]), float(v[1]))
    return MappingProxyType(out)


AGENT_GAP_KINDS = ("cast", "adam")  # lower-case names of the Kinds a dispatch cost applies to


def _agent_gaps(table, where: str) -> MappingProxyType:
    """host.agent_gap_us -> {kind: seconds}: a table of the kinds in AGENT_GAP_KINDS, each a
    finite number of microseconds in [0, 10000)."""
    name = "host.agent_gap_us"
    if not isinstance(table, dict):
        raise SpecError(where, name, f"a table {{ cast = us, adam = us }}, got {table!r}")
    out = {}
    for k, v in table.items():
        if k not in AGENT_GAP_KINDS:
            raise SpecError(where, f"{name}.{k}", f"one of {', '.join(AGENT_GAP_KINDS)}")
        if not (isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                and 0 <= v < 1e4):
            raise SpecError(where, f"{name}.{k}", f"microseconds in [0, 10000), got {v!r}")
        out[k] = float(v) * 1e-6
    return MappingProxyType(out)


def _triples(rows, where: str, name: str, shape: str, width: int = 3) -> list[list]:
    """A table of rows of `width` (3) positive finite numbers (`shape` names them), else SpecError."""
    if not isinstance(rows, list):
        raise SpecError(where, name, f"a list of {shape}, got {rows!r}")
    for r in rows:
        if not (isinstance(r, list) and len(r) == width
                and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                        and v > 0 for v in r)):
            raise SpecError(where, name, f"{shape} positive numbers, got {r!r}")
    return rows


def _cast_chunks(rows, where: str, source: str) -> tuple[tuple[float, RateCurve], ...]:
    """host.cast_chunk_gelem_per_s rows -> ((chunk elements, elem/s against threads), ...)."""
    name = "host.cast_chunk_gelem_per_s"
    by_chunk: dict[float, list[list]] = {}
    last = 0.0
    for r in _triples(rows, where, name, "[chunk_mib, threads, gelem_per_s]"):
        if r[0] < last:
            raise SpecError(where, name, f"rows ordered by chunk_mib, got {r[0]} after {last}")
        last = r[0]
        by_chunk.setdefault(r[0], []).append([r[1], r[2]])
    return tuple((c * MIB / BF16, RateCurve.from_pairs(
        pairs, where, f"{name} (chunk_mib {c}: threads)", "elem/s", source).scaled(1e9))
        for c, pairs in by_chunk.items())


def _fabric(t: Table) -> FabricSpec:
    keys = ["kind", "link_gbps", "cross_pair_gbps", "latency_us", "efficiency"]
    kind = t.str("kind", choices=FABRIC_KINDS)
    link = t.num("link_gbps") * GB
    cross = t.num("cross_pair_gbps", link / GB) * GB
    lat = t.num("latency_us", allow_zero=True) * 1e-6
    eff_t = t.sub("efficiency")
    eff = {}
    for op in COLLECTIVES:
        e = eff_t.num(op)
        if e > 1:
            raise SpecError(t.where, f"fabric.efficiency.{op}", f"a fraction in (0, 1], got {e}")
        eff[op] = e
    eff_t.done()
    src = _sources(t, keys)
    t.done()
    return FabricSpec(kind, link, cross, lat, MappingProxyType(eff), src)


def parse_hardware(data: dict, where: str) -> HardwareSpec:
    root = Table(data, where)
    hw = root.sub("hardware")
    name, desc = hw.str("name"), hw.str("description", "")
    hw.done()
    spec = HardwareSpec(name, desc, _gpu(root.sub("gpu")), _pcie(root.sub("pcie")),
                        _host(root.sub("host")), _fabric(root.sub("fabric")), origin=where)
    root.done()
    return spec


def preset_dir() -> Path:
    return Path(str(resources.files("slidedp") / "presets" / "hardware"))


def hardware_presets() -> list[str]:
    return sorted(p.stem for p in preset_dir().glob("*.toml"))


def load_hardware(name_or_path: str) -> HardwareSpec:
    """A preset name (see `slidedp hardware list`) or a path to a hardware TOML file."""
    p = Path(name_or_path)
    if p.suffix == ".toml" or p.exists():
        return parse_hardware(read_toml(p), str(p))
    preset = preset_dir() / f"{name_or_path}.toml"
    if not preset.is_file():
        raise SpecError("--hardware", "name", f"a preset ({', '.join(hardware_presets())}) or a TOML file, got {name_or_path!r}")
    return parse_hardware(read_toml(preset), f"preset {name_or_path}")
