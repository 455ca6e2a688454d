"""Host and GPU topology: sockets, the PCIe tree, the GPU fabric, and the links each flow crosses.

A hardware file may carry a [topology] table; without one the flat spec ([pcie], [host],
[fabric]) is read as its special case: one socket holding every core, the host memory and its
DRAM rate, and one PCIe switch on it whose uplink carries the all-GPU caps (and whose peer
forwarding the all-GPU both-directions cap), every GPU under it (flat_topology). Both give a Topology, the one description the simulator and the analytic model
read for routing: which links a flow crosses, with what capacity.

Schema (units in names; every table has a `source` and may override it per field in `sources`):
  [topology]            memory = "interleave" | "shard" | "local"   where the host state's pages
                        live: spread evenly over the sockets, each part on one socket (part index
                        mod sockets), or on socket 0; socket_link_gbps (per direction between two
                        sockets; required with two or more)
  [[topology.socket]]   cores, ram_gib, dram_gbps (the socket's memory bandwidth)
                        dma_h2d_gbps, dma_d2h_gbps, dma_duplex_gbps  (optional) what every GPU's
                        copies on this socket reach at once (its root complex and memory, as the
                        all-GPU copies measure them)
                        p2p_gbps  (optional) the root complex's peer-to-peer forwarding between its
                        ports, both directions together
  [[topology.switch]]   socket, parent (optional: the index of the switch above; absent: on the
                        socket's root complex), kind = "switch" | "root-port", h2d_gbps, d2h_gbps
                        (the uplink, per direction), duplex_gbps (optional: both directions),
                        p2p_gbps (optional: its forwarding of peer copies between its ports)
  [topology.gpus]       switch = [index per GPU], p2p = "system" | "socket" | "switch" | "none"
                        (how far PCIe peer-to-peer reaches: anywhere, within a socket, below a
                        common switch, nowhere; peers beyond it stage their copies through host
                        memory), p2p_gbps (optional: one peer copy's rate over PCIe),
                        nvlink = [[r, s], ...] with nvlink_gbps (bridges, per direction), or
                        nvswitch_gbps (every GPU's ports to an NVSwitch, per direction);
                        h2d_gbps, d2h_gbps, duplex_gbps (optional: each GPU's own link; default
                        [pcie] h2d_gbps, d2h_gbps, duplex_gbps)
The sockets' cores and RAM add up to [host] cores and ram_gib; the GPU links agree with
[fabric] kind (nvlink pairs: nvlink-pairs, nvswitch: nvswitch, neither: pcie).

Resources (capacities in bytes/s; `h2d` is the direction from host memory toward a GPU):
  gpu{r}.h2d, gpu{r}.d2h, gpu{r}.duplex        GPU r's PCIe link
  switch{i}.h2d, switch{i}.d2h, switch{i}.duplex  switch i's uplink
  socket{k}.h2d, socket{k}.d2h, socket{k}.duplex  socket k's all-GPU DMA caps (where given)
  switch{i}.p2p, socket{k}.p2p                  peer forwarding inside a switch, a root complex
  socket{k}.dram                                socket k's memory
  socket{j}.to{k}                               the inter-socket link, j to k
  nvlink{r}.to{s}                               an NVLink bridge, r to s
  gpu{r}.nvswitch_out, gpu{r}.nvswitch_in       GPU r's NVLink ports to the NVSwitch
  p2p{r}.to{s}                                  one PCIe peer copy's own rate (p2p_gbps)
A path is a tuple of Hops: a resource, its capacity and the share of the flow's bytes that
cross it (below 1 where host memory is spread over sockets, 2 where staging touches one memory
twice). A flow of rate x draws x * share on each hop, so alone it runs at min(capacity / share).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from types import MappingProxyType

import networkx as nx

from slidedp.spec.errors import SpecError
from slidedp.spec.tomlio import Table, sources_of
from slidedp.spec.units import GB, GIB

MEMORY_PLACEMENTS = ("interleave", "shard", "local")
SWITCH_KINDS = ("switch", "root-port")
# how far PCIe peer-to-peer reaches (NCCL_P2P_LEVEL's PXB, PHB, SYS, LOC): below a common switch,
# within a socket's root complex, across sockets, or nowhere; peers beyond it stage through host
# memory
P2P_MODES = ("system", "socket", "switch", "none")
DIRECTIONS = ("h2d", "d2h")


@dataclass(frozen=True)
class Hop:
    """One resource on a flow's path: its capacity (bytes/s) and the share of the flow's bytes
    that cross it."""

    resource: str
    capacity_bps: float
    share: float = 1.0


Path = tuple[Hop, ...]


def path_capacity_bps(path: Path) -> float:
    """The rate a flow reaches alone on `path`: its tightest hop, capacity / share."""
    return min(h.capacity_bps / h.share for h in path)


def merged(*paths: Path) -> Path:
    """The hops of several legs of one flow, a resource crossed by several legs once with their
    shares summed (in first-crossed order)."""
    shares: dict[str, float] = {}
    caps: dict[str, float] = {}
    for p in paths:
        for h in p:
            shares[h.resource] = shares.get(h.resource, 0.0) + h.share
            caps[h.resource] = h.capacity_bps
    return tuple(Hop(r, caps[r], s) for r, s in shares.items())


@dataclass(frozen=True)
class Socket:
    cores: int
    ram_bytes: float
    dram_bps: float
    dma_h2d_bps: float | None = None
    dma_d2h_bps: float | None = None
    dma_duplex_bps: float | None = None
    p2p_bps: float | None = None
    sources: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class Switch:
    socket: int
    h2d_bps: float
    d2h_bps: float
    duplex_bps: float | None = None
    parent: int | None = None
    kind: str = "switch"
    p2p_bps: float | None = None
    sources: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))


@dataclass(frozen=True)
class GpuLinks:
    """Where each GPU hangs and how GPUs reach each other."""

    switch: tuple[int, ...]  # the switch of each GPU
    h2d_bps: float
    d2h_bps: float
    duplex_bps: float
    p2p: str = "system"
    p2p_bps: float | None = None
    nvlink: tuple[tuple[int, int], ...] = ()
    nvlink_bps: float | None = None
    nvswitch_bps: float | None = None
    sources: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    @property
    def count(self) -> int:
        return len(self.switch)

    @property
    def fabric_kind(self) -> str:
        """The [fabric] kind these links make: nvswitch, nvlink-pairs or pcie."""
        if self.nvswitch_bps is not None:
            return "nvswitch"
        return "nvlink-pairs" if self.nvlink else "pcie"


@dataclass(frozen=True)
class Topology:
    sockets: tuple[Socket, ...]
    switches: tuple[Switch, ...]
    gpus: GpuLinks
    socket_link_bps: float | None = None
    memory: str = "interleave"
    origin: str = field(default="", compare=False)  # "flat", or the file it was read from
    sources: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))

    # ---- structure ----------------------------------------------------------------------------

    def gpu_socket(self, gpu: int) -> int:
        return self.switches[self.gpus.switch[gpu]].socket

    def cores_by_socket(self) -> tuple[int, ...]:
        """The CPU core pool of each socket."""
        return tuple(s.cores for s in self.sockets)

    def gpus_on_socket(self, socket: int) -> tuple[int, ...]:
        return tuple(r for r in range(self.gpus.count) if self.gpu_socket(r) == socket)

    def tree(self) -> nx.Graph:
        """The host and PCIe tree: socket, switch and GPU nodes ("socket0", "switch1", "gpu3"),
        with the sockets joined by the inter-socket link (edge kind "socket-link"). Built once
        per topology: do not change it."""
        return self._tree

    @cached_property
    def _tree(self) -> nx.Graph:
        g = nx.Graph()
        for k, s in enumerate(self.sockets):
            g.add_node(f"socket{k}", kind="socket", index=k, spec=s)
        for i, sw in enumerate(self.switches):
            g.add_node(f"switch{i}", kind=sw.kind, index=i, spec=sw)
            above = f"switch{sw.parent}" if sw.parent is not None else f"socket{sw.socket}"
            g.add_edge(f"switch{i}", above, kind="uplink")
        for r, i in enumerate(self.gpus.switch):
            g.add_node(f"gpu{r}", kind="gpu", index=r)
            g.add_edge(f"gpu{r}", f"switch{i}", kind="gpu-link")
        for j in range(len(self.sockets)):
            for k in range(j + 1, len(self.sockets)):
                g.add_edge(f"socket{j}", f"socket{k}", kind="socket-link")
        return g

    def fabric(self) -> nx.Graph:
        """The GPU fabric: GPU nodes, NVLink bridge edges, or an "nvswitch" node joined to every
        GPU; no edges where GPUs reach each other only over PCIe."""
        g = nx.Graph()
        g.add_nodes_from(f"gpu{r}" for r in range(self.gpus.count))
        for r, s in self.gpus.nvlink:
            g.add_edge(f"gpu{r}", f"gpu{s}", kind="nvlink", gbps=self.gpus.nvlink_bps / GB)
        if self.gpus.nvswitch_bps is not None:
            for r in range(self.gpus.count):
                g.add_edge(f"gpu{r}", "nvswitch", kind="nvswitch",
                           gbps=self.gpus.nvswitch_bps / GB)
        return g

    def resources(self) -> dict[str, float]:
        """Every link and cap of this topology: name -> capacity (bytes/s)."""
        return dict(self._caps)

    @cached_property
    def _caps(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for r in range(self.gpus.count):
            out |= _link(f"gpu{r}", self.gpus.h2d_bps, self.gpus.d2h_bps, self.gpus.duplex_bps)
        for i, sw in enumerate(self.switches):
            out |= _link(f"switch{i}", sw.h2d_bps, sw.d2h_bps, sw.duplex_bps)
            if sw.p2p_bps is not None:
                out[f"switch{i}.p2p"] = sw.p2p_bps
        for k, s in enumerate(self.sockets):
            out |= _link(f"socket{k}", s.dma_h2d_bps, s.dma_d2h_bps, s.dma_duplex_bps)
            if s.p2p_bps is not None:
                out[f"socket{k}.p2p"] = s.p2p_bps
            out[f"socket{k}.dram"] = s.dram_bps
            for j in range(len(self.sockets)):
                if j != k:
                    out[f"socket{k}.to{j}"] = self.socket_link_bps
        for r, s in self.gpus.nvlink:
            out[f"nvlink{r}.to{s}"] = out[f"nvlink{s}.to{r}"] = self.gpus.nvlink_bps
        if self.gpus.nvswitch_bps is not None:
            for r in range(self.gpus.count):
                out[f"gpu{r}.nvswitch_out"] = out[f"gpu{r}.nvswitch_in"] = self.gpus.nvswitch_bps
        if self.gpus.p2p_bps is not None:
            for r in range(self.gpus.count):
                for s in range(self.gpus.count):
                    if r != s and not self._fabric_joins(r, s):
                        out[f"p2p{r}.to{s}"] = self.gpus.p2p_bps
        return out

    def all_gpus_bps(self, direction: str, gpus: tuple[int, ...] | None = None) -> float:
        """What `gpus` (default all) copying in `direction` at once reach together, each with
        its own socket's memory: the maximum flow through the sockets' DRAM and DMA caps, the
        switch uplinks and the GPU links of that direction (networkx maximum_flow). The flat
        spec's all-GPU cap (pcie.all_h2d_gbps, all_d2h_gbps) summarizes this."""
        if direction not in DIRECTIONS:
            raise ValueError(f"direction one of {DIRECTIONS}, got {direction!r}")
        caps = self._caps
        g = nx.DiGraph()
        for k, s in enumerate(self.sockets):
            g.add_edge("memory", f"socket{k}", capacity=s.dram_bps)
            g.add_edge(f"socket{k}", f"socket{k}:dma",
                       capacity=caps.get(f"socket{k}.{direction}", float("inf")))
        for r in gpus if gpus is not None else range(self.gpus.count):
            node = f"gpu{r}"
            while not node.startswith("socket"):
                above = self.parent_of(node)
                top = f"{above}:dma" if above.startswith("socket") else above
                g.add_edge(top, node, capacity=caps[f"{node}.{direction}"])
                node = above
            g.add_edge(f"gpu{r}", "gpus", capacity=float("inf"))
        return nx.maximum_flow_value(g, "memory", "gpus")

    # ---- host memory --------------------------------------------------------------------------

    def memory_split(self, part: int | None = None, placement: str | None = None
                     ) -> dict[int, float]:
        """Socket -> fraction of a host buffer's bytes there, by `placement` (default: the
        topology's): interleave spreads them evenly, shard puts part `part` (a layer's index)
        on socket part mod sockets, local on socket 0."""
        placement = placement or self.memory
        n = len(self.sockets)
        if placement == "interleave":
            return {k: 1.0 / n for k in range(n)}
        if placement == "shard":
            if part is None:
                raise ValueError("a sharded placement needs the part's index")
            return {part % n: 1.0}
        if placement == "local":
            return {0: 1.0}
        raise ValueError(f"unknown placement {placement!r}, one of {MEMORY_PLACEMENTS}")

    # ---- flows --------------------------------------------------------------------------------

    def h2d(self, gpu: int, memory: dict[int, float] | None = None) -> Path:
        """Host memory (`memory`: socket -> fraction; default the GPU's own socket) to GPU
        `gpu`: each memory socket's DRAM, the link from it to the GPU's socket, that socket's
        DMA caps, the switch uplinks above the GPU top down, the GPU's link."""
        return self._dma(gpu, "h2d", memory)

    def d2h(self, gpu: int, memory: dict[int, float] | None = None) -> Path:
        """GPU `gpu` to host memory: the links of h2d, in the other direction."""
        return self._dma(gpu, "d2h", memory)

    def activation_offload(self, gpu: int) -> Path:
        """Activations offloaded to pinned memory on the GPU's own socket."""
        return self.d2h(gpu)

    def activation_reload(self, gpu: int) -> Path:
        return self.h2d(gpu)

    def p2p(self, src: int, dst: int) -> Path:
        """A peer copy from GPU `src` to GPU `dst`: over NVLink where the fabric joins them;
        else over PCIe along the tree where the p2p level reaches (up to the nearest common
        switch or root complex, whose peer forwarding cap it takes, across the socket link
        between two sockets); else staged through host memory on the source's socket (D2H, then
        H2D: that memory is crossed twice)."""
        self._check_gpu(src)
        self._check_gpu(dst)
        if src == dst:
            raise ValueError(f"a peer copy needs two GPUs, got {src} -> {dst}")
        g = self.gpus
        if (src, dst) in g.nvlink or (dst, src) in g.nvlink:
            return (Hop(f"nvlink{src}.to{dst}", g.nvlink_bps),)
        if g.nvswitch_bps is not None:
            return (Hop(f"gpu{src}.nvswitch_out", g.nvswitch_bps),
                    Hop(f"gpu{dst}.nvswitch_in", g.nvswitch_bps))
        nodes = nx.shortest_path(self._tree, f"gpu{src}", f"gpu{dst}")
        sockets = sum(n.startswith("socket") for n in nodes)
        reach = {"system": 2, "socket": 1, "switch": 0, "none": -1}[g.p2p]
        if sockets > reach:
            home = {self.gpu_socket(src): 1.0}
            return merged(self.d2h(src, home), self.h2d(dst, home))
        hops = self._walk(nodes)
        if g.p2p_bps is not None:
            hops += (Hop(f"p2p{src}.to{dst}", g.p2p_bps),)
        return hops

    def ring(self, ranks: list[int] | tuple[int, ...]) -> tuple[Path, ...]:
        """The peer copies of a ring over `ranks` in the given order: rank i to rank i + 1."""
        ranks = list(ranks)
        if len(ranks) < 2:
            return ()
        return tuple(self.p2p(a, b) for a, b in zip(ranks, ranks[1:] + ranks[:1], strict=True))

    def host_access(self, socket: int, memory: dict[int, float] | None = None,
                    write_fraction: float = 0.0) -> Path:
        """A CPU team on socket `socket` moving bytes of host memory (`memory`: socket ->
        fraction; default its own socket), a `write_fraction` of them written: each memory
        socket's DRAM, and the socket link each way for the remote part."""
        if not 0 <= socket < len(self.sockets):
            raise ValueError(f"socket {socket} outside 0..{len(self.sockets) - 1}")
        memory = memory if memory is not None else {socket: 1.0}
        hops = []
        for j, f in memory.items():
            hops.append(Hop(f"socket{j}.dram", self.sockets[j].dram_bps, f))
            if j != socket:
                if write_fraction < 1:
                    hops.append(Hop(f"socket{j}.to{socket}", self.socket_link_bps,
                                    f * (1 - write_fraction)))
                if write_fraction > 0:
                    hops.append(Hop(f"socket{socket}.to{j}", self.socket_link_bps,
                                    f * write_fraction))
        return merged(tuple(hops))

    # ---- internals ----------------------------------------------------------------------------

    def _check_gpu(self, gpu: int) -> None:
        if not 0 <= gpu < self.gpus.count:
            raise ValueError(f"GPU {gpu} outside 0..{self.gpus.count - 1}")

    def _fabric_joins(self, r: int, s: int) -> bool:
        return (self.gpus.nvswitch_bps is not None or (r, s) in self.gpus.nvlink
                or (s, r) in self.gpus.nvlink)

    def parent_of(self, node: str) -> str | None:
        """The node above `node` in the PCIe tree (None for a socket)."""
        if node.startswith("gpu"):
            return f"switch{self.gpus.switch[int(node[3:])]}"
        if node.startswith("switch"):
            sw = self.switches[int(node[6:])]
            return f"switch{sw.parent}" if sw.parent is not None else f"socket{sw.socket}"
        return None

    def _forwards(self, before: str, node: str, after: str) -> bool:
        """Whether a walk through `node` is peer forwarding there: it arrives from below and
        leaves downward or to another socket, or arrives from another socket."""
        from_below = self.parent_of(before) == node
        down = self.parent_of(after) == node
        if not node.startswith("socket"):
            return from_below and down
        return (from_below and (down or after.startswith("socket"))) or (
            before.startswith("socket") and down)

    def _walk(self, nodes: list[str]) -> Path:
        """The hops of a walk along tree nodes: an edge going up charges the lower node's
        uplink d2h (and duplex), one going down the lower node's h2d (and duplex), one between
        sockets their link; a switch or socket where the walk turns from up to down, or crosses
        to or from another socket, charges its peer forwarding cap (p2p)."""
        caps = self._caps
        hops: list[Hop] = []

        def charge(name: str) -> None:
            if name in caps:
                hops.append(Hop(name, caps[name]))

        for i, (u, v) in enumerate(zip(nodes, nodes[1:], strict=False)):
            if i > 0 and self._forwards(nodes[i - 1], u, v):
                charge(f"{u}.p2p")
            if self.parent_of(u) == v:
                charge(f"{u}.d2h")
                charge(f"{u}.duplex")
            elif self.parent_of(v) == u:
                charge(f"{v}.h2d")
                charge(f"{v}.duplex")
            else:  # two sockets
                charge(f"{u}.to{v[6:]}")
        return merged(tuple(hops))

    def _dma(self, gpu: int, direction: str, memory: dict[int, float] | None) -> Path:
        """Host memory and GPU `gpu`: the memory sockets' DRAM and links to the GPU's socket,
        its DMA caps, then the tree down to the GPU (reversed for d2h)."""
        self._check_gpu(gpu)
        k = self.gpu_socket(gpu)
        memory = memory if memory is not None else {k: 1.0}
        host: list[Hop] = []
        for j, f in memory.items():
            host.append(Hop(f"socket{j}.dram", self.sockets[j].dram_bps, f))
            if j != k:
                link = f"socket{j}.to{k}" if direction == "h2d" else f"socket{k}.to{j}"
                host.append(Hop(link, self.socket_link_bps, f))
        caps = self._caps
        sock = [Hop(n, caps[n]) for n in (f"socket{k}.{direction}", f"socket{k}.duplex")
                if n in caps]
        chain = [f"gpu{gpu}"]
        while chain[-1] != f"socket{k}":
            chain.append(self.parent_of(chain[-1]))
        if direction == "h2d":
            return merged(tuple(host + sock) + self._walk(chain[::-1]))
        return merged(self._walk(chain) + tuple(sock + host))


def _link(name: str, h2d: float | None, d2h: float | None, duplex: float | None
          ) -> dict[str, float]:
    out = {f"{name}.h2d": h2d, f"{name}.d2h": d2h, f"{name}.duplex": duplex}
    return {k: v for k, v in out.items() if v is not None}


# ---- the flat spec's topology -------------------------------------------------------------------


def flat_topology(gpu_count: int, pcie, host, fabric) -> Topology:
    """The topology a hardware file without a [topology] table stands for: one socket with all
    of [host] (cores, RAM, dram_gbps), one PCIe switch on it whose uplink is [pcie]'s all-GPU
    caps and whose peer forwarding is all_total_gbps (as graph/costs.py charges peer traffic
    on the all-GPU cap), every GPU under it with [pcie]'s per-GPU link; the GPU links of [fabric] (nvswitch:
    every GPU's ports at link_gbps; nvlink-pairs: GPUs 2i and 2i + 1 bridged at link_gbps, other
    pairs peer over PCIe at cross_pair_gbps; pcie: peers over PCIe at link_gbps)."""
    hs, ps, fs = host.sources, pcie.sources, fabric.sources
    socket = Socket(host.cores, host.ram_bytes, host.dram_bps, sources=MappingProxyType(
        {"cores": hs["cores"], "ram_gib": hs["ram_gib"], "dram_gbps": hs["dram_gbps"]}))
    switch = Switch(0, pcie.all_h2d_bps, pcie.all_d2h_bps, pcie.all_total_bps,
                    p2p_bps=pcie.all_total_bps,
                    sources=MappingProxyType({"h2d_gbps": ps["all_h2d_gbps"],
                                              "d2h_gbps": ps["all_d2h_gbps"],
                                              "duplex_gbps": ps["all_total_gbps"],
                                              "p2p_gbps": ps["all_total_gbps"]}))
    src = {"h2d_gbps": ps["h2d_gbps"], "d2h_gbps": ps["d2h_gbps"],
           "duplex_gbps": ps["duplex_gbps"], "fabric": fs["link_gbps"]}
    links = dict(switch=(0,) * gpu_count, h2d_bps=pcie.h2d_bps, d2h_bps=pcie.d2h_bps,
                 duplex_bps=pcie.duplex_bps, sources=MappingProxyType(src))
    if fabric.kind == "nvswitch":
        gpus = GpuLinks(**links, nvswitch_bps=fabric.link_bps)
    elif fabric.kind == "nvlink-pairs":
        pairs = tuple((r, r + 1) for r in range(0, gpu_count - 1, 2))
        gpus = GpuLinks(**links, p2p_bps=fabric.cross_pair_bps, nvlink=pairs,
                        nvlink_bps=fabric.link_bps)
    else:
        gpus = GpuLinks(**links, p2p_bps=fabric.link_bps)
    flat = MappingProxyType({"memory": "derived: the flat spec has one socket"})
    return Topology((socket,), (switch,), gpus, None, "interleave", "flat", flat)


# ---- parsing ------------------------------------------------------------------------------------


def parse_topology(t: Table, gpu_count: int, pcie, host, fabric_kind: str) -> Topology:
    """The [topology] table of a hardware file (module docstring), checked against the GPU
    count, [pcie]'s per-GPU link, [host]'s cores and RAM and [fabric]'s kind."""
    memory = t.str("memory", "interleave", choices=MEMORY_PLACEMENTS)
    sockets = tuple(_socket(s) for s in t.subs("socket"))
    link = t.num("socket_link_gbps", None)
    if len(sockets) > 1 and link is None:
        raise SpecError(t.where, "topology.socket_link_gbps",
                        f"the link between sockets, per direction ({len(sockets)} sockets)")
    switches = tuple(_switch(s, len(sockets)) for s in t.subs("switch"))
    _check_tree(switches, t.where)
    gpus = _gpus(t.sub("gpus"), gpu_count, len(switches), pcie)
    if gpus.fabric_kind != fabric_kind:
        raise SpecError(t.where, "topology.gpus",
                        f"GPU links agreeing with fabric.kind = {fabric_kind!r}, got links of a "
                        f"{gpus.fabric_kind!r} fabric")
    _check_sums(sockets, host, t.where)
    src = sources_of(t, ["memory"] + (["socket_link_gbps"] if link is not None else []))
    t.done()
    return Topology(sockets, switches, gpus, None if link is None else link * GB, memory, t.where,
                    src)


def _socket(t: Table) -> Socket:
    keys = ["cores", "ram_gib", "dram_gbps"]
    opt = [k for k in ("dma_h2d_gbps", "dma_d2h_gbps", "dma_duplex_gbps", "p2p_gbps")
           if t.has(k)]
    vals = {k: t.num(k) * GB for k in opt}
    s = Socket(t.int("cores"), t.num("ram_gib") * GIB, t.num("dram_gbps") * GB,
               vals.get("dma_h2d_gbps"), vals.get("dma_d2h_gbps"), vals.get("dma_duplex_gbps"),
               vals.get("p2p_gbps"), sources_of(t, keys + opt))
    t.done()
    return s


def _switch(t: Table, n_sockets: int) -> Switch:
    socket = t.int("socket", minimum=0)
    if socket >= n_sockets:
        raise SpecError(t.where, t._name("socket"),
                        f"a socket index in 0..{n_sockets - 1}, got {socket}")
    parent = t.int("parent", None, minimum=0) if t.has("parent") else None
    kind = t.str("kind", "switch", choices=SWITCH_KINDS)
    opt = {k: t.num(k) * GB for k in ("duplex_gbps", "p2p_gbps") if t.has(k)}
    s = Switch(socket, t.num("h2d_gbps") * GB, t.num("d2h_gbps") * GB, opt.get("duplex_gbps"),
               parent, kind, opt.get("p2p_gbps"), sources_of(t, ["h2d_gbps", "d2h_gbps", *opt]))
    t.done()
    return s


def _check_tree(switches: tuple[Switch, ...], where: str) -> None:
    """Every parent names another switch on the same socket, and the parents form no cycle."""
    g = nx.DiGraph()
    for i, sw in enumerate(switches):
        g.add_node(i)
        if sw.parent is None:
            continue
        field = f"topology.switch[{i}].parent"
        if sw.parent >= len(switches) or sw.parent == i:
            raise SpecError(where, field, f"the index of another switch in 0..{len(switches) - 1}"
                                          f", got {sw.parent}")
        if switches[sw.parent].socket != sw.socket:
            raise SpecError(where, field, f"a switch on the same socket ({sw.socket}), got switch "
                                          f"{sw.parent} on socket {switches[sw.parent].socket}")
        g.add_edge(i, sw.parent)
    try:
        cycle = nx.find_cycle(g)
    except nx.NetworkXNoCycle:
        return
    loop = " -> ".join(str(a) for a, _ in cycle) + f" -> {cycle[0][0]}"
    raise SpecError(where, f"topology.switch[{cycle[0][0]}].parent",
                    f"a tree: these switches' parents form a cycle ({loop})")


def _gpus(t: Table, gpu_count: int, n_switches: int, pcie) -> GpuLinks:
    under = t.raw("switch")
    if not isinstance(under, list) or len(under) != gpu_count:
        got = len(under) if isinstance(under, list) else repr(under)
        raise SpecError(t.where, "topology.gpus.switch",
                        f"one switch index per GPU ({gpu_count} GPUs), got {got}: every GPU hangs "
                        f"under a switch")
    for r, i in enumerate(under):
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n_switches:
            raise SpecError(t.where, f"topology.gpus.switch[{r}]",
                            f"the index of a switch in 0..{n_switches - 1} (GPU {r}), got {i!r}")
    p2p = t.str("p2p", "system", choices=P2P_MODES)
    pairs = _pairs(t.raw("nvlink", []), gpu_count, t.where)
    nvlink_bps = t.num("nvlink_gbps") * GB if pairs or t.has("nvlink_gbps") else None
    if nvlink_bps is not None and not pairs:
        raise SpecError(t.where, "topology.gpus.nvlink_gbps", "only beside topology.gpus.nvlink")
    nvswitch = t.num("nvswitch_gbps") * GB if t.has("nvswitch_gbps") else None
    if nvswitch is not None and pairs:
        raise SpecError(t.where, "topology.gpus.nvswitch_gbps",
                        "either NVLink bridges (nvlink) or an NVSwitch, not both")
    p2p_bps = t.num("p2p_gbps") * GB if t.has("p2p_gbps") else None
    if p2p_bps is not None and p2p == "none":
        raise SpecError(t.where, "topology.gpus.p2p_gbps", "only where PCIe peer-to-peer exists "
                                                           "(p2p other than \"none\")")
    rates = {k: t.num(k) * GB if t.has(k) else None for k in ("h2d_gbps", "d2h_gbps",
                                                              "duplex_gbps")}
    keys = ["switch", "p2p"] + [k for k in ("nvlink", "nvlink_gbps", "nvswitch_gbps", "p2p_gbps",
                                            *rates) if t.has(k)]
    src = dict(sources_of(t, keys))
    for k, flat in (("h2d_gbps", "h2d_gbps"), ("d2h_gbps", "d2h_gbps"),
                    ("duplex_gbps", "duplex_gbps")):
        if rates[k] is None:
            src[k] = f"[pcie] {flat}: {pcie.sources[flat]}"
    t.done()
    return GpuLinks(tuple(under), rates["h2d_gbps"] or pcie.h2d_bps,
                    rates["d2h_gbps"] or pcie.d2h_bps, rates["duplex_gbps"] or pcie.duplex_bps,
                    p2p, p2p_bps, pairs, nvlink_bps, nvswitch, MappingProxyType(src))


def _pairs(rows, gpu_count: int, where: str) -> tuple[tuple[int, int], ...]:
    """topology.gpus.nvlink: [[r, s], ...] of two different GPUs in range, each pair once."""
    if not isinstance(rows, list):
        raise SpecError(where, "topology.gpus.nvlink", f"a list of [r, s] GPU pairs, got {rows!r}")
    out: list[tuple[int, int]] = []
    for n, p in enumerate(rows):
        field = f"topology.gpus.nvlink[{n}]"
        ok = isinstance(p, list) and len(p) == 2 and all(
            isinstance(g, int) and not isinstance(g, bool) for g in p)
        if not ok:
            raise SpecError(where, field, f"[r, s], two GPU indices, got {p!r}")
        if not all(0 <= g < gpu_count for g in p) or p[0] == p[1]:
            raise SpecError(where, field, f"two different GPU indices in 0..{gpu_count - 1}, got "
                                          f"{p!r}")
        pair = (min(p), max(p))
        if pair in out:
            raise SpecError(where, field, f"each pair once, got {p!r} again")
        out.append(pair)
    return tuple(out)


def _check_sums(sockets: tuple[Socket, ...], host, where: str) -> None:
    """The sockets' cores add up to host.cores and their RAM to host.ram_gib (within 1%)."""
    cores = sum(s.cores for s in sockets)
    if cores != host.cores:
        raise SpecError(where, "topology.socket", f"cores adding up to host.cores = {host.cores}"
                                                  f", got {cores}")
    ram = sum(s.ram_bytes for s in sockets)
    if abs(ram - host.ram_bytes) > 0.01 * host.ram_bytes:
        raise SpecError(where, "topology.socket", f"ram_gib adding up to host.ram_gib = "
                                                  f"{host.ram_bytes / GIB:g}, got {ram / GIB:g}")
