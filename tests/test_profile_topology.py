"""What `slidedp profile` records of the topology (slidedp/profile/topology.py), on the CPU: the
parsers on captured `nvidia-smi topo` text and sysfs paths, the [topology] table they make (it
loads, and agrees with the profile's other sections), and the probes on a fake sysfs tree."""

from __future__ import annotations

import copy
import os
import tomllib
from dataclasses import dataclass

import pytest

from slidedp.profile.topology import (
    NumaNode,
    Seen,
    bus_id,
    parse_cpulist,
    parse_p2p_matrix,
    parse_topo_matrix,
    pcie_chain,
    probe,
    read_nodes,
    switches_of,
    topology_table,
)
from slidedp.spec.hardware import parse_hardware, preset_dir

LEGEND = """
Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node
  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)
  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)
  PIX  = Connection traversing at most a single PCIe bridge
  NV#  = Connection traversing a bonded set of # NVLinks
"""
# the lent 2x H200: NV18 between the GPUs, one socket
TOPO_2 = ("\t\x1b[4mGPU0\tGPU1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m\n"
          "GPU0\t X \tNV18\t0-31\t0\t\tN/A\n"
          "GPU1\tNV18\t X \t0-31\t0\t\tN/A\n" + LEGEND)


def _row(i: int) -> str:
    cells = []
    for j in range(8):
        if i == j:
            cells.append(" X ")
        elif i // 2 == j // 2:
            cells.append("NV8")
        elif i // 4 == j // 4:
            cells.append("NODE")
        else:
            cells.append("SYS")
    nic = "NODE" if i < 4 else "SYS"
    cpus, node = ("0-31,64-95", 0) if i < 4 else ("32-63,96-127", 1)
    return f"GPU{i}\t" + "\t".join(cells) + f"\t{nic}\t{cpus}\t{node}\t\tN/A\n"


# an 8-GPU PCIe server on two sockets: bridged pairs, two switches per socket
TOPO_8 = ("\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\tNIC0\tCPU Affinity\tNUMA Affinity"
          "\tGPU NUMA ID\n" + "".join(_row(i) for i in range(8))
          + "NIC0\tNODE\tNODE\tNODE\tNODE\tSYS\tSYS\tSYS\tSYS\t X \n" + LEGEND
          + "\nNIC Legend:\n\n  NIC0: mlx5_0\n")
P2P_8 = ("\tGPU0\tGPU1\tGPU2\tGPU3\tGPU4\tGPU5\tGPU6\tGPU7\n"
         + "".join(f"GPU{i}\t" + "\t".join("X" if i == j else ("OK" if i // 4 == j // 4 else "NS")
                                           for j in range(8)) + "\n" for i in range(8))
         + "\nLegend:\n\n  X    = Self\n  OK   = Status Ok\n  NS   = Not supported\n")
# sysfs real paths of the 8 GPUs: root port, switch upstream and downstream port, GPU
ROOTS = ["0000:15:01.0", "0000:37:01.0", "0000:97:01.0", "0000:b5:01.0"]
PATHS = [f"/sys/devices/pci0000:{ROOTS[i // 2][5:7]}/{ROOTS[i // 2]}/0000:{0x16 + i // 2 * 0x20:02x}"
         f":00.0/0000:{0x17 + i // 2 * 0x20:02x}:0{4 * (i % 2)}.0/0000:{0x18 + i // 2 * 0x20 + i % 2:02x}"
         f":00.0" for i in range(8)]


@dataclass(frozen=True)
class FakeMachine:
    gpu_count: int

    def source(self, what: str) -> str:
        return f"slidedp profile on a fake machine: {what}"


def _doc(preset: str) -> dict:
    """A profile document's flat sections: a preset's, without its [topology]."""
    raw = tomllib.loads((preset_dir() / f"{preset}.toml").read_text())
    raw.pop("topology")
    raw["gpu"].pop("ops", None)
    return raw


def test_topo_matrix_of_two_nv18_gpus_on_one_node():
    m = parse_topo_matrix(TOPO_2)
    assert m.links == [["X", "NV18"], ["NV18", "X"]]
    assert m.numa == [0, 0]


def test_topo_matrix_of_eight_gpus_on_two_sockets():
    m = parse_topo_matrix(TOPO_8)
    assert len(m.links) == 8 and m.links[0][1] == "NV8" and m.links[0][2] == "NODE"
    assert m.links[3][4] == "SYS" and m.numa == [0] * 4 + [1] * 4
    ok = parse_p2p_matrix(P2P_8)
    assert ok[0][3] and not ok[0][4] and ok[7][4]
    assert parse_topo_matrix("No devices were found\n") is None


def test_sysfs_paths_group_gpus_under_their_switches():
    chains = [pcie_chain(p) for p in PATHS]
    assert chains[0] == ["0000:15:01.0", "0000:16:00.0", "0000:17:00.0", "0000:18:00.0"]
    switches, under = switches_of(chains)
    assert under == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [s["kind"] for s in switches] == ["switch"] * 4
    assert [s["root"] for s in switches] == ROOTS
    # GPUs straight on root ports, and a switch under a switch
    direct, _ = switches_of([["0000:15:01.0", "0000:16:00.0"], ["0000:37:01.0", "0000:38:00.0"]])
    assert [s["kind"] for s in direct] == ["root-port"] * 2
    nested, under = switches_of([["r", "u1", "d1", "u2", "d2", "g0"], ["r", "u1", "d1", "g1"]])
    assert [(s["key"], s["parent"]) for s in nested] == [("u1", None), ("u2", 0)]
    assert under == [1, 0]
    assert bus_id("00000000:18:00.0") == "0000:18:00.0"
    assert parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}


def test_eight_gpu_two_socket_table_loads_and_follows_what_was_seen():
    doc = _doc("a800x8")
    nodes = [NumaNode(0, 32, 512 * 2**30), NumaNode(1, 32, 512 * 2**30)]
    seen = Seen(nodes, [pcie_chain(p) for p in PATHS],
                {ROOTS[0]: 0, ROOTS[1]: 0, ROOTS[2]: 1, ROOTS[3]: 1}, parse_topo_matrix(TOPO_8),
                parse_p2p_matrix(P2P_8))
    table = topology_table(FakeMachine(8), doc, seen)
    hw = parse_hardware(copy.deepcopy(doc) | {"topology": table}, "profile.toml")
    t = hw.topology
    assert t.cores_by_socket() == (32, 32)
    assert t.gpus.switch == (0, 0, 1, 1, 2, 2, 3, 3)
    assert [sw.socket for sw in t.switches] == [0, 0, 1, 1]
    assert t.gpus.nvlink == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert t.gpus.p2p == "socket"  # OK within a socket, not supported across
    staged = {h.resource: h.share for h in t.p2p(0, 4)}
    assert staged["socket0.dram"] == 2  # beyond the reach: through host memory
    assert "socket0.to1" in staged
    assert "socket0.dram" not in {h.resource for h in t.p2p(0, 2)}


def test_two_gpu_one_node_table_carries_the_measured_all_gpu_caps():
    doc = _doc("h200x2")
    seen = Seen([NumaNode(0, 32, 251 * 2**30)], [["0000:15:01.0", "0000:18:00.0"],
                                                 ["0000:37:01.0", "0000:38:00.0"]],
                {"0000:15:01.0": 0, "0000:37:01.0": 0}, parse_topo_matrix(TOPO_2), None)
    hw = parse_hardware(doc | {"topology": topology_table(FakeMachine(2), doc, seen)}, "p.toml")
    t = hw.topology
    assert len(t.sockets) == 1 and [sw.kind for sw in t.switches] == ["root-port"] * 2
    assert t.sockets[0].dma_h2d_bps == hw.pcie.all_h2d_bps
    assert t.all_gpus_bps("h2d") == pytest.approx(hw.pcie.all_h2d_bps)
    assert t.gpus.nvswitch_bps == hw.fabric.link_bps and t.gpus.p2p == "system"


def test_nothing_seen_is_the_flat_reading():
    doc = _doc("h200x2")
    hw = parse_hardware(doc | {"topology": topology_table(
        FakeMachine(0), doc, Seen([], [], {}, None, None))}, "p.toml")
    flat = parse_hardware(_doc("h200x2"), "flat.toml")
    assert hw.topology.resources() == pytest.approx(
        {k: v for k, v in flat.topology.resources().items() if not k.endswith(".p2p")}
        | {"socket0.h2d": flat.pcie.all_h2d_bps, "socket0.d2h": flat.pcie.all_d2h_bps,
           "socket0.duplex": flat.pcie.all_total_bps})


def _fake_sysfs(root, cpus_by_node, gpus):
    """Nodes with their CPUs and memory, and each GPU's device directory on its real path, linked
    from bus/pci/devices with its root port (numa_node = the GPU's node)."""
    for node, cpus in cpus_by_node.items():
        d = root / "devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(",".join(map(str, cpus)) + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {1048576 * (node + 1)} kB\n")
        for c in cpus:
            t = root / f"devices/system/cpu/cpu{c}/topology"
            t.mkdir(parents=True)
            (t / "physical_package_id").write_text(f"{node}\n")
            (t / "core_id").write_text(f"{c}\n")
    devices = root / "bus/pci/devices"
    devices.mkdir(parents=True)
    for path, node in gpus:
        real = root / path.lstrip("/")
        real.mkdir(parents=True)
        (devices / real.name).symlink_to(real)
        port = next(p for p in real.parents if p.name == pcie_chain(path)[0])
        if not (devices / port.name).exists():
            (devices / port.name).symlink_to(port)
            (port / "numa_node").write_text(f"{node}\n")


def test_probes_read_nodes_and_chains_from_sysfs(tmp_path):
    cpus = sorted(os.sched_getaffinity(0))
    halves = {0: cpus[: max(1, len(cpus) // 2)], 1: cpus[max(1, len(cpus) // 2):]}
    halves = {k: v for k, v in halves.items() if v}
    _fake_sysfs(tmp_path, halves, [(p, 0 if i < 4 else 1) for i, p in enumerate(PATHS)])
    nodes = read_nodes(tmp_path)
    assert [n.index for n in nodes] == sorted(halves)
    assert sum(n.cores for n in nodes) == len(cpus)
    assert nodes[0].mem_bytes == 1048576 * 1024
    ids = [pcie_chain(p)[-1] for p in PATHS]
    seen = probe(TOPO_8, tmp_path, ids)
    assert seen.nodes == nodes and seen.topo.numa[4] == 1
    assert [c[1:] for c in seen.chains] == [pcie_chain(p)[1:] for p in PATHS]
    assert seen.node_of_root == {ROOTS[0]: 0, ROOTS[1]: 0, ROOTS[2]: 1, ROOTS[3]: 1}
