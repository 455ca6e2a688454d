"""A host topology's machine (graph/kinds.py, "The machine"): every flow routed along its path of
spec/topology.py, each link and cap a resource shared max-min fair, host work and host memory
placed per socket. It describes the hardware files with a [topology] table; the flat spec keeps
flat_host.FlatHost. Rank r runs on GPU r of the topology.

Placement (one rule, a model feature: every lent host has one socket, one NUMA node, where the
executor has nothing to place):
  host state    each unit's FP32 master and moments lie where [topology] memory puts them
                (Topology.memory_split of the unit: interleave spreads every unit evenly over
                the sockets, shard puts unit u on socket u mod sockets, local on socket 0)
  host work     a team per socket: a CPU task (CAST, ADAM, HOST_SUM) of unit u runs on the
                sockets that hold u's state, in the same proportions, each part on its own
                socket's cores and memory (method.md section 11: the update sharded per NUMA
                node). Its core-seconds and its host-memory bytes split the same way; a CPU
                kernel never reads across the socket link
  staging       the pinned chunk a CAST writes for the uploads of u and the gradient-ring chunk a
                D2H writes for u's update lie with u's teams, split likewise; activations
                offload to pinned memory on the GPU's own socket
So cross-socket traffic is the copies': GPU r moving the part of a staging chunk that lies on
another socket (Topology.h2d / d2h with that split crosses the socket link), and peer copies
staged through host memory across sockets.

Resources (capacity per second):
  gpu{r}.compute    GPU r's compute stream (seconds)
  the links and caps that the ranks' paths cross (spec/topology.py, bytes): gpu{r}.h2d|d2h|
                    duplex, switch{i}.h2d|d2h|duplex|p2p, socket{k}.h2d|d2h|duplex|p2p,
                    socket{j}.to{k}, nvlink{r}.to{s}, gpu{r}.nvswitch_out|in, p2p{r}.to{s}
  socket{k}.dram    socket k's memory as the CPU teams reach it: rates.dram_bps of the graph (the
                    flat host.dram) x socket k's scale, its dram_gbps over [host] dram_gbps (so
                    a socket's cap grows with its own rate only); the copies' memory too unless
                    socket{k}.mem exists
  socket{k}.mem     with a measured HostSpec.memory_bps: all of socket k's memory traffic,
                    memory_bps x its scale floored at socket{k}.dram's cap (the flat host.mem)
  socket{k}.cores   socket k's cores (core-seconds)
  fabric            seconds of collective per second (the collectives run one at a time)
Draws (a path's hop of `share` takes bytes x share):
  GPU kinds     gpu{r}.compute: their seconds
  copies        H2D, ACT_RELOAD along Topology.h2d; D2H, ACT_OFFLOAD along Topology.d2h, from
                the staging split above (activations: the GPU's socket). A socket's DRAM hop is
                drawn on socket{k}.mem where it exists, else socket{k}.dram; beside
                socket{k}.mem each copied byte also draws a weight of a byte of socket{k}.dram,
                as flat_host.FlatHost's host.dram (the slowdown's linear bound, cap / (S + D_max),
                S scaled to the socket and D_max its copies' cap)
  CPU kinds     per socket part a: a x its core-seconds on socket{k}.cores, a x its host-memory
                bytes on socket{k}.dram (and socket{k}.mem)
  collectives   fabric: their seconds; and the ring over ranks 0..R-1 in rank order, each hop
                along Topology.p2p (an NVLink bridge, the NVSwitch ports, PCIe through a switch or
                a root complex or across the socket link, or staged through host memory where
                peer-to-peer does not reach), each hop carrying the bytes each GPU sends
                (FabricSpec.collective_s): all_gather and reduce_scatter (R-1)/R x B, all_reduce
                2 (R-1)/R x B on every hop; reduce B on the chain 1 -> 2 -> ... -> R-1 -> 0
The copies' slowdown of the CPU kernels (HostSpec.dma_slowdown_bps S, where measured) acts per
socket: S x the socket's scale, the copies' bytes of that socket's memory (socket{k}.mem) against
its kernels' cap (socket{k}.dram).
"""

from __future__ import annotations

from slidedp.graph.kinds import Load, TaskLoad
from slidedp.graph.rates import dram_bps
from slidedp.graph.tasks import COLLECTIVE_OPS, Kind, TaskGraph
from slidedp.spec.hardware import HardwareSpec
from slidedp.spec.topology import Hop, Path, Topology, merged


def hop_fraction(op: str, ranks: int) -> float:
    """The bytes each hop of a ring carries per byte of the buffer (FabricSpec.collective_s's
    convention: what each GPU sends)."""
    return {"all_gather": (ranks - 1) / ranks, "reduce_scatter": (ranks - 1) / ranks,
            "all_reduce": 2 * (ranks - 1) / ranks, "reduce": 1.0}[op]


def ring_hops(op: str, ranks: int) -> list[tuple[int, int]]:
    """The peer copies (src, dst) of a collective over ranks 0..R-1: the ring in rank order; a
    reduce's chain ends at rank 0, whose gradient goes to the host."""
    ring = [(r, (r + 1) % ranks) for r in range(ranks)]
    return ring[1:] if op == "reduce" else ring


class TopologyHost:
    """A host topology's resources and draws (module docstring); a Machine."""

    def __init__(self, hw: HardwareSpec, g: TaskGraph, topology: Topology):
        self.g, self.topo, self.R = g, topology, g.n_ranks
        self._memo: dict[tuple, object] = {}  # paths and splits, by what they depend on
        host, sockets = hw.host, topology.sockets
        # socket k's part of the host's measured rates: its DRAM rate over [host] dram_gbps
        self.dram_scale = [s.dram_bps / host.dram_bps for s in sockets]
        kernels_bps = dram_bps(g, hw)
        memory_bps = host.memory_bps()
        self.has_mem = memory_bps is not None
        self.names = [f"gpu{r}.compute" for r in range(self.R)]
        self.capacity = dict.fromkeys(self.names, 1.0)
        self.links = topology.resources()
        self.cpu_names: list[tuple[str, str, str | None]] = []  # per socket: cores, dram, mem
        for k, s in enumerate(sockets):
            dram = f"socket{k}.dram"
            self._add(dram, kernels_bps * self.dram_scale[k])
            mem = None
            if self.has_mem:
                mem = f"socket{k}.mem"
                self._add(mem, max(memory_bps * self.dram_scale[k], self.capacity[dram]))
            self._add(f"socket{k}.cores", float(s.cores))
            self.cpu_names.append((f"socket{k}.cores", dram, mem))
        slowdown = host.dma_slowdown_bps() if self.has_mem else None
        self.slowdowns = [] if not slowdown else [
            (slowdown * self.dram_scale[k], mem, dram) for _, dram, mem in self.cpu_names]
        self.dma_weight = [host.dram_dma_weight if self.has_mem else 0.0] * len(sockets)
        if slowdown:  # the slowdown's linear bound, per socket (module docstring)
            self.dma_weight = [
                self.capacity[dram] / (slowdown * self.dram_scale[k] + min(
                    self.capacity[mem], self._dma_bps(k))) for k, (_, dram, mem)
                in enumerate(self.cpu_names)]
        self._route_all()
        self._add("fabric", 1.0)

    @classmethod
    def of(cls, hw: HardwareSpec, g: TaskGraph) -> TopologyHost | None:
        """The hardware files with a [topology] table; None for the flat spec, and for a graph of
        more ranks than the topology has GPUs (a sketch beyond the machine, which the commands
        refuse: model/memory.check_fits), which the flat reading takes."""
        topo = hw.explicit_topology
        return None if topo is None or g.n_ranks > topo.gpus.count else cls(hw, g, topo)

    # ---- resources ----------------------------------------------------------------------------

    def _add(self, name: str, capacity: float) -> None:
        if name not in self.capacity:
            self.names.append(name)
            self.capacity[name] = capacity

    def _dma_bps(self, k: int) -> float:
        """The most copy traffic socket k's memory can see: its all-GPU both-directions cap, else
        the uplinks of the switches on its root complex, both directions."""
        if f"socket{k}.duplex" in self.links:
            return self.links[f"socket{k}.duplex"]
        top = [i for i, sw in enumerate(self.topo.switches) if sw.socket == k and sw.parent is None]
        caps = self.links
        return sum(caps.get(f"switch{i}.duplex", caps[f"switch{i}.h2d"] + caps[f"switch{i}.d2h"])
                   for i in top)

    def _route_all(self) -> None:
        """Name every link the ranks' paths cross, in a fixed order (the paths of rank 0 first:
        its copies from and to each socket, its activations, then the collectives' rings)."""
        n = len(self.topo.sockets)
        for r in range(self.R):
            for k in range(n):
                for path in (self.topo.h2d(r, {k: 1.0}), self.topo.d2h(r, {k: 1.0})):
                    self._add_path(path)
        if self.R > 1:
            for op in COLLECTIVE_OPS:
                self._add_path(self._collective(op))

    def _add_path(self, path: Path) -> None:
        for hop in path:
            if not hop.resource.endswith(".dram"):
                self._add(hop.resource, self.links[hop.resource])

    # ---- paths --------------------------------------------------------------------------------

    def _memoized(self, key: tuple, make):
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def split(self, unit: int) -> dict[int, float]:
        """Socket -> fraction of unit `unit`'s state, its host work and its staging."""
        return self._memoized(("split", int(unit)), lambda: self.topo.memory_split(part=int(unit)))

    def _copy(self, load: Load, rank: int, unit: int | None) -> list[tuple[str, float]]:
        """(resource, bytes per copied byte) of a copy of `rank` in direction `load`, between the
        GPU and unit `unit`'s staging (None: the GPU's own socket, for activations)."""
        def make():
            memory = None if unit is None else self.split(unit)
            path = (self.topo.h2d if load is Load.H2D else self.topo.d2h)(rank, memory)
            return self._charges(path)
        return self._memoized(("copy", load, rank, unit), make)

    def _collective(self, op: str) -> Path:
        """The hops of a collective's ring (or chain), each share the bytes that hop carries per
        byte of the buffer, merged."""
        def make():
            f = hop_fraction(op, self.R)
            legs = [self.topo.p2p(a, b) for a, b in ring_hops(op, self.R)]
            return merged(*(tuple(Hop(h.resource, h.capacity_bps, h.share * f) for h in leg)
                            for leg in legs))
        return self._memoized(("collective", op), make)

    def _charges(self, path: Path) -> list[tuple[str, float]]:
        """A path's hops as draws per byte: a socket's DRAM hop on its memory (and the weight of
        it on the kernels' cap beside socket{k}.mem), every other hop on its link."""
        out: list[tuple[str, float]] = []
        for hop in path:
            if not hop.resource.endswith(".dram"):
                out.append((hop.resource, hop.share))
                continue
            k = int(hop.resource[len("socket"):-len(".dram")])
            _, dram, mem = self.cpu_names[k]
            out.append((mem or dram, hop.share))
            if mem is not None and self.dma_weight[k] > 0:
                out.append((dram, self.dma_weight[k] * hop.share))
        return out

    # ---- draws --------------------------------------------------------------------------------

    def draws(self, t: TaskLoad) -> list[tuple[str, float]]:
        if t.load is Load.GPU:
            return [(f"gpu{t.rank}.compute", t.seconds)]
        if t.load is Load.H2D or t.load is Load.D2H:
            staged = t.kind in (Kind.H2D, Kind.D2H)  # else activations: the GPU's socket
            per = self._copy(t.load, t.rank, int(self.g.unit[t.task]) if staged else None)
            return [(name, t.work * share) for name, share in per]
        if t.load is Load.CPU:
            out = []
            for k, a in self.split(self.g.unit[t.task]).items():
                cores, dram, mem = self.cpu_names[k]
                out.append((dram, a * t.dram_bytes))
                if mem is not None:
                    out.append((mem, a * t.dram_bytes))
                out.append((cores, a * t.core_s))
            return out
        op = COLLECTIVE_OPS[int(self.g.op[t.task])]
        return [("fabric", t.seconds)] + [(name, t.work * share)
                                          for name, share in self._charges(self._collective(op))]
