"""A hardware preset from a measured `slidedp profile` TOML: the same machine class with more GPUs.

For a kind that is not lent (nvidia-h200-x8, issue 7) the simulator needs a hardware file. This
script takes the profile of the largest machine of the class that was measured and changes only
what the larger kind is known to differ in, writing every assumption into the changed field's
source and into the file's header:
  - gpu.count, host.cores, host.ram_gib: the kind's description (--gpus, --cores, --ram-gib);
  - everything per GPU (layer times, achieved FLOP/s, one GPU's PCIe rates and chunk curve):
    the measured machine's (the same GPU and link);
  - the all-GPU PCIe aggregates and every host-memory rate (DRAM, cast, Adam, teams): the measured
    machine's, as measured with its GPU count and cores, each thread curve cut at the measured
    host's team size (cores - cores // 4, plan.team_cores) and flat beyond it: points with more
    threads ran teams on every core of that host, whose preemption (the cast by chunk at 64
    threads on the 64-core x4: a third of its 48-thread rate) the simulator models on its own
    (graph/build.team_share); where the larger host has more memory channels, host-bound steps
    come out pessimistic;
  - the NVLink fabric (kind, link rate, NCCL efficiencies and latency): the measured machine's
    (rings over more ranks are likely slower: collective-bound steps come out optimistic).
With the measured machine's own GPU count, cores and RAM it only renames the profile (a measured
preset). `--nic-gbps G --nic-source TEXT` adds a [network] table (spec/network.py): the NIC the
kind's nodes are assumed to have, one node by default, its source saying why (a profile
measures no network).

usage: python3 benchmarks/project_hardware.py PROFILE.toml OUT.toml --name NAME --gpus N
           --cores C --ram-gib G --kind "nvidia-h200-x8" [--nic-gbps G --nic-latency-us L
           --nic-source TEXT]
"""

from __future__ import annotations

import argparse
import sys
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidedp.profile.tomlw import dumps  # noqa: E402
from slidedp.spec.hardware import load_hardware  # noqa: E402
from slidedp.spec.plan import team_cores  # noqa: E402

HOST_RATES = ("dram_gbps", "cast_gelem_per_s", "adam_gparam_per_s", "adam_bf16_grad_gparam_per_s",
              "dram_teams_gbps", "dram_teams_cast_gbps", "dram_teams_chunk_gbps", "dram_dma_gbps",
              "dram_dma_weight", "dram_dma_teams_gbps", "cast_chunk_gelem_per_s", "rate_range")
THREAD_CURVES = {"cast_gelem_per_s": 0, "adam_gparam_per_s": 0, "adam_bf16_grad_gparam_per_s": 0,
                 "cast_chunk_gelem_per_s": 1}  # curve -> index of the thread count in a point
ALL_GPU_PCIE = ("all_h2d_gbps", "all_d2h_gbps", "all_total_gbps")
FABRIC = ("kind", "link_gbps", "latency_us", "efficiency")


def _source(table: dict, key: str) -> str:
    return table.get("sources", {}).get(key, table.get("source", "unknown"))


def _assume(table: dict, key: str, why: str) -> None:
    """Mark table[key] as carried over from the measured machine, with the reason."""
    table.setdefault("sources", {})[key] = f"projected: {why}; there: {_source(table, key)}"


def project(doc: dict, name: str, gpus: int, cores: int, ram_gib: float, kind: str) -> tuple[dict, str]:
    """(the projected document, its header) from a measured profile document."""
    gpu, host = doc["gpu"], doc["host"]
    measured = f"{doc['hardware']['name']} ({gpu['count']} GPUs, {host['cores']} cores)"
    same = (gpus, cores) == (gpu["count"], host["cores"])
    out = {k: dict(v) for k, v in doc.items()}
    out["hardware"] = {"name": name, "description": (
        f"{doc['hardware']['description']} (preset {name})" if same else
        f"{gpus}x {gpu['model']}, {cores} cores, {ram_gib:g} GiB: projected from the measured "
        f"profile {measured}")}
    if same:
        return out, f"{name}: the `slidedp profile` of {kind}, {doc['hardware']['name']} (measured)."
    g, h, p, f = (out[k] for k in ("gpu", "host", "pcie", "fabric"))
    for t in (g, h, p, f):
        t["sources"] = dict(t.get("sources", {}))
    g["count"], h["cores"], h["ram_gib"] = gpus, cores, ram_gib
    for t, key in ((g, "count"), (h, "cores"), (h, "ram_gib")):
        t["sources"][key] = f"projected: the device tool's description of {kind}"
    team = team_cores(host["cores"])
    for key, at in THREAD_CURVES.items():
        if key in h:
            h[key] = [point for point in h[key] if point[at] <= team]
    for key in HOST_RATES:
        if key in h:
            _assume(h, key, f"as in {measured}, thread curves cut at its team size {team} and "
                            "flat beyond (a larger host may have more memory channels: host-bound "
                            "steps pessimistic)")
    for key in ALL_GPU_PCIE:
        _assume(p, key, f"all GPUs at once as in {measured} (bound by its host memory; more "
                        "channels would raise it)")
    for key in FABRIC:
        _assume(f, key, f"the fabric of {gpu['count']} GPUs as in {measured} (rings over {gpus} "
                        "ranks are likely slower)")
    header = (f"{gpus}x {gpu['model']} on one host ({cores} cores, {ram_gib:g} GiB): PROJECTED, not "
              f"measured: {kind} was not lent.\nDerived by benchmarks/project_hardware.py from the "
              f"measured profile {measured}: per-GPU figures, host-memory rates (thread curves cut\n"
              f"at its team size), all-GPU PCIe aggregates and the NVLink fabric as measured there "
              f"(each changed field,\nand each carried one that depends on the machine's size, says "
              f"so in its source; per-GPU figures keep theirs).\n"
              f"Re-measure with `slidedp profile --base {name}` when the kind is lent.")
    return out, header


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("profile", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--name", required=True)
    ap.add_argument("--gpus", type=int, required=True)
    ap.add_argument("--cores", type=int, required=True)
    ap.add_argument("--ram-gib", type=float, required=True)
    ap.add_argument("--kind", required=True, help="the device kind, e.g. nvidia-h200-x8")
    ap.add_argument("--nic-gbps", type=float, help="each node's NIC, GB/s per direction")
    ap.add_argument("--nic-latency-us", type=float, default=5.0)
    ap.add_argument("--nic-source", help="where the NIC's figures come from (required with it)")
    a = ap.parse_args(argv)
    doc, header = project(tomllib.loads(a.profile.read_text()), a.name, a.gpus, a.cores,
                          a.ram_gib, a.kind)
    if a.nic_gbps is not None:
        if not a.nic_source:
            ap.error("--nic-gbps needs --nic-source")
        doc["network"] = {"nodes": 1, "nic_kind": "rdma", "nic_gbps": a.nic_gbps,
                          "nic_latency_us": a.nic_latency_us, "source": a.nic_source}
    a.out.write_text(dumps(doc, header))
    hw = load_hardware(str(a.out))  # it must load as the simulator reads it
    print(f"wrote {a.out}: {hw.name}, {hw.gpu.count} GPUs, {hw.host.cores} cores")


if __name__ == "__main__":
    main()
