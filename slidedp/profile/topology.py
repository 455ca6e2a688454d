"""What `slidedp profile` can see of the machine's topology, written as the [topology] table.

Read, never timed:
  NUMA nodes     /sys/devices/system/node/node*/cpulist and meminfo: each node's CPUs (physical
                 cores in this process's affinity: SMT siblings once) and memory -> one socket
                 per node (the schema's sockets are NUMA nodes)
  PCIe tree      /sys/bus/pci/devices/<GPU>'s real path: the bridges from the root port down to
                 the GPU; a switch is an upstream port below the root port (two GPUs behind the
                 same one share it), a GPU with none hangs on its root port; its node is the
                 root port's numa_node (else nvidia-smi topo -m's NUMA Affinity, else node 0)
  GPU links      nvidia-smi topo -m: NV# between a pair is NVLink (the [fabric] kind decides
                 bridges or NVSwitch); nvidia-smi topo -p2p r: which pairs may copy peer to peer
                 (OK), hence how far PCIe peer-to-peer reaches
Rates come from the profile's own sections: each GPU's link and the uplink of its switch are the
measured per-GPU copy rates (an uplink is not measured alone), a node's DRAM the host's measured
rate split evenly over the nodes, and on one node its DMA caps are the measured all-GPU copies.
On a CPU-only host the GPUs (from --base) hang under one switch on node 0, as the flat spec.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

SYSFS = Path("/sys")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PCI_ADDR = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")


@dataclass(frozen=True)
class NumaNode:
    index: int
    cores: int  # physical cores of this node in the process's affinity
    mem_bytes: float


@dataclass(frozen=True)
class TopoMatrix:
    """`nvidia-smi topo -m`: the GPU x GPU cells and each GPU's NUMA affinity (None: N/A)."""

    links: list[list[str]]
    numa: list[int | None]


# ---- parsers (pure) -----------------------------------------------------------------------------


def parse_topo_matrix(text: str) -> TopoMatrix | None:
    """The GPU rows of `nvidia-smi topo -m` (tab-separated, "X" on the diagonal); None without
    a GPU table."""
    rows = [[c.strip() for c in _ANSI.sub("", ln).split("\t")] for ln in text.splitlines()]
    header = next((r for r in rows if "GPU0" in r[1:] and not r[0].startswith("GPU")), None)
    if header is None:
        return None
    gpu_cols = [i for i, c in enumerate(header) if re.fullmatch(r"GPU\d+", c)]
    numa_col = header.index("NUMA Affinity") if "NUMA Affinity" in header else None
    gpus = {int(r[0][3:]): r for r in rows if re.fullmatch(r"GPU\d+", r[0])}
    n = len(gpu_cols)
    if sorted(gpus) != list(range(n)):
        return None
    links = [[gpus[i][c] if c < len(gpus[i]) else "" for c in gpu_cols] for i in range(n)]
    numa = []
    for i in range(n):
        cell = gpus[i][numa_col] if numa_col is not None and numa_col < len(gpus[i]) else ""
        numa.append(int(cell) if cell.isdigit() else None)
    return TopoMatrix(links, numa)


def parse_p2p_matrix(text: str) -> list[list[bool]] | None:
    """`nvidia-smi topo -p2p r`: True where a pair may copy peer to peer ("OK"); None without a
    GPU table."""
    m = parse_topo_matrix(text)
    if m is None:
        return None
    return [[c == "OK" or c == "X" for c in row] for row in m.links]


def parse_cpulist(text: str) -> set[int]:
    """A sysfs cpulist ("0-3,8,10-11") -> its CPUs."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.update(range(int(a), int(b or a) + 1))
    return out


def pcie_chain(real_path: str) -> list[str]:
    """The PCI addresses on a device's sysfs real path, root port first, the device last."""
    return [p for p in real_path.split("/") if _PCI_ADDR.match(p)]


def bus_id(nvidia_smi_id: str) -> str:
    """nvidia-smi's "00000000:18:00.0" -> sysfs's "0000:18:00.0"."""
    dom, _, rest = nvidia_smi_id.strip().lower().partition(":")
    return f"{dom[-4:]}:{rest}"


# ---- grouping (pure) ----------------------------------------------------------------------------


def switches_of(chains: list[list[str]]) -> tuple[list[dict], list[int]]:
    """(switches, switch index of each GPU) from each GPU's PCIe chain: a switch is an upstream
    port below the root port (chain positions 1, 3, ... before the GPU), nested ones under the
    one above; a GPU right on its root port gets a root port of its own. Each switch:
    {"key", "root", "parent", "kind"}."""
    switches: list[dict] = []
    index: dict[str, int] = {}
    under = []
    for chain in chains:
        ups = chain[1:-1:2] if len(chain) > 2 else []
        parent = None
        for up in ups or [chain[0]]:
            if up not in index:
                index[up] = len(switches)
                switches.append({"key": up, "root": chain[0], "parent": parent,
                                 "kind": "switch" if ups else "root-port"})
            parent = index[up]
        under.append(parent)
    return switches, under


def p2p_reach(ok: list[list[bool]], socket_of: list[int], switch_of: list[int],
              nvlinked: set[tuple[int, int]]) -> str:
    """How far PCIe peer-to-peer reaches (topology.gpus.p2p) from the pairs that may copy peer
    to peer, NVLink pairs left out: anywhere, within a socket, below one switch, or nowhere."""
    n = len(ok)
    pairs = [(r, s) for r in range(n) for s in range(r + 1, n) if (r, s) not in nvlinked]
    if all(ok[r][s] for r, s in pairs):
        return "system"
    if all(ok[r][s] for r, s in pairs if socket_of[r] == socket_of[s]):
        return "socket"
    if all(ok[r][s] for r, s in pairs if switch_of[r] == switch_of[s]) and any(
            ok[r][s] for r, s in pairs):
        return "switch"
    return "none"


# ---- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Seen:
    """What the probes read (probe()); each part empty or None where it could not be read."""

    nodes: list[NumaNode]
    chains: list[list[str]]  # per GPU, its PCIe chain ([] where unknown)
    node_of_root: dict[str, int]  # root port -> its NUMA node
    topo: TopoMatrix | None
    p2p: list[list[bool]] | None


def topology_table(machine, doc: dict, seen: Seen) -> dict:
    """The [topology] table of a profile: the nodes, PCIe tree and GPU links `seen`, with rates
    from the profile's other sections in `doc` (module docstring)."""
    host, pcie = doc["host"], doc["pcie"]
    n_gpus = doc["gpu"]["count"]
    nodes = seen.nodes if sum(x.cores for x in seen.nodes) == host["cores"] else []
    sockets = _sockets(machine, host, pcie, nodes)
    node_ix = {x.index: k for k, x in enumerate(nodes)}
    chains_known = len(seen.chains) == n_gpus and all(seen.chains)
    if chains_known:
        switches, under = switches_of(seen.chains)
        where = "measured: the PCIe bridges on each GPU's sysfs path"
    else:
        switches = [{"key": "one switch", "root": "", "parent": None, "kind": "switch"}]
        under = [0] * n_gpus
        where = "derived: no PCIe path read, every GPU under one switch (the flat spec's reading)"
    top_socket = {}
    for r, i in enumerate(under):  # a top switch's node: its root port's, else its GPUs'
        top = _top(switches, i)
        node = seen.node_of_root.get(switches[top]["root"])
        if node is None and seen.topo is not None:
            node = seen.topo.numa[r]
        if top not in top_socket or top_socket[top] is None:
            top_socket[top] = node_ix.get(node)
    # an uplink is not measured alone: a real switch's is taken as wide as a GPU's link, the
    # one switch of the flat reading carries the all-GPU caps
    keys = ("h2d_gbps", "d2h_gbps", "duplex_gbps")
    uplink = ({k: pcie[k] for k in keys} if chains_known else
              dict(zip(keys, (pcie["all_h2d_gbps"], pcie["all_d2h_gbps"], pcie["all_total_gbps"]),
                       strict=True)))
    why = ("estimate: the measured per-GPU copy rates of [pcie] (an uplink is not measured alone)"
           if chains_known else "[pcie]'s measured all-GPU copies")
    table_switches = []
    for i, sw in enumerate(switches):
        t = {"socket": top_socket.get(_top(switches, i)) or 0, "kind": sw["kind"]} | uplink
        if sw["parent"] is not None:
            t["parent"] = sw["parent"]
        t["source"] = machine.source(f"{where} ({sw['key']}); uplink: {why}")
        table_switches.append(t)
    socket_of = [table_switches[i]["socket"] for i in under]
    gpus = {"switch": under, "source": machine.source(where)}
    gpus |= _gpu_links(doc["fabric"], n_gpus, seen, socket_of, under, machine)
    table = {"memory": "interleave", "source": machine.source("see each field"),
             "sources": {"memory": "estimate: threads and pages are not bound to nodes; pages "
                                   "spread over them"}}
    if len(sockets) > 1:
        table["socket_link_gbps"] = round(host["dram_gbps"] / len(sockets), 2)
        table["sources"]["socket_link_gbps"] = ("estimate: not measured; one node's share of the "
                                                "host's DRAM rate")
    return table | {"socket": sockets, "switch": table_switches, "gpus": gpus}


def _sockets(machine, host: dict, pcie: dict, nodes: list[NumaNode]) -> list[dict]:
    """[[topology.socket]]: one per NUMA node read (cores, its share of RAM, an even share of the
    host's DRAM rate), else one with all of [host]; on one socket, [pcie]'s all-GPU caps."""
    if not nodes:
        one = {"cores": host["cores"], "ram_gib": host["ram_gib"], "dram_gbps": host["dram_gbps"],
               "source": machine.source("derived: one socket holding [host]'s cores, RAM and "
                                        "DRAM rate (no NUMA nodes read)")}
        return [one | _dma_caps(pcie)]
    mem = sum(x.mem_bytes for x in nodes)
    out = []
    for x in nodes:
        out.append({"cores": x.cores, "ram_gib": round(host["ram_gib"] * x.mem_bytes / mem, 2),
                    "dram_gbps": round(host["dram_gbps"] / len(nodes), 2),
                    "source": machine.source(
                        f"measured: NUMA node {x.index} of /sys/devices/system/node, {x.cores} "
                        f"physical cores in the affinity, ram_gib its share of the nodes' "
                        f"MemTotal; dram_gbps derived: [host]'s measured rate split evenly over "
                        f"{len(nodes)} nodes")})
    return [out[0] | _dma_caps(pcie)] if len(out) == 1 else out


def _dma_caps(pcie: dict) -> dict:
    """A single socket's DMA caps: [pcie]'s measured all-GPU copies."""
    keys = {"dma_h2d_gbps": "all_h2d_gbps", "dma_d2h_gbps": "all_d2h_gbps",
            "dma_duplex_gbps": "all_total_gbps"}
    return {k: pcie[v] for k, v in keys.items()} | {
        "sources": {k: f"[pcie] {v}: {_src(pcie, v)}" for k, v in keys.items()}}


def _src(section: dict, key: str) -> str:
    return section.get("sources", {}).get(key, section["source"])


def _top(switches: list[dict], i: int) -> int:
    while switches[i]["parent"] is not None:
        i = switches[i]["parent"]
    return i


def _gpu_links(fabric: dict, n: int, seen: Seen, socket_of: list[int], switch_of: list[int],
               machine) -> dict:
    """[topology.gpus]' NVLink and peer-to-peer fields, agreeing with [fabric]'s kind."""
    kind, link = fabric["kind"], fabric["link_gbps"]
    link_src = f"[fabric] link_gbps: {_src(fabric, 'link_gbps')}"
    out: dict = {}
    src: dict = {}
    nv = set()
    if seen.topo is not None:
        nv = {(r, s) for r in range(n) for s in range(r + 1, n)
              if seen.topo.links[r][s].startswith("NV")}
    if kind == "nvswitch":
        out["nvswitch_gbps"], src["nvswitch_gbps"] = link, link_src
    elif kind == "nvlink-pairs":
        pairs = sorted(nv) or [(r, r + 1) for r in range(0, n - 1, 2)]
        out |= {"nvlink": [list(p) for p in pairs], "nvlink_gbps": link}
        src |= {"nvlink": machine.source("measured: NV# pairs of nvidia-smi topo -m"),
                "nvlink_gbps": link_src}
    if seen.p2p is not None and len(seen.p2p) == n:
        out["p2p"] = p2p_reach(seen.p2p, socket_of, switch_of, nv)
        src["p2p"] = machine.source("measured: nvidia-smi topo -p2p r (pairs that may read peer "
                                    "to peer)")
    else:
        out["p2p"] = "system"
        src["p2p"] = "estimate: not read (nvidia-smi topo -p2p r gave nothing); peer-to-peer taken "\
                     "as reaching every pair"
    if kind != "nvswitch" and out["p2p"] != "none":
        key = "cross_pair_gbps" if "cross_pair_gbps" in fabric else "link_gbps"
        out["p2p_gbps"] = fabric[key]
        src["p2p_gbps"] = f"[fabric] {key}: {_src(fabric, key)}"
    return out | {"sources": src}


# ---- probes (I/O) -------------------------------------------------------------------------------


def _run(*cmd: str) -> str:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def read_nodes(sysfs: Path = SYSFS) -> list[NumaNode]:
    """The NUMA nodes with CPUs in this process's affinity ([] where sysfs has none)."""
    affinity = os.sched_getaffinity(0)
    nodes = []
    for d in sorted((sysfs / "devices/system/node").glob("node[0-9]*"),
                    key=lambda p: int(p.name[4:])):
        try:
            cpus = parse_cpulist((d / "cpulist").read_text()) & affinity
            mem = next(int(ln.split()[-2]) * 1024 for ln in (d / "meminfo").read_text().splitlines()
                       if "MemTotal" in ln)
        except (OSError, StopIteration, ValueError):
            return []
        cores = set()
        for c in cpus:
            topo = sysfs / f"devices/system/cpu/cpu{c}/topology"
            try:
                cores.add(((topo / "physical_package_id").read_text().strip(),
                           (topo / "core_id").read_text().strip()))
            except OSError:
                cores.add(("cpu", str(c)))
        if cores:
            nodes.append(NumaNode(int(d.name[4:]), len(cores), float(mem)))
    return nodes


def gpu_bus_ids() -> list[str]:
    """Each GPU's PCI address, in nvidia-smi's GPU order ([] without nvidia-smi)."""
    return [bus_id(ln.split(",")[1]) for ln in _run(
        "nvidia-smi", "--query-gpu=index,pci.bus_id", "--format=csv,noheader").splitlines()
        if "," in ln]


def probe(topo_text: str, sysfs: Path = SYSFS, ids: list[str] | None = None) -> Seen:
    """Read the NUMA nodes, each GPU's PCIe chain (by its bus id, `ids` or nvidia-smi's, in GPU
    order) and its root port's node, and the peer-to-peer matrix."""
    ids = gpu_bus_ids() if ids is None else ids
    chains, node_of_root = [], {}
    for b in ids:
        try:
            chain = pcie_chain(os.path.realpath(sysfs / "bus/pci/devices" / b))
        except OSError:
            chain = []
        chains.append(chain)
        if chain:
            try:
                node = int((sysfs / "bus/pci/devices" / chain[0] / "numa_node").read_text())
            except (OSError, ValueError):
                node = -1
            if node >= 0:
                node_of_root[chain[0]] = node
    return Seen(read_nodes(sysfs), chains, node_of_root, parse_topo_matrix(topo_text),
                parse_p2p_matrix(_run("nvidia-smi", "topo", "-p2p", "r")))


def recorded_topology(machine, doc: dict, topo_text: str) -> dict:
    """The [topology] table of this machine's profile (probe, then topology_table)."""
    return topology_table(machine, doc, probe(topo_text) if machine.gpu_count else
                          Seen(read_nodes(), [], {}, None, None))

