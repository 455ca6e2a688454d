"""The table printed at the end of `slidedp profile`: what was measured, against its limits.

Achieved figures are set beside what bounds them (gpt-fast style): Adam's implied DRAM traffic
against the copy bandwidth, the layer's TFLOP/s against the matmul and the datasheet peak, the
collectives' bus bandwidth against the P2P link.
"""

from __future__ import annotations

from slidedp.profile.agents import LAYERS
from slidedp.profile.fabric import LATENCY_BYTES, bus_bytes
from slidedp.profile.run import CAST_CHUNK, HOST_KERNELS, TEAMS, Request, Results
from slidedp.spec.hardware import COLLECTIVES, HardwareSpec
from slidedp.spec.units import GB, MIB

UNSTEADY = 0.10  # a host rate whose rounds differ by more than this gets a warning


def _table(title: str, head: list[str], rows: list[list[str]]) -> str:
    cols = [head, *rows]
    w = [max(len(r[i]) for r in cols) for i in range(len(head))]
    fmt = "  ".join(f"{{:>{n}}}" for n in w)
    return "\n".join([title, fmt.format(*head), *(fmt.format(*r) for r in rows)])


def round_spreads(res: Results) -> dict[str, float]:
    """How far the host rates' rounds differed, per sampled kernel (Rounds.spread: 0.5 = some
    rate of it differed by 50% between rounds), in the order the summary lists them."""
    sampled = res.host_rounds.kernels()
    return {k: res.host_rounds.spread(k) for k in (*HOST_KERNELS, CAST_CHUNK, *TEAMS)
            if k in sampled}


def unsteady(spreads: dict[str, float]) -> bool:
    """Whether some host rate's rounds differed by more than UNSTEADY (the summary warns)."""
    return max(spreads.values(), default=0.0) > UNSTEADY


def rounds_line(req: Request, res: Results) -> str:
    """round_spreads as a line of the summary; a warning where they are unsteady."""
    spread = round_spreads(res)
    line = (f"host rates: {req.sizes.host_rounds} rounds, each on fresh buffers; the rounds "
            "differed by up to " + ", ".join(f"{v:.0%} ({k})" for k, v in spread.items()))
    if unsteady(spread):
        line += (f". Above {UNSTEADY:.0%}: this machine's host rates vary from run to run (with "
                 "where the buffers land, as on the nvidia-h200 VMs, or with other load); "
                 "host-bound predictions hold only within that spread, as the executor's own runs "
                 "do. More rounds (--host-rounds) narrow the average; on a shared machine, "
                 "profile again when it is idle")
    return line


def summary(req: Request, res: Results, spec: HardwareSpec, path: str) -> str:
    parts = [_table(
        f"host ({res.host_bytes // MIB} MiB buffers; Adam traffic at "
        f"{spec.host.adam_dram_bytes_per_param:g} B/param)",
        ["threads", "copy GB/s", "cast Gelem/s", "adam Gparam/s", "adam GB/s",
         "adam, BF16 grad Gparam/s", "adam, bf16 moments", "adam, int8 moments"],
        [[str(n), f"{res.dram_bps[n] / GB:.1f}", f"{res.cast_elems_per_s[n] / 1e9:.2f}",
          f"{res.adam_params_per_s[n] / 1e9:.2f}",
          f"{res.adam_params_per_s[n] * spec.host.adam_dram_bytes_per_param / GB:.1f}",
          f"{res.adam_bf16_grad_params_per_s[n] / 1e9:.2f}",
          *(f"{rates[n] / 1e9:.2f}" if n in rates else "-"
            for rates in (res.adam_bf16_moments_params_per_s,
                          res.adam_int8_moments_params_per_s))]
         for n in res.threads])]
    parts.append(rounds_line(req, res))
    if res.dram_teams is not None:
        ct, ut, bps, cast_bps = res.dram_teams
        line = (f"host memory traffic: cast {ct} + update {ut} threads at once {bps / GB:.1f} GB/s"
                f" (the cast {cast_bps / GB:.1f}; its weight beside Adam "
                f"{spec.host.cast_weight():.2f})")
        if res.dram_teams_chunk:
            line += "; by chunk: " + ", ".join(
                f"{c // MIB} MiB {bps / GB:.1f} (the cast {cast / GB:.1f}, weight "
                f"{spec.host.cast_weight(c):.2f})"
                for c, (bps, cast) in sorted(res.dram_teams_chunk.items()))
        if res.dram_dma is not None:
            line += f"; with {res.dram_dma[2]} GPU(s) copying both ways {res.dram_dma[3] / GB:.1f} GB/s"
            if res.dma_weight is not None:
                line += f", a copied byte costing the teams {res.dma_weight:.2f} of one"
            slowdown = spec.host.dma_slowdown_bps()
            if slowdown is not None:
                line += (f" (copies of D GB/s cap each CPU kernel at {slowdown / GB:.0f} / "
                         f"({slowdown / GB:.0f} + D) of its speed)")
        parts.append(line)
    if res.cast_chunk_elems_per_s:
        chunks = sorted({c for c, _ in res.cast_chunk_elems_per_s})
        ring = "pinned" if res.cast_chunk_pinned else "not pinned"
        parts.append(_table(
            f"cast FP32 -> BF16 by chunk (Gelem/s; chunk = BF16 MiB, into a {ring} ring of "
            f"{res.cast_chunk_slots})", ["threads", *(f"{c // MIB} MiB" for c in chunks)],
            [[str(n), *(f"{res.cast_chunk_elems_per_s[(c, n)] / 1e9:.2f}" for c in chunks)]
             for n in res.threads]))
    if res.pcie_alone_bps:
        gpus = sorted({g for g, _, _ in res.pcie_alone_bps})
        chunks = sorted({c for _, _, c in res.pcie_alone_bps})
        parts.append(_table(
            "PCIe, one GPU alone (GB/s)", ["GPU", "chunk MiB", "H2D", "D2H"],
            [[str(g), str(c // MIB), f"{res.pcie_alone_bps[(g, 'h2d', c)] / GB:.1f}",
              f"{res.pcie_alone_bps[(g, 'd2h', c)] / GB:.1f}"] for g in gpus for c in chunks]))
        line = "duplex per GPU: " + ", ".join(f"GPU {g} {v / GB:.1f}"
                                              for g, v in sorted(res.pcie_duplex_bps.items()))
        if res.pcie_all_bps:
            line += "; all GPUs at once: " + ", ".join(f"{k} {v / GB:.1f}"
                                                       for k, v in res.pcie_all_bps.items())
        parts.append(line + " GB/s")
    if res.matmul_flops_per_s:
        parts.append(f"bf16 matmul 8192^3: {res.matmul_flops_per_s / 1e12:.0f} TFLOP/s "
                     f"(peak_bf16_tflops {spec.gpu.peak_bf16_flops / 1e12:.0f})")
    if res.layers:
        steady = {(t.model, t.seq, t.micro_batch, t.policy): t for t in res.sustained}

        def sustained(t) -> list[str]:
            u = steady.get((t.model, t.seq, t.micro_batch, t.policy))
            if u is None:
                return ["-", "-", "-"]
            return [f"{u.total_s * 1e3:.2f}", f"{u.total_s / t.total_s:.3f}", f"{u.busy:.0%}"]

        parts.append(_table(
            "one decoder layer, GPU 0 (fwd: no-grad for policy layer; bwd: recompute + bwd; "
            "short runs, then sustained back to back: the steady time written as fwd_bwd_s)",
            ["model", "seq", "mb", "policy", "fwd ms", "bwd ms", "total ms", "TFLOP/s",
             "sustained ms", "x short", "GPU busy"],
            [[t.model, str(t.seq), str(t.micro_batch), t.policy, f"{t.fwd_s * 1e3:.2f}",
              f"{t.bwd_s * 1e3:.2f}", f"{t.total_s * 1e3:.2f}", f"{t.flops_per_s / 1e12:.0f}",
              *sustained(t)] for t in res.layers]))
    if res.agent_gaps is not None:
        name, seq, gaps = res.agent_gaps
        parts.append(f"executor dispatch per CPU task ({name} cut to {LAYERS} layers, seq {seq}): "
                     + ", ".join(f"{k} {v * 1e6:.0f} us over {gaps.pairs[k]} ready pairs"
                                 for k, v in gaps.gap_s.items()))
    if res.layers_skipped:
        parts.append("out of memory, skipped: " + "; ".join(res.layers_skipped))
    if res.collective_s:
        n, link = spec.gpu.count, res.link_bps
        sizes = [c * MIB for c in req.sizes.collective_mib]
        parts.append(_table(
            f"NCCL busbw GB/s on {n} GPUs (P2P link {link / GB:.0f} GB/s; all_reduce of "
            f"{LATENCY_BYTES // 1024} KiB {res.collective_s[('latency', LATENCY_BYTES)] * 1e6:.0f} us)",
            ["op", *(f"{s // MIB} MiB" for s in sizes), "efficiency"],
            [[op, *(f"{bus_bytes(op, s, n) / res.collective_s[(op, s)] / GB:.0f}" for s in sizes),
              f"{spec.fabric.efficiency[op]:.2f}"] for op in COLLECTIVES]))
    parts.append(f"wrote {path} ({spec.name}: {spec.description})")
    return "\n\n".join(parts)
