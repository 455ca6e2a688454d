"""The host of a hardware spec: cores, memory, DRAM caps and the CPU kernels' rate curves (the
cast, AdamW), with what the profile measured of them running together and beside the GPUs'
copies, and the parsing of a hardware file's [host] table (its schema: slidedp/spec/hardware.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from slidedp.spec.curves import RateCurve, log_between
from slidedp.spec.errors import SpecError
from slidedp.spec.model import BF16
from slidedp.spec.tomlio import Table, sources_of, triples
from slidedp.spec.units import GB, GIB, MIB


@dataclass(frozen=True)
class HostSpec:
    """The host's figures, converted at load (bytes, bytes/s, elements/s, parameters/s)."""

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
    # the cast team's bytes/s in that run; None: not measured (older profiles)
    dram_teams_cast_bps: float | None = None
    # the same teams by chunk size, each call one task at a PCIe chunk size: (chunk BF16 bytes,
    # DRAM bytes/s, the cast team's bytes/s), by chunk; (): not measured (older profiles)
    dram_teams_chunk: tuple[tuple[float, float, float], ...] = ()
    # the same with every GPU's copies: (cast threads, update threads, GPUs, bytes/s); None: not
    # measured
    dram_dma: tuple[float, float, float, float] | None = None
    # the teams' traffic lost per copied byte, measured beside dram_dma against the teams alone
    # on the same buffers: with dram_dma_teams_bps (or the totals) it gives dma_slowdown_bps,
    # else each DMA byte draws this share of a byte of the CPU kernels' cap (graph/costs.py); 0
    # where not measured (older profiles, presets: the DMA draws only on memory_bps). On
    # nvidia-h200-x4 the teams kept their traffic beside four GPUs' copies (memory_bps); on
    # nvidia-h200 (benchmarks/probes/adam_after_d2h_probe.py) a D2H stream beside the update took
    # its 64 MiB chunks from 7.6 to 10.9 ms, a 5 ms pause after each copy to 8.5 ms
    dram_dma_weight: float = 0.0
    # the teams' own bytes/s beside the copies in the dram_dma run; None: not measured (older
    # profiles: dma_slowdown_bps derives it from the totals)
    dram_dma_teams_bps: float | None = None
    # Adam on a BF16 gradient widened in cache (plan.grad_widen = host), against threads; None:
    # not measured (older profiles, presets): the FP32 gradient's curve stands in
    adam_bf16_grad_params_per_s: RateCurve | None = None
    # the executor's dispatch seconds per task on its CPU agents, by kind ("cast", "adam"): added
    # to those tasks' durations (graph/costs.py); empty: not measured (older profiles, presets),
    # no dispatch cost
    task_gap_s: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # the host's spread, {kernel: (slow, fast)} factors over the kernel's rate, for "adam" and
    # "cast" (module docstring); empty: not measured (older profiles, presets)
    rate_range: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # Adam with compact moments (plan.moments), {"bf16" | "int8": parameters/s against threads}
    # on an FP32 gradient; empty: not measured (older profiles, presets): FP32's curve stands in
    adam_moments_params_per_s: MappingProxyType = field(
        default_factory=lambda: MappingProxyType({}))

    def with_rates(self, adam: float = 1.0, cast: float = 1.0) -> HostSpec:
        """This host with its AdamW curves (FP32 and BF16 gradient) times `adam` and its cast
        curves (by threads and by chunk) times `cast`; every other figure as measured (what is
        derived from the rates follows them: cast_weight, team_dram_bps without dram_teams)."""
        bf16 = self.adam_bf16_grad_params_per_s
        return replace(self, adam_params_per_s=self.adam_params_per_s.scaled(adam),
                       adam_moments_params_per_s=MappingProxyType(
                           {k: c.scaled(adam) for k, c in self.adam_moments_params_per_s.items()}),
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

    def adam_rate(self, threads: float, grad_bytes: int = 4, moments: str = "fp32") -> float:
        """Parameters/s of the CPU Adam with `threads` threads on a gradient of `grad_bytes`
        per element: 2, a BF16 gradient widened in cache (its own curve where measured); with
        compact `moments` (bf16, int8), that format's curve where measured (FP32 gradient),
        else the FP32 moments' curves stand in."""
        if moments != "fp32" and moments in self.adam_moments_params_per_s:
            return self.adam_moments_params_per_s[moments].at(threads)
        if grad_bytes == 2 and self.adam_bf16_grad_params_per_s is not None:
            return self.adam_bf16_grad_params_per_s.at(threads)
        return self.adam_params_per_s.at(threads)

    def team_dram_bps(self, threads: float, chunk_bytes: float | None = None) -> float:
        """DRAM bytes/s the host reaches when its CPU work runs in teams of `threads` threads,
        at most dram_bps (the most traffic any measured kernel moved, at any thread count):
        measured, where the profile ran the cast and update teams at once (dram_teams) with
        teams at least this large (at the chunk size `chunk_bytes`: teams_at); else the most
        traffic the measured kernels (Adam, the cast) moved at `threads`. Fewer threads keep
        fewer memory requests in flight: on nvidia-h200-x2, Adam moves 150 GB/s at 24 threads
        against 164 at 32, and the executor's measured traces draw about 150 GB/s while its
        24-thread update team runs (validation h200x2-8b-*)."""
        if self.dram_teams is not None and threads >= min(self.dram_teams[:2]):
            return min(self.dram_bps, self.teams_at(chunk_bytes)[0])
        kernels = max(self.adam_rate(threads) * self.adam_dram_bytes_per_param,
                      self.cast_rate(threads) * self.cast_dram_bytes_per_elem)
        return min(self.dram_bps, kernels)

    def teams_at(self, chunk_bytes: float | None = None) -> tuple[float, float | None]:
        """(DRAM bytes/s, the cast team's bytes/s or None) of the teams at once: with
        `chunk_bytes` and a dram_teams_chunk table, the run by chunk size at that chunk (linear
        in log chunk size between the measured chunks, clamped at the smallest and the largest);
        else the whole-buffer run (dram_teams, dram_teams_cast_bps). On nvidia-h200 the teams
        moved 95 / 101 / 106 GB/s by 16 / 64 / 256 MiB chunks against 110 GB/s on whole
        buffers, and the executor ran its 4B host-bound cases 8% faster at 256 MiB chunks than
        at 64; the simulated 12-configuration matrix went from 3.7% mean, 8.8% max error on the
        whole-buffer figures to 2.3% / 6.4% on these (benchmarks/RESULTS.md)."""
        if chunk_bytes is None or not self.dram_teams_chunk:
            return self.dram_teams[2], self.dram_teams_cast_bps
        rows = {c: (total, cast) for c, total, cast in self.dram_teams_chunk}
        keys = list(rows)
        return (log_between(keys, chunk_bytes, lambda c: rows[c][0]),
                log_between(keys, chunk_bytes, lambda c: rows[c][1]))

    def cast_weight(self, chunk_bytes: float | None = None) -> float:
        """How much of a saturated host-memory cap a CAST gets beside the update's ADAM, relative
        to it (the simulator's stage-2 weight, sim/resources.py): from the teams-at-once run at
        `chunk_bytes` (teams_at), (the cast team's bytes there / its bytes alone) / (the update
        team's bytes there / its bytes alone), each alone at its own team size. 1 (equal
        fractions of their own rates) where the profile did not record the split. On
        nvidia-h200-x2 (24 + 24 threads on 32 cores) a 64 MiB cast took 2.15 ms alone and 7.5 ms
        beside the update (benchmarks/probes/chunk_cost_probe.py): the cast is the weaker of the
        two.
        Approximations: without the run by chunk size, the cast's rate alone is the
        large-buffer one (a CAST task runs at its chunk size's, a few percent apart); with it,
        the cast's alone is the chunk's (the cast by chunk size, into a pinned ring) and the
        update's alone is still the large-buffer one (no AdamW by chunk size is measured); and
        the one weight stands for every team size and against the DMA too, though measured
        against Adam at the profile's teams only."""
        if self.dram_teams is None or self.dram_teams_cast_bps is None:
            return 1.0
        cast_t, update_t, _ = self.dram_teams
        total, cast = self.teams_at(chunk_bytes)
        if not 0 < cast < total:
            raise ValueError(f"the cast team's {cast:g} B/s outside (0, {total:g}), the teams'")
        # alone at the size the teams ran at: the chunk's, or the whole buffer's
        cast_elems = None if chunk_bytes is None or not self.dram_teams_chunk else (
            chunk_bytes / BF16)
        cast_alone = self.cast_rate(cast_t, cast_elems) * self.cast_dram_bytes_per_elem
        adam_alone = self.adam_rate(update_t) * self.adam_dram_bytes_per_param
        return (cast / cast_alone) / ((total - cast) / adam_alone)

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
        nvidia-h200 profiles: S 125-254 GB/s; a lone update's 64 MiB chunks beside a ~45 GB/s
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


def parse_host(t: Table) -> HostSpec:
    """The [host] table of a hardware file (slidedp/spec/hardware.py's schema)."""
    keys = ["cores", "ram_gib", "dram_gbps", "cast_gelem_per_s", "adam_gparam_per_s",
            "adam_dram_bytes_per_param", "cast_dram_bytes_per_elem"]
    src = sources_of(t, keys + [k for k in ("cast_chunk_gelem_per_s", "dram_teams_gbps",
                                          "dram_teams_cast_gbps", "dram_teams_chunk_gbps",
                                          "dram_dma_gbps",
                                          "dram_dma_weight", "dram_dma_teams_gbps",
                                          "adam_bf16_grad_gparam_per_s", "agent_gap_us",
                                          "rate_range", *MOMENTS_KEYS.values())
                          if t.has(k)])
    teams = dma = None
    if t.has("dram_teams_gbps"):
        (cast_t, update_t, gbps), = triples([t.raw("dram_teams_gbps")], t.where,
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
        (cast_t, update_t, gpus, gbps), = triples([t.raw("dram_dma_gbps")], t.where,
                                                   "host.dram_dma_gbps",
                                                   "[cast threads, update threads, GPUs, GB/s]", 4)
        dma = (cast_t, update_t, gpus, gbps * GB)
    teams_chunk = ()
    if t.has("dram_teams_chunk_gbps"):
        if teams_cast is None:
            raise SpecError(t.where, "host.dram_teams_chunk_gbps",
                            "only beside host.dram_teams_cast_gbps (the whole-buffer run)")
        teams_chunk = _teams_chunks(t.raw("dram_teams_chunk_gbps"), t.where)
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
                              src.get("cast_chunk_gelem_per_s", "")), teams, teams_cast,
                 teams_chunk, dma, dma_weight, dma_teams, adam_bf16,
                 _agent_gaps(t.raw("agent_gap_us", {}), t.where),
                 _rate_range(t.raw("rate_range", {}), t.where),
                 MappingProxyType({
                     fmt: RateCurve.from_pairs(t.raw(key), t.where, f"host.{key}", "param/s",
                                               src[key]).scaled(1e9)
                     for fmt, key in MOMENTS_KEYS.items() if t.has(key)}))
    t.done()
    return h


MOMENTS_KEYS = {"bf16": "adam_bf16_moments_gparam_per_s",  # HostSpec.adam_moments_params_per_s
                "int8": "adam_int8_moments_gparam_per_s"}
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


def _teams_chunks(rows, where: str) -> tuple[tuple[float, float, float], ...]:
    """host.dram_teams_chunk_gbps rows -> ((chunk BF16 bytes, bytes/s, the cast's bytes/s), ...),
    by chunk_mib strictly increasing, each cast part below its total."""
    name, last, out = "host.dram_teams_chunk_gbps", 0.0, []
    for c, total, cast in triples(rows, where, name, "[chunk_mib, GB/s, cast GB/s]"):
        if c <= last:
            raise SpecError(where, name, f"rows by chunk_mib strictly increasing, got {c} after "
                                         f"{last}")
        if cast >= total:
            raise SpecError(where, name, f"the cast's GB/s below the teams' at chunk_mib {c}, got "
                                         f"{cast} of {total}")
        last = c
        out.append((c * MIB, total * GB, cast * GB))
    return tuple(out)


def _cast_chunks(rows, where: str, source: str) -> tuple[tuple[float, RateCurve], ...]:
    """host.cast_chunk_gelem_per_s rows -> ((chunk elements, elem/s against threads), ...)."""
    name = "host.cast_chunk_gelem_per_s"
    by_chunk: dict[float, list[list]] = {}
    last = 0.0
    for r in triples(rows, where, name, "[chunk_mib, threads, gelem_per_s]"):
        if r[0] < last:
            raise SpecError(where, name, f"rows ordered by chunk_mib, got {r[0]} after {last}")
        last = r[0]
        by_chunk.setdefault(r[0], []).append([r[1], r[2]])
    return tuple((c * MIB / BF16, RateCurve.from_pairs(
        pairs, where, f"{name} (chunk_mib {c}: threads)", "elem/s", source).scaled(1e9))
        for c, pairs in by_chunk.items())
