"""A hardware spec for a machine nobody profiled, from the one-GPU profile of its GPU and a
description of the machine (what the vendor's description, a datasheet, lscpu and
nvidia-smi topo -m tell: GPUs, sockets, cores, RAM, how the GPUs hang and are joined). The
cross-kind validation (cross_kind.py) predicts the larger lent kinds with it.

Machine file (TOML; every field names its source in [machine.sources] or `source`):
  [machine]  kind, description, gpus, gpu_model (the profile's [gpu] model), sockets (1),
             cores, ram_gib, pcie = "root-port" (each GPU on a PCIe root port of its own),
             nvlink_gbps (every GPU pair joined, per direction), nccl_efficiency (NCCL bus
             bandwidth / nvlink_gbps, every collective), nccl_latency_us

The hardware is the profile's, changed only where the machine differs, each changed number's
source saying by which rule:
  gpu       count = gpus. The profile's measured layers and achieved rows stay (the same GPU); a
            layer width it did not time gets achieved rows from its nearest timed width's,
            times gpu_ops' ratio between the two layers at the same micro-batch (the GPU's
            [gpu.ops] prices the shape; the measured rows give the level, sustained clocks
            included). The [gpu.ops] table given is written into the hardware.
  pcie      one GPU's link as profiled (rates, chunk curve); all GPUs at once: gpus x one GPU's
            (each on a root port of its own: nothing below the socket is shared)
  host      cores and RAM from the machine. A kernel keeps scaling as it did where last measured:
            each thread curve continues past its last point with the log-log slope of its last
            measured segment (AdamW's for the AdamW curves, the whole-buffer cast's for every
            cast curve), never above the socket's DRAM over the kernel's bytes per item. The
            DRAM caps (dram_gbps, the teams' runs, the run beside the copies) scale by
            (cores / the profile's cores) ^ AdamW's slope: AdamW is the DRAM-bound kernel, and
            its last segment is how the memory system's throughput grows with cores (profile
            h200-profile-0259: +8.1% per doubling from 12 to 16 threads; the paper's H100 host:
            +8.5-10% from 16 to 32 cores, method.md section 9). The teams' sizes become the
            machine's (plan.team_cores).
  fabric    nvswitch (every pair joined) at nvlink_gbps, NCCL efficiency and latency from the
            machine file (a one-GPU profile measures no collective)
  topology  one socket holding the cores, RAM, DRAM and the all-GPU DMA caps; a root port per
            GPU at one GPU's link; the GPUs' NVLink ports at nvlink_gbps
Every lent host has one socket; a machine of several sockets is refused (a SpecError): its
per-socket DRAM and the link between sockets need a rule of their own.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from slidedp.spec.errors import SpecError
from slidedp.spec.gpu_ops import achieved_rows
from slidedp.spec.hardware import HardwareSpec, parse_hardware
from slidedp.spec.model import ModelSpec, load_model, model_presets
from slidedp.spec.plan import team_cores
from slidedp.spec.tomlio import Table, read_toml, sources_of

PCIE_LAYOUTS = ("root-port",)
RULE = "slidedp/validate/scale_out.py"


@dataclass(frozen=True)
class Machine:
    """A machine file's [machine] table (module docstring)."""

    kind: str
    description: str
    gpus: int
    gpu_model: str
    sockets: int
    cores: int
    ram_gib: float
    pcie: str
    nvlink_gbps: float
    nccl_efficiency: float
    nccl_latency_us: float
    sources: MappingProxyType
    where: str = ""


def load_machine(path: str | Path) -> Machine:
    """A machine file; bad input is a SpecError naming the file and the field."""
    where = str(path)
    root = Table(read_toml(path), where)
    t = root.sub("machine")
    keys = ["gpus", "gpu_model", "sockets", "cores", "ram_gib", "pcie", "nvlink_gbps",
            "nccl_efficiency", "nccl_latency_us"]
    m = Machine(t.str("kind"), t.str("description", ""), t.int("gpus"), t.str("gpu_model"),
                t.int("sockets"), t.int("cores"), t.num("ram_gib"),
                t.str("pcie", choices=PCIE_LAYOUTS), t.num("nvlink_gbps"),
                t.num("nccl_efficiency"), t.num("nccl_latency_us", allow_zero=True),
                sources_of(t, keys), where)
    t.done()
    root.done()
    if m.sockets != 1:
        raise SpecError(where, "machine.sockets", f"1 (the scale-out rule prices one socket's "
                                                  f"DRAM), got {m.sockets}")
    if m.nccl_efficiency > 1:
        raise SpecError(where, "machine.nccl_efficiency", f"a fraction in (0, 1], got "
                                                          f"{m.nccl_efficiency}")
    return m


def scaled_hardware(profile: dict, profile_where: str, machine: Machine,
                    gpu_ops: dict | None = None, models: tuple[ModelSpec, ...] = ()
                    ) -> HardwareSpec:
    """The profile (a hardware document of one GPU) as `machine` (module docstring); `gpu_ops`
    a [gpu.ops] table, `models` the layers whose widths need achieved rows."""
    doc = scaled_document(profile, profile_where, machine, gpu_ops, models)
    return parse_hardware(doc, f"{profile_where} as {machine.kind} ({RULE})")


def scaled_document(profile: dict, profile_where: str, machine: Machine,
                    gpu_ops: dict | None = None, models: tuple[ModelSpec, ...] = ()) -> dict:
    """The hardware document scaled_hardware parses (loadable as a TOML hardware file)."""
    doc = copy.deepcopy(profile)
    gpu = doc.get("gpu", {})
    if gpu.get("count") != 1 or gpu.get("model") != machine.gpu_model:
        raise SpecError(profile_where, "gpu", f"the profile of one {machine.gpu_model} "
                                              f"({machine.where}), got {gpu.get('count')} x "
                                              f"{gpu.get('model')}")
    name = doc["hardware"]["name"]
    doc["hardware"] = {"name": f"{name} as {machine.kind}", "description": (
        f"{machine.description}: the one-GPU profile {name} scaled out by {RULE} to the "
        f"machine file {Path(machine.where).name} (no rate measured on that machine)")}
    _gpu(doc, machine, gpu_ops, models, profile_where)
    _pcie(doc["pcie"], machine)
    _host(doc["host"], machine, name)
    _fabric(doc, machine)
    _topology(doc, machine)
    return doc


def _said(table: dict, key: str, text: str) -> None:
    table.setdefault("sources", {})[key] = text


def _gpu(doc: dict, machine: Machine, gpu_ops: dict | None, models, where: str) -> None:
    g = doc["gpu"]
    g["count"] = machine.gpus
    _said(g, "count", f"machine file: {machine.sources['gpus']}")
    if gpu_ops is None:
        return
    g["ops"] = copy.deepcopy(gpu_ops)
    have = {int(r[0]) for r in g["achieved"]}
    spec = parse_hardware(doc, where).gpu
    added: list[str] = []
    for m in {m.hidden: m for m in models if not m.is_moe_layer()}.values():
        if m.hidden in have:
            continue
        rows = _rows_from_nearest(m, spec)
        g["achieved"] = sorted(g["achieved"] + rows)
        added += [f"{m.hidden} ({m.name})"] if rows else []
    if added:
        was = g.get("sources", {}).get("achieved", g["source"])
        _said(g, "achieved", f"{was}; rows of hidden {', '.join(added)} derived ({RULE}): the "
                             f"nearest timed width's rows times gpu_ops' ratio of the two layers "
                             f"at the same micro-batch ([gpu.ops])")


def _rows_from_nearest(m: ModelSpec, gpu) -> list[list[float]]:
    """Achieved rows for m's width: the nearest timed layer's rows x gpu_ops(m) / gpu_ops(it)."""
    timed = {(lt.hidden, lt.ffn, lt.seq) for lt in gpu.layer_times if lt.kernels == "eager"}
    if not timed:
        return []
    h0, ffn0, seq = min(timed, key=lambda s: abs(math.log(s[0] / m.hidden)))
    ref = next((r for r in map(load_model, model_presets())
                if (r.hidden, r.ffn) == (h0, ffn0) and not r.is_moe_layer()), None)
    if ref is None:
        return []
    rows = []
    for h, tokens, rate in gpu.achieved:
        if h != h0 or tokens % seq:
            continue
        mb = int(tokens) // seq
        (_, _, new), = achieved_rows(m, seq, (mb,), gpu)
        (_, _, old), = achieved_rows(ref, seq, (mb,), gpu)
        rows.append([m.hidden, int(tokens), round(rate / 1e12 * new / old, 1)])
    return rows


def _pcie(p: dict, machine: Machine) -> None:
    n = machine.gpus
    for key, one in (("all_h2d_gbps", "h2d_gbps"), ("all_d2h_gbps", "d2h_gbps"),
                     ("all_total_gbps", "duplex_gbps")):
        p[key] = round(n * p[one], 2)
        _said(p, key, f"derived ({RULE}): {n} x one GPU's {one}, each GPU on a root port of its "
                      f"own (machine file pcie: {machine.sources['pcie']})")


def _slope(pairs: list) -> float:
    """The log-log slope of a curve's last measured segment ([threads, rate] points)."""
    (t0, r0), (t1, r1) = pairs[-2:]
    return math.log(r1 / r0) / math.log(t1 / t0)


def _extended(pairs: list, slope: float, cores: int, cap: float, at: int = 0) -> list:
    """The curve's points, then points at doublings of its last thread count and at `cores`:
    the last rate x (threads / last threads) ^ slope, at most `cap`."""
    last = pairs[-1]
    t_last, r_last = last[at], last[-1]
    ts, t = [], 2 * t_last
    while t < cores:
        ts.append(t)
        t *= 2
    ts += [cores] if cores > t_last else []
    out = [list(p) for p in pairs]
    for t in ts:
        out.append(last[:at] + [t, round(min(cap, r_last * (t / t_last) ** slope), 4)])
    return out


def _host(h: dict, machine: Machine, profile: str) -> None:
    c0, c = int(h["cores"]), machine.cores
    k_adam, k_cast = _slope(h["adam_gparam_per_s"]), _slope(h["cast_gelem_per_s"])
    s = (c / c0) ** k_adam
    team = team_cores(c)
    rule = (f"derived ({RULE}) from {profile}'s figure on its {c0} cores: x ({c} / {c0}) ^ "
            f"{k_adam:.3f} = x {s:.3f}, the DRAM's growth with cores at AdamW's last measured "
            f"log-log slope")
    h["cores"], h["ram_gib"] = c, machine.ram_gib
    _said(h, "cores", f"machine file: {machine.sources['cores']}")
    _said(h, "ram_gib", f"machine file: {machine.sources['ram_gib']}")
    h["dram_gbps"] = round(h["dram_gbps"] * s, 2)
    _said(h, "dram_gbps", rule)
    dram = h["dram_gbps"]
    curve = (f"derived ({RULE}): {profile}'s measured points, continued to {c} threads at the "
             f"log-log slope of its last measured segment ({{}}), at most the DRAM ({dram} GB/s) "
             f"over {{}} B per item")
    adam_b, cast_b = h["adam_dram_bytes_per_param"], h["cast_dram_bytes_per_elem"]
    for key, k, b in (("adam_gparam_per_s", k_adam, adam_b),
                      ("adam_bf16_grad_gparam_per_s", k_adam, adam_b - 2),  # a BF16 gradient
                      ("cast_gelem_per_s", k_cast, cast_b)):
        if key in h:
            h[key] = _extended(h[key], k, c, dram / b)
            _said(h, key, curve.format(f"{'the cast' if b == cast_b else 'AdamW'}: {k:.3f}", b))
    if "cast_chunk_gelem_per_s" in h:
        chunks: dict[float, list] = {}
        for row in h["cast_chunk_gelem_per_s"]:
            chunks.setdefault(row[0], []).append(row)
        h["cast_chunk_gelem_per_s"] = [r for rows in chunks.values()
                                       for r in _extended(rows, k_cast, c, dram / cast_b, at=1)]
        _said(h, "cast_chunk_gelem_per_s",
              curve.format(f"the whole-buffer cast's: {k_cast:.3f}", cast_b))
    scaled = {"dram_teams_gbps": (-1,), "dram_teams_cast_gbps": None,
              "dram_teams_chunk_gbps": (1, 2), "dram_dma_gbps": (-1,),
              "dram_dma_teams_gbps": None}
    for key, cols in scaled.items():
        if key not in h:
            continue
        v = h[key]
        if cols is None:
            h[key] = round(v * s, 2)
        elif key == "dram_teams_chunk_gbps":
            h[key] = [[r[0], round(r[1] * s, 2), round(r[2] * s, 2)] for r in v]
        else:  # [cast threads, update threads, (GPUs,) GB/s]: the machine's teams
            h[key] = [team, team, *v[2:-1], round(v[-1] * s, 2)]
        _said(h, key, rule + (f"; the teams of {team} + {team} threads of plan.team_cores"
                              f"({c})" if key in ("dram_teams_gbps", "dram_dma_gbps") else ""))


def _fabric(doc: dict, machine: Machine) -> None:
    e, src = machine.nccl_efficiency, machine.sources
    doc["fabric"] = {
        "kind": "nvswitch", "link_gbps": machine.nvlink_gbps,
        "latency_us": machine.nccl_latency_us,
        "efficiency": dict.fromkeys(("all_gather", "reduce_scatter", "reduce", "all_reduce"), e),
        "source": "machine file", "sources": {
            "kind": "machine file: every GPU pair joined by NVLink, as an NVSwitch",
            "link_gbps": f"machine file: {src['nvlink_gbps']}",
            "latency_us": f"machine file: {src['nccl_latency_us']}",
            "efficiency": f"machine file: {src['nccl_efficiency']}"}}


def _topology(doc: dict, machine: Machine) -> None:
    p, h = doc["pcie"], doc["host"]
    dma = {"dma_h2d_gbps": p["all_h2d_gbps"], "dma_d2h_gbps": p["all_d2h_gbps"],
           "dma_duplex_gbps": p["all_total_gbps"]}
    port = {"socket": 0, "kind": "root-port", "h2d_gbps": p["h2d_gbps"],
            "d2h_gbps": p["d2h_gbps"], "duplex_gbps": p["duplex_gbps"],
            "source": f"machine file pcie: {machine.sources['pcie']}; [pcie]'s one-GPU rates"}
    doc["topology"] = {
        "memory": "interleave", "source": f"machine file ({RULE})",
        "socket": [{"cores": h["cores"], "ram_gib": h["ram_gib"], "dram_gbps": h["dram_gbps"],
                    **dma, "source": f"[host] and [pcie]'s all-GPU caps ({RULE}): one socket "
                                     f"({machine.sources['sockets']})"}],
        "switch": [dict(port) for _ in range(machine.gpus)],
        "gpus": {"switch": list(range(machine.gpus)), "nvswitch_gbps": machine.nvlink_gbps,
                 "source": f"machine file: {machine.sources['nvlink_gbps']}"}}
