"""Feature internode: a job of several nodes (workload.nodes = K > 1), each node one host state
updated by its own update workers, combines the nodes' gradients over the network.

Inside a node the gradient goes its usual way (REDUCE -> D2H -> HOST_SUM: the plan's routes);
every gradient chunk aggregated on the node's host then goes through the network before its
ADAM, on the NIC agent `nic{w}` of its update worker w (run by that worker's process), one ring
collective over the K nodes per chunk, by plan.internode_reduce:
    all_reduce      NODE_REDUCE(all_reduce) of the chunk -> ADAM of the whole chunk, on every
                    node: the K host states stay identical (synchronous semantics, I1-I3 across
                    nodes). Each NIC sends 2 (K - 1) / K of the chunk's bytes.
    reduce_scatter  NODE_REDUCE(reduce_scatter) -> ADAM of 1/K of the chunk (the node's share)
                    -> NODE_GATHER(all_gather) of the updated BF16 weights of the chunk, which
                    gates the next iteration's delivery of its range instead of the ADAM (I3).
                    Each NIC sends (K - 1) / K of the chunk's gradient bytes and of its BF16
                    weights; the update work per node falls K-fold. (Predicted only: the
                    executor refuses it.)
The NODE_REDUCE reads the chunk where the ADAM will read it (the D2H's ring slot, or the host
sum), so it holds the ring slot like the ADAM does; the ADAM waits on it (GradChunk.after), and
so does a deferred update's first ADAM, which reads the norm of every reduced chunk.
A chunk without a gradient (an ADAM of zeros) is the same on every node and skips the network.
The embedding's looked-up rows differ between nodes: that feature refuses K > 1 (its module).
Each kind's cost and its NIC draw are graph/kinds.py's (spec/network.py's ring model) and
graph/nic.py's.
"""

from __future__ import annotations

from slidedp.graph.features.base import Feature
from slidedp.graph.tasks import COLLECTIVE_OPS, EdgeKind, Kind
from slidedp.spec.elements import PARAM_BYTES
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import InternodeReduce, Plan

DATA = EdgeKind.DATA


def check_clip_schedule(plan: Plan, nodes: int, where: str = "plan") -> None:
    """The split clipping schedule (graph/features/split_update.py) runs on one node: its
    pending update has no inter-node reduction, so several nodes take clip_schedule = joined."""
    if nodes > 1 and plan.splits_update:
        raise SpecError(where, "clip_schedule", "joined with several nodes (the split schedule "
                        "runs on one node; --clip-schedule joined), got split")


class Internode(Feature):
    @staticmethod
    def applies(plan: Plan) -> bool:
        return True  # the node count is the workload's: every hook asks self.on

    def __init__(self, b):
        super().__init__(b)
        self.K = b.wl.nodes
        self.on = self.K > 1
        check_clip_schedule(b.plan, self.K)
        self.scatter = b.plan.internode_reduce == InternodeReduce.REDUCE_SCATTER
        self.nics: dict[int, int] = {}  # update worker -> its NIC agent

    def meta(self) -> dict:
        return {"nodes": self.K}

    def _nic(self, w: int) -> int:
        if w not in self.nics:
            self.nics[w] = self.b.rec.agent(f"nic{w}")
        return self.nics[w]

    def before_update(self, c) -> None:
        """The chunk's NODE_REDUCE, between its producer and its ADAM (module docstring)."""
        if not self.on or c.src < 0:
            return
        b = self.b
        op = "reduce_scatter" if self.scatter else "all_reduce"
        n = c.hi - c.lo
        v = b.rec.task(Kind.NODE_REDUCE, c.t, c.unit, -1, c.k, self._nic(c.worker), n * b.wire,
                       c.lo, c.hi, op=COLLECTIVE_OPS.index(op), buffer=c.slot, ring=c.ring)
        b.rec.edge(c.src, v, DATA)
        if b.rec.kind_of(c.src) == Kind.D2H:
            b.d2h_rings[c.ring].readers[c.slot].append(v)
        c.after.append(v)
        if self.scatter:  # the node updates its 1/K share of the chunk
            c.extra = round((n + c.extra) / self.K) - n

    def version_gates(self, t: int, gates: dict) -> dict:
        """reduce_scatter: each ADAM's NODE_GATHER of the new weights gates the next
        iteration instead of it (module docstring)."""
        if not (self.on and self.scatter):
            return gates
        b, gather = self.b, COLLECTIVE_OPS.index("all_gather")
        out = {}
        for u, adams in gates.items():
            out[u] = []
            for a, lo, hi in adams:
                w = int(b.rec.agents[b.rec.cols["agent"][a]].removeprefix("cpu.update"))
                v = b.rec.task(Kind.NODE_GATHER, t, u, -1, -1, self._nic(w),
                               (hi - lo) * PARAM_BYTES, lo, hi, op=gather)
                b.rec.edge(a, v, DATA)
                out[u].append((v, lo, hi))
        return out
