"""The network between nodes: how many nodes of this host a job spans, and each node's NIC.

A hardware file may carry a [network] table (schema; every number names its source, as the other
tables do):
  [network]   nodes (default 1: the nodes a job on this hardware spans; `--nodes` overrides),
              nic_kind = "rdma" | "tcp", nic_gbps (one node's NIC, per direction, GB/s as every
              other `_gbps` field: 400 Gb/s = 50), nic_latency_us (one hop between two nodes),
              source, [network.sources] per field
Without the table a job spans one node and there is no NIC: predicting more than one node then
asks for --nic-gbps (NetworkSpec.check_nodes).

Inter-node collectives run on rings over the K nodes (graph/features/internode.py): each NIC
sends, per byte of the buffer, (K - 1) / K for a reduce-scatter or an all-gather and
2 (K - 1) / K for an all-reduce, and a ring pays the hop latency once per step of the ring
((K - 1) steps for a reduce-scatter or an all-gather, 2 (K - 1) for an all-reduce).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from types import MappingProxyType

from slidedp.spec.errors import SpecError
from slidedp.spec.tomlio import Table, sources_of
from slidedp.spec.units import GB

NIC_KINDS = ("rdma", "tcp")
NODE_OPS = {"all_reduce": (2.0, 2), "reduce_scatter": (1.0, 1), "all_gather": (1.0, 1)}
NO_NIC = "no NIC given: one node"


@dataclass(frozen=True)
class NetworkSpec:
    nodes: int = 1
    nic_kind: str = "rdma"
    nic_bps: float = 0.0  # bytes/s per direction; 0: no NIC described
    nic_latency_s: float = 0.0
    sources: MappingProxyType = field(default_factory=lambda: MappingProxyType({}),
                                      compare=False)

    def collective_s(self, op: str, nbytes: float) -> float:
        """A ring collective over the nodes on a buffer of `nbytes` (its full size)."""
        K = self.nodes
        if K <= 1 or nbytes <= 0:
            return 0.0
        hops = NODE_OPS[op][1]
        return hops * (K - 1) * self.nic_latency_s + nbytes * wire_share(op, K) / self.nic_bps

    def with_options(self, nodes: int | None = None, nic_gbps: float | None = None,
                     nic_latency_us: float | None = None, nic_kind: str | None = None,
                     where: str = "command line") -> NetworkSpec:
        """This network with the command line's values, checked (SpecError names the option)."""
        out, src = self, dict(self.sources)
        if nodes is not None:
            out = replace(out, nodes=_int(nodes, where, "--nodes"))
        if nic_gbps is not None:
            out = replace(out, nic_bps=_number(nic_gbps, where, "--nic-gbps", zero=False) * GB)
            src["nic_gbps"] = f"{where}: --nic-gbps {nic_gbps:g}"
        if nic_latency_us is not None:
            out = replace(out, nic_latency_s=_number(nic_latency_us, where, "--nic-latency-us",
                                                     zero=True) * 1e-6)
            src["nic_latency_us"] = f"{where}: --nic-latency-us {nic_latency_us:g}"
        if nic_kind is not None:
            if nic_kind not in NIC_KINDS:
                raise SpecError(where, "--nic-kind", f"one of {', '.join(NIC_KINDS)}, got "
                                f"{nic_kind!r}")
            out = replace(out, nic_kind=nic_kind)
        out = replace(out, sources=MappingProxyType(src))
        out.check_nodes(where)
        return out

    def check_nodes(self, where: str) -> None:
        """SpecError when more than one node has no NIC to reduce over."""
        if self.nodes > 1 and self.nic_bps <= 0:
            raise SpecError(where, "network.nic_gbps", f"a NIC rate for {self.nodes} nodes "
                            "(the hardware has no [network] table: pass --nic-gbps)")


def wire_share(op: str, nodes: int) -> float:
    """Bytes one NIC sends per byte of the buffer in a ring `op` over `nodes` nodes."""
    return NODE_OPS[op][0] * (nodes - 1) / nodes if nodes > 1 else 0.0


def _int(v, where: str, field: str) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SpecError(where, field, f"a positive integer, got {v!r}")
    return v


def _number(v, where: str, field: str, zero: bool) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v != v or v < 0 \
            or (v == 0 and not zero) or v == float("inf"):
        raise SpecError(where, field, f"a {'non-negative' if zero else 'positive'} finite "
                        f"number, got {v!r}")
    return float(v)


def parse_network(t: Table | None) -> NetworkSpec:
    """The [network] table (module docstring), or one node without a NIC."""
    if t is None:
        return NetworkSpec(sources=MappingProxyType({"nic_gbps": NO_NIC}))
    keys = ["nodes", "nic_kind", "nic_gbps", "nic_latency_us"]
    spec = NetworkSpec(
        nodes=t.int("nodes", 1), nic_kind=t.str("nic_kind", choices=NIC_KINDS),
        nic_bps=t.num("nic_gbps") * GB, nic_latency_s=t.num("nic_latency_us", allow_zero=True)
        * 1e-6, sources=sources_of(t, keys))
    t.done()
    return spec
