"""Results + a base hardware spec -> the hardware TOML document (schema: slidedp/spec/hardware.py).

Every number carries a source: "slidedp profile <date> on <host> (<cpu>, <gpus>): measured: ..."
for what was measured here, "derived: ..." for byte counts, and "from <base>: not measured here
(<why>); there: <the base's source>" for what this machine cannot measure:
  no CUDA device       the gpu, pcie and fabric sections (and the base's layer times)
  CUDA                 gpu.hbm_gbps and gpu.peak_bf16_tflops: datasheet figures (the measured
                       bf16 matmul is quoted in the peak's source)
  one GPU              the fabric section; the all-GPU PCIe caps are the single-GPU figures
  unknown GPU links    the fabric section (nvidia-smi topo -m gave no pattern we know)
Written rates: PCIe, the largest chunk's rate of the slowest GPU (chunk_gbps: every chunk, the
slowest GPU's); DRAM, the best copy rate over thread counts; fabric efficiency, busbw / link at
the largest message. Layer times are policy `none` (fwd with autograd + bwd: what fwd_bwd_s
means to the cost model, which takes recompute = fwd / 3 of it), the sustained run's steady time
where it ran (else the short runs' median); the `layer` policy time and the short runs are
quoted in each row's source; sac_recompute_fraction, where measured, is policy sac's recompute
over its forward (the executor's policy code, one run), which prices the elementwise part of
every recompute (graph/costs.py flops_per_hbm_byte). `achieved` = counted FLOPs / that time, the median where several
shapes share (hidden, tokens). The cast by chunk size is host.cast_chunk_gelem_per_s.
"""

from __future__ import annotations

import statistics

from slidedp.exec.adamw import WIDEN_BLOCK
from slidedp.profile import agents
from slidedp.profile.compute import LayerTiming
from slidedp.profile.fabric import LATENCY_BYTES, bus_bytes, gpu_link_matrix, nv_peers
from slidedp.profile.host import (
    ADAM_DRAM_BYTES_PER_PARAM,
    CAST_DRAM_BYTES_PER_ELEM,
    MIN_CHUNK_SLICES,
)
from slidedp.profile.machine import Machine
from slidedp.profile.pcie import DIRECTIONS
from slidedp.profile.run import (
    CAST_CHUNK,
    TEAMS_ALONE,
    TEAMS_CHUNK,
    TEAMS_S_PER_ROUND,
    TEAMS_WITH_DMA,
    Request,
    Results,
)
from slidedp.profile.timing import Rounds, rounds_rule
from slidedp.profile.topology import recorded_topology
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import COLLECTIVES, HardwareSpec
from slidedp.spec.host import MOMENTS_KEYS, RANGE_KERNELS
from slidedp.spec.plan import Plan, team_cores
from slidedp.spec.units import GB, GIB, MIB

GPU_KEYS = ("count", "hbm_gib", "hbm_gbps", "peak_bf16_tflops", "achieved")
PCIE_KEYS = ("h2d_gbps", "d2h_gbps", "duplex_gbps", "all_h2d_gbps", "all_d2h_gbps",
             "all_total_gbps")


def g4(x: float) -> float:
    """Four significant digits: what a median of a few runs supports."""
    return float(f"{x:.4g}")


def unmeasured(machine: Machine, fabric_kind: str | None) -> dict[str, str]:
    """Fields (or whole sections) this machine cannot measure -> why; they need --base."""
    if not machine.gpu_count:
        return dict.fromkeys(("gpu", "pcie", "fabric"), "no CUDA device")
    out = dict.fromkeys(("gpu.hbm_gbps", "gpu.peak_bf16_tflops"), "a datasheet figure")
    if machine.gpu_count == 1:
        out["fabric"] = "one GPU: no fabric to measure"
    elif fabric_kind is None:
        out["fabric"] = "nvidia-smi topo -m gave no known GPU link pattern"
    return out


def require_base(missing: dict[str, str], base: HardwareSpec | None) -> None:
    if missing and base is None:
        what = "; ".join(f"{k} ({why})" for k, why in missing.items())
        raise SpecError("command line", "--base", "a hardware preset or TOML to take what this "
                        f"machine cannot measure from: {what}")


def rate_range(rounds: Rounds, team: int) -> dict[str, list[float]]:
    """host.rate_range from a profile's rounds: each kernel of RANGE_KERNELS sampled at the
    executor's team size, [slowest, fastest] kept round over its rate (Rounds.range)."""
    return {k: [g4(x) for x in rounds.range((k, team))] for k in RANGE_KERNELS
            if rounds.samples.get((k, team))}


def rate_range_rule(ranged: dict, team: int, n_rounds: int) -> str:
    """What host.rate_range is, for its source line."""
    return (" and ".join(ranged) + f" at the executor's team size ({team} threads), the slowest "
            f"and the fastest of the {n_rounds} rounds (each on fresh buffers) that the rate "
            f"keeps ({rounds_rule(n_rounds)}), over the rate: how far this host's speed moves "
            "with where its buffers land")


class Assembler:
    def __init__(self, machine: Machine, req: Request, res: Results, base: HardwareSpec | None):
        self.m, self.req, self.res, self.base = machine, req, res, base
        self.missing = unmeasured(machine, req.fabric_kind)
        if machine.gpu_count and not self._none_layers():
            self.missing["gpu.achieved"] = "no layer timing ran (no --model, or out of memory)"
        require_base(self.missing, base)

    def _from_base(self, section: str, key: str, why: str) -> str:
        there = self.base.source_of(section, key)
        return f"from {self.base.origin}: not measured here ({why}); there: {there}"

    def _none_layers(self) -> list[LayerTiming]:
        """Policy none, one row per short-run shape: its sustained timing where that ran."""
        steady = {(t.model, t.seq, t.micro_batch): t for t in self.res.sustained
                  if t.policy == "none"}
        return [steady.get((t.model, t.seq, t.micro_batch), t) for t in self.res.layers
                if t.policy == "none"]

    def _how_timed(self, rows: list[LayerTiming]) -> str:
        s = self.req.sizes
        short = f"median of {s.repeats} after {s.warmup} warm-up"
        if not any(r.iterations for r in rows):
            return short
        return (f"sustained: policy layer then policy none back to back, at least "
                f"{s.sustained_min_iters} iterations each and about {s.sustained_s:g} s in all, "
                f"median of each policy's last half (short runs: {short})")

    def document(self, name: str) -> dict:
        m = self.m
        desc = (f"measured by slidedp profile {m.date} on {m.hostname}: {m.cpu_model}, {m.cores} "
                f"cores, {m.ram_bytes / GIB:.0f} GiB RAM, {m.gpus()}")
        sections = sorted({k.split(".")[0] for k, v in self.missing.items() if "." not in k})
        if sections:
            desc += f" ({', '.join(sections)} from {self.base.origin})"
        doc = {"hardware": {"name": name, "description": desc}, "gpu": self._gpu(),
               "pcie": self._pcie(), "host": self._host(), "fabric": self._fabric()}
        return doc | {"topology": recorded_topology(self.m, doc, self.req.topology)}

    # ---- gpu -------------------------------------------------------------------------------

    def _gpu(self) -> dict:
        m, b = self.m, self.base
        if not m.gpu_count:
            why = self.missing["gpu"]
            g = b.gpu
            return {"model": g.model, "count": g.count, "hbm_gib": g4(g.hbm_bytes / GIB),
                    "hbm_gbps": g4(g.hbm_bps / GB), "peak_bf16_tflops": g4(g.peak_bf16_flops / 1e12),
                    "source": f"from {b.origin}: not measured here ({why})",
                    "achieved": [[int(h), int(t), g4(r / 1e12)] for h, t, r in g.achieved],
                    "sources": {k: self._from_base("gpu", k, why) for k in GPU_KEYS},
                    "layer_time": [{"hidden": lt.hidden, "ffn": lt.ffn, "seq": lt.seq,
                                    "micro_batch": lt.micro_batch, "fwd_bwd_s": lt.fwd_bwd_s}
                                   | ({} if lt.sac_recompute_fraction is None
                                      else {"sac_recompute_fraction": lt.sac_recompute_fraction})
                                   | {"kernels": lt.kernels}
                                   | {"source": f"from {b.origin}: not measured here ({why}); "
                                                f"there: {lt.source}"} for lt in g.layer_times]}
        peak = b.gpu.peak_bf16_flops
        other = f" (its GPU: {b.gpu.model})" if b.gpu.model != m.gpu_model else ""
        t = {"model": m.gpu_model, "count": m.gpu_count, "hbm_gib": g4(m.hbm_bytes / GIB),
             "hbm_gbps": g4(b.gpu.hbm_bps / GB), "peak_bf16_tflops": g4(peak / 1e12),
             "source": m.source("measured: torch.cuda device count and total memory")}
        src = {"hbm_gbps": self._from_base("gpu", "hbm_gbps", "a datasheet figure") + other,
               "peak_bf16_tflops": self._from_base("gpu", "peak_bf16_tflops", "a datasheet "
                                                   "figure") + other + "; measured here: bf16 "
                                                   f"matmul 8192^3 {self.res.matmul_flops_per_s / 1e12:.0f}"
                                                   " TFLOP/s on GPU 0"}
        rows = self._none_layers()
        if rows:
            t["achieved"] = self._achieved(rows, peak)
            src["achieved"] = m.source(
                "measured: counted FLOPs of one decoder layer (ModelSpec.layer_flops_per_token, "
                "fwd + bwd) / its fwd + bwd time, policy none, bf16 SDPA on GPU 0, CUDA events, "
                + self._how_timed(rows))
            t["sources"] = src
            t["layer_time"] = self._layer_rows(rows)
        else:
            t["achieved"] = [[int(h), int(n), g4(r / 1e12)] for h, n, r in b.gpu.achieved]
            t["sources"] = src | {"achieved": self._from_base("gpu", "achieved",
                                                              self.missing["gpu.achieved"])}
        return t

    def _achieved(self, rows: list[LayerTiming], peak: float) -> list[list]:
        by_shape: dict[tuple[int, int], list[float]] = {}
        for r in rows:
            by_shape.setdefault((r.hidden, r.seq * r.micro_batch), []).append(r.flops_per_s)
        out = []
        for (h, n), rates in sorted(by_shape.items()):
            rate = statistics.median(rates)
            if rate > peak:
                raise SpecError(
                    "command line", "--base", f"a peak_bf16_tflops above the measured "
                    f"{rate / 1e12:.0f} TFLOP/s (hidden {h}, {n} tokens); {self.base.origin} "
                    f"gives {peak / 1e12:.0f}: is it this GPU's datasheet figure?")
            out.append([h, n, g4(rate / 1e12)])
        return out

    def _layer_rows(self, rows: list[LayerTiming]) -> list[dict]:
        res, sz = self.res, self.req.sizes

        def by_key(timings: list[LayerTiming], policy: str) -> dict[tuple, LayerTiming]:
            return {(t.model, t.seq, t.micro_batch): t for t in timings if t.policy == policy}

        short_none, short_ckpt = by_key(res.layers, "none"), by_key(res.layers, "layer")
        steady_ckpt = by_key(res.sustained, "layer")
        out, seen = [], set()
        for r in rows:
            shape = (r.hidden, r.ffn, r.seq, r.micro_batch)
            if shape in seen:  # two models with one layer shape: the first one's row
                continue
            seen.add(shape)
            key = (r.model, r.seq, r.micro_batch)
            s0 = short_none[key]
            ckpt = steady_ckpt.get(key) if r.iterations else short_ckpt.get(key)
            what = (f"measured: one {r.model} decoder layer, bf16 SDPA, {r.kernels} kernels, GPU 0,"
                    " CUDA events")
            if r.iterations:
                n_ckpt = ckpt.iterations if ckpt is not None else 0
                what += (f"; sustained: after one untimed iteration, {n_ckpt} policy-layer then "
                         f"{r.iterations} policy-none fwd + bwd iterations back to back, no sync "
                         f"between ({r.span_s:.2f} s of GPU time, GPU busy {r.busy:.1%} of it), "
                         "each policy's median of its last half")
            else:
                what += f", median of {sz.repeats} after {sz.warmup} warm-up"
            what += (f"; policy none (fwd_bwd_s): fwd {r.fwd_s * 1e3:.2f} ms + bwd "
                     f"{r.bwd_s * 1e3:.2f} ms = {r.total_s * 1e3:.2f} ms, "
                     f"{r.flops_per_s / 1e12:.0f} TFLOP/s")
            if ckpt is not None:
                what += (f"; policy layer: no-grad fwd {ckpt.fwd_s * 1e3:.2f} ms + recompute and "
                         f"bwd {ckpt.bwd_s * 1e3:.2f} ms = {ckpt.total_s / r.total_s:.2f}x the none"
                         " time (the cost model takes 4/3)")
            if r.iterations:
                c0 = short_ckpt.get(key)
                what += (f"; short runs (median of {sz.repeats} after {sz.warmup} warm-up): none "
                         f"fwd {s0.fwd_s * 1e3:.2f} ms + bwd {s0.bwd_s * 1e3:.2f} ms = "
                         f"{s0.total_s * 1e3:.2f} ms (sustained / short "
                         f"{r.total_s / s0.total_s:.3f})")
                if c0 is not None:
                    what += f", layer {c0.total_s * 1e3:.2f} ms"
            row = {"hidden": r.hidden, "ffn": r.ffn, "seq": r.seq,
                   "micro_batch": r.micro_batch, "fwd_bwd_s": g4(r.total_s), "kernels": r.kernels}
            sac = res.sac_recompute_fraction.get(key)
            if sac is not None:
                row["sac_recompute_fraction"] = g4(sac)
                what += (f"; sac_recompute_fraction: policy sac's recompute (memory-bound ops "
                         f"only) / its forward, {sac:.3f}, both timed in one run of the "
                         f"executor's policy code (exec/policy_profile.py), medians of "
                         f"{sz.repeats}")
            out.append(row | {"source": self.m.source(what)})
        return out

    # ---- pcie ------------------------------------------------------------------------------

    def _pcie(self) -> dict:
        m, b, res, s = self.m, self.base, self.res, self.req.sizes
        if not m.gpu_count:
            why = self.missing["pcie"]
            p = b.pcie
            t = {k: g4(getattr(p, k.replace("gbps", "bps")) / GB) for k in PCIE_KEYS}
            t["source"] = f"from {b.origin}: not measured here ({why})"
            sources = {k: self._from_base("pcie", k, why) for k in PCIE_KEYS}
            if p.chunk_bps:
                t["chunk_gbps"] = [[g4(c / MIB), g4(h / GB), g4(d / GB)] for c, h, d in p.chunk_bps]
                sources["chunk_gbps"] = self._from_base("pcie", "chunk_gbps", why)
            return t | {"sources": sources}
        gpus = range(m.gpu_count)
        chunks = s.chunk_bytes()
        big = max(chunks)

        def slowest(d: str, c: int) -> float:
            return min(res.pcie_alone_bps[(gi, d, c)] for gi in gpus)

        def per_gpu(vals: list[float]) -> str:
            return "" if len(vals) < 2 else ("; slowest of the GPUs: " +
                                             ", ".join(f"{v / GB:.1f}" for v in vals) + " GB/s")

        alone = (f"measured: one {big // MIB} MiB copy alone from/to host memory pinned with "
                 f"cudaHostRegister, CUDA events, median of {s.repeats}")
        stream = f"{s.stream_copies} back-to-back {big // MIB} MiB copies per direction"
        t = {"h2d_gbps": g4(slowest("h2d", big) / GB), "d2h_gbps": g4(slowest("d2h", big) / GB),
             "duplex_gbps": g4(min(res.pcie_duplex_bps.values()) / GB)}
        src = {f"{d}_gbps": m.source(f"{alone} ({d.upper()})" + per_gpu(
            [res.pcie_alone_bps[(gi, d, big)] for gi in gpus])) for d in DIRECTIONS}
        src["duplex_gbps"] = m.source(
            f"measured: H2D and D2H at once on two streams of one GPU, {stream}, both directions' "
            f"bytes / wall time, median of {s.repeats}" + per_gpu(list(res.pcie_duplex_bps.values())))
        if m.gpu_count >= 2:
            for key, k in (("all_h2d_gbps", "h2d"), ("all_d2h_gbps", "d2h"), ("all_total_gbps", "both")):
                t[key] = g4(res.pcie_all_bps[k] / GB)
                src[key] = m.source(
                    f"measured: all {m.gpu_count} GPUs at once ({k}), one host thread per GPU, "
                    f"{stream}, all bytes / (last finish - first start), median of {s.repeats}")
        else:
            for key, one in (("all_h2d_gbps", "h2d_gbps"), ("all_d2h_gbps", "d2h_gbps"),
                             ("all_total_gbps", "duplex_gbps")):
                t[key] = t[one]
                src[key] = m.source(f"measured: one GPU, so the all-GPU cap is the {one} figure")
        t["chunk_gbps"] = [[c // MIB, g4(slowest("h2d", c) / GB), g4(slowest("d2h", c) / GB)]
                           for c in chunks]
        src["chunk_gbps"] = m.source(f"{alone.replace(f'one {big // MIB} MiB', 'one chunk-size')}"
                                     "; the slowest GPU's rate at each chunk size")
        t["source"] = m.source(alone)
        return t | {"sources": src}

    # ---- host ------------------------------------------------------------------------------

    def _host(self) -> dict:
        m, res, s = self.m, self.res, self.req.sizes
        mib = res.host_bytes // MIB
        best = max(res.dram_bps, key=res.dram_bps.get)

        def curve(rates: dict[int, float]) -> str:
            return ", ".join(f"{n} thr {rates[n] / 1e9:.2f}" for n in res.threads)

        sample = (f"a sample of at least {s.host_sample_s:g} s (the kernel repeated)"
                  if s.host_sample_s else "one run")

        def pool(kernel: str) -> str:
            spread = res.host_rounds.spread(kernel)
            return ("torch.set_num_threads, threads not pinned (OpenMP placement), "
                    f"{rounds_rule(s.host_rounds)} of {s.host_rounds} rounds over the thread "
                    "counts, each on "
                    f"fresh buffers and {sample}, the first after {s.warmup} warm-up (a rate's "
                    f"rounds differed by up to {spread:.0%})")
        adam_top = res.adam_params_per_s[res.threads[-1]]
        compact = {fmt: rates for fmt, rates in (("bf16", res.adam_bf16_moments_params_per_s),
                                                 ("int8", res.adam_int8_moments_params_per_s))
                   if rates}  # the update with compact moments, where measured
        # DRAM capacity: the most traffic any measured kernel moved. A plain copy undercounts
        # (its writes also read the line first), so the Adam or cast traffic can exceed it; a
        # capacity below a measured kernel's traffic would make the model slower than measured.
        moved = {"copy": res.dram_bps[best],
                 "adam": max(res.adam_params_per_s.values()) * ADAM_DRAM_BYTES_PER_PARAM,
                 "cast": max(res.cast_elems_per_s.values()) * CAST_DRAM_BYTES_PER_ELEM}
        chunked = res.cast_chunk_elems_per_s
        if chunked:
            moved["cast by chunk"] = max(chunked.values()) * CAST_DRAM_BYTES_PER_ELEM
        dram_from = max(moved, key=moved.get)
        traffic = ", ".join(f"{k}{self._bytes_per(k)} {v / GB:.0f}" for k, v in moved.items())
        t = {
            "cores": m.cores, "ram_gib": g4(m.ram_bytes / GIB),
            "dram_gbps": g4(moved[dram_from] / GB),
            "cast_gelem_per_s": [[n, g4(res.cast_elems_per_s[n] / 1e9)] for n in res.threads],
            "adam_gparam_per_s": [[n, g4(res.adam_params_per_s[n] / 1e9)] for n in res.threads],
            "adam_bf16_grad_gparam_per_s": [[n, g4(res.adam_bf16_grad_params_per_s[n] / 1e9)]
                                            for n in res.threads],
            **{MOMENTS_KEYS[fmt]: [[n, g4(rates[n] / 1e9)] for n in res.threads]
               for fmt, rates in compact.items()},
            "adam_dram_bytes_per_param": ADAM_DRAM_BYTES_PER_PARAM,
            "cast_dram_bytes_per_elem": CAST_DRAM_BYTES_PER_ELEM,
            "source": m.source(f"measured on {mib} MiB buffers (LLC {m.llc_bytes // MIB} MiB; "
                               f"{m.huge_pages})"),
            "sources": {
                "cores": m.source(f"measured: physical cores in this process's CPU affinity mask "
                                  f"({m.cpus} logical CPUs)"),
                "ram_gib": m.source("measured: MemTotal (a VM that grows its memory on demand "
                                    "reads low)"),
                "dram_gbps": m.source(
                    f"measured: the largest DRAM traffic of the measured kernels, from {dram_from} "
                    f"({traffic} GB/s); copy = torch copy_ of a {mib} MiB FP32 "
                    f"buffer, (bytes read + written) / time, best over threads ({best}); GB/s: "
                    f"{curve(res.dram_bps)}; " + pool("copy")),
                "cast_gelem_per_s": m.source(
                    f"measured: torch copy_ FP32 -> BF16 of {mib} MiB of FP32, elements / time; "
                    + pool("cast")),
                "adam_gparam_per_s": m.source(
                    "measured: torch fused CPU AdamW (slidedp.exec.adamw.adamw_chunk, as "
                    f"torch.optim.AdamW(fused=True)) on {mib // 4}M FP32 parameters with an FP32 "
                    "gradient (as the GPU widened it: plan.grad_widen = gpu), params / time; "
                    f"{pool('adam')}; at {res.threads[-1]} threads "
                    f"{adam_top * ADAM_DRAM_BYTES_PER_PARAM / GB:.0f} GB/s of state traffic"),
                "adam_bf16_grad_gparam_per_s": m.source(
                    f"measured: the same Adam on a BF16 gradient, widened {WIDEN_BLOCK} elements "
                    "at a time in cache (slidedp.exec.adamw.adamw_chunk, as plan.grad_widen = "
                    f"host runs it), params / time; {pool('adam bf16 grad')}"),
                **{MOMENTS_KEYS[fmt]: m.source(
                    f"measured: the same Adam with {fmt} moments (slidedp.exec.moments, as "
                    f"plan.moments = {fmt} runs it: dequantize, fused AdamW, requantize block by "
                    f"block), FP32 gradient, params / time; {pool(f'adam {fmt} moments')}")
                   for fmt in compact},
                "adam_dram_bytes_per_param": "derived: read p, m, v, g and write p, m, v, "
                                             "FP32 (7 x 4 B)",
                "cast_dram_bytes_per_elem": "derived: read 4 B FP32, write 2 B BF16",
            },
        }
        if res.dram_teams is not None:
            ct, ut, bps, cast_bps = res.dram_teams
            t["dram_teams_gbps"] = [ct, ut, g4(bps / GB)]
            t["dram_teams_cast_gbps"] = g4(cast_bps / GB)
            t["sources"]["dram_teams_gbps"] = m.source(
                f"measured: a cast team of {ct} threads (torch copy_ FP32 -> BF16 of {mib} MiB) "
                f"and an update team of {ut} threads (fused AdamW on {mib // 4}M parameters), "
                "each in its own thread with its own OpenMP team as the executor runs them, at "
                f"once for {TEAMS_S_PER_ROUND:g} s in each of the {s.host_rounds} rounds of "
                "the host rates: (6 B x cast elements + 28 B x Adam parameters) / time, "
                f"{rounds_rule(s.host_rounds)} of the rounds (they differed by up to "
                f"{res.host_rounds.spread(TEAMS_ALONE):.0%})")
            t["sources"]["dram_teams_cast_gbps"] = m.source(
                "measured: the cast team's own part of dram_teams_gbps, 6 B x cast elements / "
                f"time, {rounds_rule(s.host_rounds)} of the rounds (the rest is the update team's; "
                "HostSpec.cast_weight)")
            if res.dram_teams_chunk:
                t["dram_teams_chunk_gbps"] = [[c // MIB, g4(bps / GB), g4(cast / GB)]
                                              for c, (bps, cast) in sorted(
                                                  res.dram_teams_chunk.items())]
                t["sources"]["dram_teams_chunk_gbps"] = m.source(
                    "measured: the teams of dram_teams_gbps, each call one of the executor's "
                    "tasks at a PCIe chunk size instead of a whole buffer (a cast of the chunk's "
                    "BF16 elements, chunk_mib / 2 B, an AdamW of the parameters of an FP32 "
                    "gradient chunk, chunk_mib / 4 B, each on the next slice of buffers holding "
                    f"at least {MIN_CHUNK_SLICES} of its tasks), at once for "
                    f"{TEAMS_S_PER_ROUND:g} s at each chunk size in each round after the "
                    "whole-buffer run, each round from another size: "
                    "[chunk_mib, (6 B x cast elements + 28 B x Adam parameters) / time, the "
                    f"cast's 6 B x elements / time], {rounds_rule(s.host_rounds)} of the rounds "
                    f"(they differed by up to {res.host_rounds.spread(TEAMS_CHUNK):.0%}; "
                    "HostSpec.teams_at)")
        if res.dram_dma is not None:
            ct, ut, gpus, bps = res.dram_dma
            t["dram_dma_gbps"] = [ct, ut, gpus, g4(bps / GB)]
            t["sources"]["dram_dma_gbps"] = m.source(
                f"measured: the teams-at-once run (dram_teams_gbps: cast {ct} + update {ut} "
                f"threads) with each of {gpus} GPU(s) copying {s.stream_copies} x "
                f"{max(s.chunk_mib)} MiB both ways at once, pinned (a thread per GPU), "
                f"{s.host_rounds} runs of {TEAMS_S_PER_ROUND:g} s, each on fresh buffers: (the "
                "teams' bytes + the copies' bytes) / time, all host-memory traffic of the "
                f"executor's mix, {rounds_rule(s.host_rounds)} of the runs (they differed by up to "
                f"{res.host_rounds.spread(TEAMS_WITH_DMA):.0%})")
        if res.dma_weight is not None:
            t["dram_dma_weight"] = g4(res.dma_weight)
            t["sources"]["dram_dma_weight"] = m.source(
                "measured: in each run of dram_dma_gbps, on its buffers, the teams alone and then "
                "beside the copies: (the teams' traffic alone - theirs beside the copies) / the "
                "copies' traffic, within [0, 1], the mean of the runs' (without the largest and "
                f"the smallest from {Rounds.TRIM_FROM} runs on): what a copied byte costs the CPU "
                "kernels' DRAM (HostSpec.dram_dma_weight)")
            if res.dma_teams_bps is not None:
                t["dram_dma_teams_gbps"] = g4(res.dma_teams_bps / GB)
                t["sources"]["dram_dma_teams_gbps"] = m.source(
                    "measured: the teams' own part of dram_dma_gbps (6 B x cast elements + 28 B x "
                    f"Adam parameters) / time, {rounds_rule(s.host_rounds)} of the runs: with "
                    "dram_dma_weight, how much a copy slows every CPU kernel "
                    "(HostSpec.dma_slowdown_bps)")
        if res.agent_gaps is not None and res.agent_gaps[2].gap_s:
            name, seq, gaps = res.agent_gaps
            t["agent_gap_us"] = {k: g4(v * 1e6) for k, v in gaps.gap_s.items()}
            t["sources"]["agent_gap_us"] = m.source(
                f"measured: the executor (slidedp.exec.Engine, {name} cut to {agents.LAYERS} "
                f"decoder layers, seq {seq}, one sequence, the default plan's "
                f"{Plan().h2d_chunk_mib:g} MiB chunks, "
                f"{gaps.steps} steps after {agents.WARMUP_STEPS} of warm-up): per CPU agent "
                "kind, the median of "
                "start(next task) - end(previous task) over consecutive tasks of one agent whose "
                "next task's inputs had all ended before (" + ", ".join(
                    f"{k} {n} pairs" for k, n in gaps.pairs.items()) + "); profile/agents.py")
        ranged = rate_range(res.host_rounds, team_cores(m.cores))
        if ranged and s.host_rounds > 1:
            t["rate_range"] = ranged
            t["sources"]["rate_range"] = m.source(
                "measured: " + rate_range_rule(ranged, team_cores(m.cores), s.host_rounds))
        if chunked:
            chunks = sorted({c for c, _ in chunked})
            t["cast_chunk_gelem_per_s"] = [[c // MIB, n, g4(chunked[(c, n)] / 1e9)]
                                           for c in chunks for n in res.threads]
            ring = (f"a ring of {res.cast_chunk_slots} chunk buffers (the plan's staging_chunks) "
                    + ("pinned with cudaHostRegister, as the executor's staging ring"
                       if res.cast_chunk_pinned else "not pinned (no CUDA)"))
            reps = ", ".join(f"{c // MIB} MiB {res.cast_chunk_repeats[c]}" for c in chunks)
            spread = res.host_rounds.spread(CAST_CHUNK)
            t["sources"]["cast_chunk_gelem_per_s"] = m.source(
                "measured: torch copy_ FP32 -> BF16 of one chunk (chunk_mib = its BF16 size, "
                "chunk_mib MiB / 2 B elements; the PCIe chunk sizes) from a slice rotating "
                f"through a {res.cast_chunk_src_bytes // MIB} MiB FP32 buffer into {ring}, "
                f"elements / time of one chunk; torch.set_num_threads, threads not pinned (OpenMP "
                f"placement), {rounds_rule(s.host_rounds)} of {s.host_rounds} rounds over the "
                "thread counts, "
                f"each on fresh buffers and the median of {reps} chunks, the first after "
                f"{s.warmup} warm-up (a rate's rounds differed by up to {spread:.0%})")
        return t

    @staticmethod
    def _bytes_per(kernel: str) -> str:
        return {"adam": f" x {ADAM_DRAM_BYTES_PER_PARAM} B", "cast": f" x "
                f"{CAST_DRAM_BYTES_PER_ELEM} B", "cast by chunk": f" x "
                f"{CAST_DRAM_BYTES_PER_ELEM} B"}.get(kernel, "")

    # ---- fabric ----------------------------------------------------------------------------

    def _fabric(self) -> dict:
        if "fabric" in self.missing:
            return self._fabric_from_base(self.missing["fabric"])
        m, res, s, kind = self.m, self.res, self.req.sizes, self.req.fabric_kind
        n, link = m.gpu_count, res.link_bps
        big = max(s.collective_mib) * MIB
        eff, lines = {}, []
        for op in COLLECTIVES:
            busbw = {nb: bus_bytes(op, nb, n) / res.collective_s[(op, nb)]
                     for nb in (c * MIB for c in s.collective_mib)}
            eff[op] = g4(min(1.0, busbw[big] / link))
            lines.append(f"{op} " + ", ".join(f"{nb // MIB} MiB {v / GB:.0f}"
                                              for nb, v in busbw.items()))
        matrix = gpu_link_matrix(self.req.topology)
        pairs = [matrix[i][j] for i in range(n) for j in range(i + 1, n)]
        links = ", ".join(f"{pairs.count(c)} of {len(pairs)} GPU pairs {c}"
                          for c in sorted(set(pairs)))
        peer = min(nv_peers(matrix)[0]) if nv_peers(matrix)[0] else 1
        t = {"kind": kind, "link_gbps": g4(link / GB)}
        src = {"kind": m.source(f"measured: nvidia-smi topo -m: {links}"),
               "link_gbps": m.source(f"measured: P2P copy GPU 0 -> {peer}, {s.stream_copies} "
                                     f"back-to-back {big // MIB} MiB copies, bytes / wall time, "
                                     f"median of {s.repeats}")}
        if kind == "nvlink-pairs":
            t["cross_pair_gbps"] = g4(res.cross_pair_bps / GB)
            src["cross_pair_gbps"] = m.source("measured: P2P copy GPU 0 -> a GPU outside its "
                                              "NVLink pair, as link_gbps")
        t["latency_us"] = g4(res.collective_s[("latency", LATENCY_BYTES)] * 1e6)
        t["efficiency"] = eff
        src["latency_us"] = m.source(f"measured: NCCL all_reduce of {LATENCY_BYTES // 1024} KiB "
                                     f"on {n} GPUs, median time")
        src["efficiency"] = m.source(
            f"measured: NCCL ({n} ranks, bf16, CUDA events, slowest rank's median of "
            f"{s.repeats}) busbw / link_gbps at {big // MIB} MiB, capped at 1; busbw GB/s by "
            f"full message size: {'; '.join(lines)}")
        t["source"] = m.source("measured: see each field")
        return t | {"sources": src}

    def _fabric_from_base(self, why: str) -> dict:
        f, origin = self.base.fabric, self.base.origin
        t = {"kind": f.kind, "link_gbps": g4(f.link_bps / GB)}
        keys = ["kind", "link_gbps", "latency_us", "efficiency"]
        if f.cross_pair_bps != f.link_bps:
            t["cross_pair_gbps"] = g4(f.cross_pair_bps / GB)
            keys.append("cross_pair_gbps")
        t["latency_us"] = g4(f.latency_s * 1e6)
        t["efficiency"] = {op: g4(f.efficiency[op]) for op in COLLECTIVES}
        t["source"] = f"from {origin}: not measured here ({why})"
        return t | {"sources": {k: self._from_base("fabric", k, why) for k in keys}}
