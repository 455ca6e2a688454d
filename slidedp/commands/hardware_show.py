"""`slidedp hardware show NAME [--plot FILE]`: a hardware's topology in words, and drawn.

The words name each socket, switch and GPU ("socket 0", "switch 1", "GPU 3 under switch 1 on
socket 0") with the capacity of its links in GB/s; the drawing (a PNG) puts the sockets on top,
the PCIe switches below them and the GPUs at the bottom, with the GPU fabric's links between GPUs.
"""

from __future__ import annotations

import argparse

from slidedp.spec.hardware import HardwareSpec, load_hardware
from slidedp.spec.topology import Topology
from slidedp.spec.units import GB, GIB

P2P_WORDS = {
    "system": "anywhere, across sockets too",
    "socket": "within a socket",
    "switch": "below a common switch",
}


def register(verbs) -> None:
    p = verbs.add_parser("show", help="a hardware's topology in words (and drawn with --plot)",
                         description=__doc__.splitlines()[0])
    p.add_argument("name", help="a hardware preset (slidedp hardware list) or a TOML file")
    p.add_argument("--plot", metavar="FILE", help="draw the topology to this PNG file")
    p.set_defaults(func=show)


def show(args: argparse.Namespace) -> int:
    hw = load_hardware(args.name)
    print("\n".join(describe(hw)))
    if args.plot:
        plot(hw, args.plot)
        print(f"drawn to {args.plot}")
    return 0


def _gbps(bps: float | None) -> str:
    return f"{bps / GB:.1f}"


def _rates(h2d: float | None, d2h: float | None, duplex: float | None) -> str:
    parts = [f"{_gbps(v)} GB/s {what}" for v, what in ((h2d, "H2D"), (d2h, "D2H"),
                                                     (duplex, "both ways")) if v is not None]
    return ", ".join(parts)


def describe(hw: HardwareSpec) -> list[str]:
    """The topology in words, one line per socket, switch and GPU, then the GPU fabric."""
    t = hw.topology
    n = len(t.sockets)
    kinds = [sw.kind for sw in t.switches]
    ports = ", ".join(f"{c} {one if c == 1 else many}" for one, many, c in (
        ("PCIe switch", "PCIe switches", kinds.count("switch")),
        ("root port", "root ports", kinds.count("root-port"))) if c)
    lines = [f"{hw.name}: {hw.gpu.count}x {hw.gpu.model}, {n} socket{'s' * (n > 1)}, {ports} "
             f"({hw.origin})"]
    if hw.explicit_topology is None:
        lines.append("no [topology] table: the flat spec read as one socket and one switch")
    memory = {"interleave": f"interleaved over the {n} sockets" if n > 1 else "on socket 0",
              "shard": "sharded by socket (each part on one socket)",
              "local": "on socket 0"}[t.memory]
    lines.append(f"host memory: {memory}")
    if n > 1:
        lines.append(f"sockets joined by a {_gbps(t.socket_link_bps)} GB/s link each way")
    for k, s in enumerate(t.sockets):
        line = (f"socket {k}: {s.cores} cores, {s.ram_bytes / GIB:.0f} GiB, DRAM "
                f"{_gbps(s.dram_bps)} GB/s")
        dma = _rates(s.dma_h2d_bps, s.dma_d2h_bps, s.dma_duplex_bps)
        if dma:
            line += f"; its GPUs' copies at most {dma}"
        if s.p2p_bps is not None:
            line += f"; peer forwarding {_gbps(s.p2p_bps)} GB/s"
        lines.append(line)
        for i in _switches_under(t, k, None):
            lines += _switch_lines(t, i, 1)
    lines.append(_fabric_line(t))
    lines.append(f"all GPUs at once: {_gbps(t.all_gpus_bps('h2d'))} GB/s H2D, "
                 f"{_gbps(t.all_gpus_bps('d2h'))} GB/s D2H")
    return lines


def _switches_under(t: Topology, socket: int, parent: int | None) -> list[int]:
    return [i for i, sw in enumerate(t.switches) if sw.socket == socket and sw.parent == parent]


def _switch_lines(t: Topology, i: int, depth: int) -> list[str]:
    sw = t.switches[i]
    pad = "  " * depth
    kind = "PCIe switch" if sw.kind == "switch" else "root port"
    above = f"switch {sw.parent}" if sw.parent is not None else f"socket {sw.socket}"
    line = f"{pad}switch {i} ({kind}) under {above}: uplink {_rates(sw.h2d_bps, sw.d2h_bps, sw.duplex_bps)}"
    if sw.p2p_bps is not None:
        line += f"; peer forwarding {_gbps(sw.p2p_bps)} GB/s"
    out = [line]
    g = t.gpus
    for r, j in enumerate(g.switch):
        if j == i:
            out.append(f"{pad}  GPU {r} under switch {i} on socket {sw.socket}: link "
                       f"{_rates(g.h2d_bps, g.d2h_bps, g.duplex_bps)}")
    for child in _switches_under(t, sw.socket, i):
        out += _switch_lines(t, child, depth + 1)
    return out


def _fabric_line(t: Topology) -> str:
    g = t.gpus
    if g.nvswitch_bps is not None:
        fabric = f"every GPU on an NVSwitch at {_gbps(g.nvswitch_bps)} GB/s each way"
    elif g.nvlink:
        pairs = ", ".join(f"{r}-{s}" for r, s in g.nvlink)
        fabric = f"NVLink bridges {pairs} at {_gbps(g.nvlink_bps)} GB/s each way"
    else:
        fabric = "no NVLink"
    if g.p2p == "none":
        p2p = "no PCIe peer-to-peer (peers stage their copies through host memory)"
    else:
        p2p = f"PCIe peer-to-peer {P2P_WORDS[g.p2p]}"
        if g.p2p_bps is not None:
            p2p += f" at {_gbps(g.p2p_bps)} GB/s a copy"
        if g.p2p != "system":
            p2p += " (peers beyond it stage their copies through host memory)"
    return f"GPU links: {fabric}; {p2p}"


def plot(hw: HardwareSpec, path: str) -> None:
    """Draw the topology: sockets on top, switches below (nested ones lower), GPUs at the bottom,
    edges labelled with GB/s (one direction), the GPU fabric's links in another colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import networkx as nx

    t = hw.topology
    tree = t.tree()
    depth = {f"socket{k}": 0 for k in range(len(t.sockets))}
    for i in range(len(t.switches)):
        d, node = 0, f"switch{i}"
        while not node.startswith("socket"):
            node, d = t.parent_of(node), d + 1
        depth[f"switch{i}"] = d
    bottom = max(depth.values(), default=0) + 1
    for r in range(t.gpus.count):
        depth[f"gpu{r}"] = bottom
    pos = {f"gpu{r}": (r, -bottom) for r in range(t.gpus.count)}
    for level in range(bottom - 1, -1, -1):  # each node above the middle of what hangs below it
        for node, d in depth.items():
            if d == level:
                kids = [pos[c] for c in tree.neighbors(node) if c in pos and depth[c] > d]
                x = sum(p[0] for p in kids) / len(kids) if kids else 0.0
                pos[node] = (x, -d)
    caps = t.resources()
    labels = {}
    for u, v, kind in tree.edges(data="kind"):
        if kind == "socket-link":
            labels[(u, v)] = f"{_gbps(t.socket_link_bps)}"
        else:
            low = u if depth.get(u, 0) > depth.get(v, 0) else v
            labels[(u, v)] = f"{_gbps(caps[f'{low}.h2d'])}"
    fig, ax = plt.subplots(figsize=(max(6.0, 1.3 * t.gpus.count + 2), 2.2 * (bottom + 1.5)))
    colours = {"socket": "#8fb3d9", "switch": "#c9d98f", "root-port": "#c9d98f", "gpu": "#e6a57e"}
    names = {n: n.replace("socket", "socket ").replace("switch", "switch ").replace("gpu", "GPU ")
             for n in tree.nodes}
    for k, s in enumerate(t.sockets):  # the socket's cores, DRAM and DMA cap under its name
        dma = f"\nDMA {_gbps(s.dma_h2d_bps)}" if s.dma_h2d_bps is not None else ""
        names[f"socket{k}"] += f"\n{s.cores} cores\nDRAM {_gbps(s.dram_bps)}{dma}"
    nx.draw_networkx_nodes(tree, pos, ax=ax, node_size=2000, node_shape="s",
                           node_color=[colours[tree.nodes[n]["kind"]] for n in tree.nodes])
    nx.draw_networkx_labels(tree, pos, names, ax=ax, font_size=8)
    nx.draw_networkx_edges(tree, pos, ax=ax)
    nx.draw_networkx_edge_labels(tree, pos, labels, ax=ax, font_size=7)
    fabric = t.fabric()
    if fabric.number_of_edges():
        fpos = dict(pos)
        fpos["nvswitch"] = ((t.gpus.count - 1) / 2, -bottom - 1)
        if "nvswitch" in fabric:  # a star: straight edges, the rate on the switch
            nx.draw_networkx_nodes(fabric, fpos, nodelist=["nvswitch"], ax=ax, node_size=2000,
                                   node_shape="s", node_color="#b58fd9")
            nx.draw_networkx_labels(fabric, fpos, {"nvswitch": f"NVSwitch\n"
                                                   f"{_gbps(t.gpus.nvswitch_bps)}\nper GPU"},
                                    ax=ax, font_size=8)
            nx.draw_networkx_edges(fabric, fpos, ax=ax, edge_color="#7d3fb5", width=1.5)
        else:  # bridges: arcs between the GPUs, labelled
            nx.draw_networkx_edges(fabric, fpos, ax=ax, edge_color="#7d3fb5", width=2,
                                   connectionstyle="arc3,rad=0.3", arrows=True, arrowstyle="-")
            nx.draw_networkx_edge_labels(fabric, fpos, {(u, v): f"{gbps:.0f}" for u, v, gbps in
                                                        fabric.edges(data="gbps")}, ax=ax,
                                         font_size=7, font_color="#7d3fb5")
    ax.set_title(f"{hw.name}: {hw.gpu.count}x {hw.gpu.model} (GB/s, one direction)")
    ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
