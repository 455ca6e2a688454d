"""Hardware spec: GPUs, PCIe, host (DRAM, cores, cast and Adam rate curves) and the GPU fabric.

Loaded from TOML (a preset name under slidedp/presets/hardware/ or a file). Every number carries a
source: each section has a `source` string and may override it per field in a `sources` sub-table
(`[pcie.sources] h2d_gbps = "..."`). Rates are converted once at load to bytes/s, FLOP/s, elements/s.
The host's spec and its table's parsing are in slidedp/spec/host.py; the schema of every table is
here.

Schema (units in names):
  [hardware]  name, description
  [gpu]       model, count, hbm_gib, hbm_gbps (memory bandwidth), peak_bf16_tflops, source
              achieved = [[hidden, tokens, tflops], ...]   achieved dense rate of one decoder layer
              [[gpu.layer_time]] hidden, ffn, seq, micro_batch, fwd_bwd_s (one micro-batch),
                                 source, sac_recompute_fraction (optional: policy sac's
                                 recompute / its forward), kernels (optional: "eager", the
                                 default, or "liger": the kernels timed; GpuSpec.row_kernels)
                                 (optional)
              [gpu.ops]  (optional) rates by kind of operation for a layer's time from
                         microbenchmarks and datasheets (slidedp/spec/gpu_ops.py): sms,
                         gemm_tflops at gemm_shape, copy_gbps, elementwise_fraction,
                         fused_fraction (optional: liger's kernels),
                         kernel_overhead_us, attention, attention_fwd_tflops, attention_bwd_tflops
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
              dram_teams_chunk_gbps = [[chunk_mib, GB/s, cast GB/s], ...]  (optional, with
              dram_teams_gbps) the same two teams with each call one task at a PCIe chunk size
              (chunk_mib as cast_chunk_gelem_per_s'), and the cast's part; by chunk_mib. When
              present, a graph's cap and cast weight take its upload chunk's (HostSpec.teams_at)
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
              adam_bf16_moments_gparam_per_s, adam_int8_moments_gparam_per_s =
              [[threads, rate]]  (optional) Adam with compact moments on an FP32 gradient
              (plan.moments; HostSpec.adam_rate)
              agent_gap_us = { cast = us, adam = us }  (optional) the executor's dispatch cost
              per CAST / ADAM task on its CPU agents (profile/agents.py; HostSpec.task_gap_s)
              rate_range = { adam = [slow, fast], cast = [slow, fast] }  (optional) how far the
              profile's rounds of a kernel at the executor's team size read from its rate, as
              factors (slow <= 1 <= fast): the host's own spread, which brackets a host-bound
              prediction (HardwareSpec.host_corners)
  [fabric]    kind = pcie | nvlink-pairs | nvswitch, link_gbps (per GPU, per direction),
              cross_pair_gbps (nvlink-pairs: rate between pairs, over PCIe), latency_us,
              efficiency = {all_gather, reduce_scatter, reduce, all_reduce}  (fraction of link_gbps)
  [network]   (optional) nodes, nic_kind, nic_gbps, nic_latency_us: the nodes a job spans and
              each node's NIC (schema in slidedp/spec/network.py; without it: one node)
  [topology]  (optional) sockets, the PCIe tree and the GPU links: schema in
              slidedp/spec/topology.py; without it the flat spec is one socket and one switch
              (HardwareSpec.topology)
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from types import MappingProxyType

from slidedp.spec.curves import RateCurve, log_between
from slidedp.spec.errors import SpecError
from slidedp.spec.gpu_ops import GpuOps, parse_gpu_ops
from slidedp.spec.host import HostSpec, parse_host
from slidedp.spec.network import NetworkSpec, parse_network
from slidedp.spec.tomlio import Table, read_toml, sources_of, triples
from slidedp.spec.topology import Topology, flat_topology, parse_topology
from slidedp.spec.units import GB, GIB, MIB

FABRIC_KINDS = ("pcie", "nvlink-pairs", "nvswitch")
COLLECTIVES = ("all_gather", "reduce_scatter", "reduce", "all_reduce")
LAYER_KERNELS = ("eager", "liger")  # a measured layer_time row's kernels (exec/fused_kernels.py)


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
    kernels: str = "eager"  # the kernels the layer ran (exec/fused_kernels.py): eager | liger


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
    ops: GpuOps | None = None  # [gpu.ops]: rates by kind of operation (spec/gpu_ops.py)

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

    def measured_layer_s(self, hidden: int, ffn: int, seq: int, micro_batch: float,
                         kernels: str = "eager") -> float | None:
        """Measured fwd+bwd time of one layer of this shape with a plan's `kernels` (row_kernels),
        linear in micro-batch; None if absent."""
        return self._per_shape("fwd_bwd_s", hidden, ffn, seq, micro_batch, kernels)

    def measured_sac_recompute_fraction(self, hidden: int, ffn: int, seq: int,
                                        micro_batch: float, kernels: str = "eager") -> float | None:
        """Measured sac recompute / forward of one layer of this shape (row_kernels), linear
        between measured micro-batches, the nearest one's outside them; None if absent."""
        return self._per_shape("sac_recompute_fraction", hidden, ffn, seq, micro_batch, kernels,
                               proportional=False)

    def row_kernels(self, hidden: int, ffn: int, seq: int, kernels: str) -> str:
        """Whose layer_time rows of this shape stand for a plan's `kernels` (plan.kernels): its
        own where measured; "auto" takes liger's where measured (the profile ran liger, so the
        executor will), else eager's; a plan whose kernels were not measured takes the other
        kernels' rows."""
        have = {lt.kernels for lt in self.layer_times
                if (lt.hidden, lt.ffn, lt.seq) == (hidden, ffn, seq)}
        want = "liger" if kernels == "auto" else str(kernels)
        if want in have or not have:
            return want
        return next(iter(sorted(have)))

    def _per_shape(self, field: str, hidden: int, ffn: int, seq: int, micro_batch: float,
                   kernels: str, proportional: bool = True) -> float | None:
        """A LayerTime field at this layer shape and kernels, linear in micro-batch (proportional
        to it from a single row; a fraction is not: held at the measured micro-batches' ends)."""
        tag = self.row_kernels(hidden, ffn, seq, kernels)
        rows = sorted(
            (lt.micro_batch, getattr(lt, field))
            for lt in self.layer_times
            if (lt.hidden, lt.ffn, lt.seq, lt.kernels) == (hidden, ffn, seq, tag)
            and getattr(lt, field) is not None
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
    # the file's [topology] table; None: the flat spec stands for one (topology)
    explicit_topology: Topology | None = None
    network: NetworkSpec = field(default_factory=NetworkSpec)  # the nodes and their NICs

    @property
    def topology(self) -> Topology:
        """The sockets, PCIe tree and GPU links: the file's [topology], else the flat spec's
        one socket and one switch (spec/topology.py flat_topology), from the current fields."""
        if self.explicit_topology is not None:
            return self.explicit_topology
        return flat_topology(self.gpu.count, self.pcie, self.host, self.fabric)

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
            kernels = s.str("kernels", "eager", choices=LAYER_KERNELS)
            lts.append(LayerTime(s.int("hidden"), s.int("ffn"), s.int("seq"), s.int("micro_batch"),
                                 s.num("fwd_bwd_s"), s.str("source"), sac, kernels))
            s.done()
    ops = parse_gpu_ops(t.sub("ops"), peak) if t.has("ops") else None
    src = sources_of(t, keys)
    t.done()
    return GpuSpec(model, count, hbm, hbm_bps, peak, tuple(sorted(ach)), tuple(lts), src, ops)


def _pcie(t: Table) -> PcieSpec:
    keys = ["h2d_gbps", "d2h_gbps", "duplex_gbps", "all_h2d_gbps", "all_d2h_gbps", "all_total_gbps"]
    vals = [t.num(k) * GB for k in keys]
    chunks = [(r[0] * MIB, r[1] * GB, r[2] * GB) for r in triples(
        t.raw("chunk_gbps", []), t.where, "pcie.chunk_gbps", "[chunk_mib, h2d, d2h]")]
    if any(b[0] <= a[0] for a, b in zip(chunks, chunks[1:], strict=False)):
        raise SpecError(t.where, "pcie.chunk_gbps", "chunk_mib strictly increasing")
    src = sources_of(t, keys + (["chunk_gbps"] if chunks else []))
    t.done()
    return PcieSpec(*vals, sources=src, chunk_bps=tuple(chunks))


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
    src = sources_of(t, keys)
    t.done()
    return FabricSpec(kind, link, cross, lat, MappingProxyType(eff), src)


def parse_hardware(data: dict, where: str) -> HardwareSpec:
    root = Table(data, where)
    hw = root.sub("hardware")
    name, desc = hw.str("name"), hw.str("description", "")
    hw.done()
    gpu, pcie = _gpu(root.sub("gpu")), _pcie(root.sub("pcie"))
    host, fabric = parse_host(root.sub("host")), _fabric(root.sub("fabric"))
    topology = (parse_topology(root.sub("topology"), gpu.count, pcie, host, fabric.kind)
                if root.has("topology") else None)
    network = parse_network(root.sub("network") if root.has("network") else None)
    spec = HardwareSpec(name, desc, gpu, pcie, host, fabric, origin=where,
                        explicit_topology=topology, network=network)
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
