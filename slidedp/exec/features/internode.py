"""The nodes of a job of several (workload.nodes = K > 1) reduce their gradients over the network.

Each node runs the same graph on its own host state (graph/features/internode.py); a
NODE_REDUCE task, run by the process that owns its chunk's update worker w (dist/ownership.py) on
that worker's NIC agent, all-reduces (sums) the node's aggregated gradient chunk, in place where
the ADAM reads it (the D2H's ring chunk, or the HOST_SUM's sum), across the K nodes, on the gloo
group of w's process on every node (DistSession.peer_group: one group per update worker, so
that no two threads share a group and every node issues each group's collectives in the same
order). It then writes the reduced chunk's squared norm over the producer's entry, so that every
node's norm entries hold the global gradient (the engine divides the step-end sum by K). The
sum runs over host memory with gloo on the CPU and on GPU machines alike (the chunk is on the
host by then). Every node's ADAM then applies the same update to an identical host state: the
nodes' master copies stay equal bit for bit.

plan.internode_reduce = reduce_scatter (predicted by the graph) is refused here: one line, exit 2.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slidedp.exec import kernels
from slidedp.exec.features.base import Feature
from slidedp.exec.kernels import Context, StepData
from slidedp.graph.features.internode import check_clip_schedule
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import InternodeReduce, Plan


def check_runnable(plan: Plan, nodes: int, where: str = "plan") -> None:
    """SpecError for an inter-node reduction the executor does not run (graph/features/
    internode.py refuses the split clipping schedule across nodes for every command)."""
    check_clip_schedule(plan, nodes, where)
    if nodes > 1 and plan.internode_reduce != InternodeReduce.ALL_REDUCE:
        raise SpecError(where, "internode_reduce", "all_reduce, the one the executor runs "
                        f"({plan.internode_reduce} is predicted only), got "
                        f"{plan.internode_reduce}")


class NodeReduce(Feature):
    name = "internode"

    @staticmethod
    def enabled(k: Context) -> bool:
        return k.tpl.g.meta.nodes > 1

    def __init__(self, k: Context):
        super().__init__(k)
        check_runnable(k.plan, k.wl.nodes)
        g, tpl, sess = k.tpl.g, k.tpl, k.session
        scatter = g.meta.scatter_update
        owner = [w // k.plan.update_workers if scatter else 0 for w in range(g.meta.update_workers)]
        self.groups = [sess.peer_group(o) for o in owner]  # collective: every rank, same order
        data = g.edge_kind == int(EdgeKind.DATA)
        self.adam, self.src = {}, {}  # NODE_REDUCE -> the ADAM it feeds, the chunk's producer
        for v in self.local_tasks(Kind.NODE_REDUCE):
            outs = g.edge_dst[data & (g.edge_src == v)].tolist()
            ins = g.edge_src[data & (g.edge_dst == v)].tolist()
            # its chunk's ADAM (a deferred update's first ADAM also waits on every NODE_REDUCE)
            self.adam[v] = next(a for a in outs if tpl.kind[a] == Kind.ADAM
                                and kernels.span(k, a) == kernels.span(k, v))
            self.src[v] = next(p for p in ins if tpl.kind[p] in (Kind.D2H, Kind.HOST_SUM))

    def kernels(self, table) -> dict:
        return {v: self.node_reduce for v in self.adam}

    def chunk(self, a: int, n: int) -> torch.Tensor:
        """The gradient ADAM a reads (n elements): a deferred update reads the sum in its ring
        chunk (exec/features/deferred_update.py), else kernels.adam_grad says where it is."""
        k = self.k
        if k.plan.defer_update:
            (key, slot), = k.tpl.grad_src[a]
            return k.bufs.rings.grad[key][slot][:n]
        return kernels.adam_grad(k, a, n)

    def node_reduce(self, d: StepData, v: int) -> None:
        k = self.k
        a = self.adam[v]
        _, lo, hi = kernels.span(k, v)
        g = self.chunk(a, hi - lo)
        dist.all_reduce(g, group=self.groups[k.tpl.worker[a]])
        j = k.tpl.norm_slot[self.src[v]]
        if j >= 0:
            wide = g.float()
            k.bufs.sq[j] = torch.dot(wide, wide)
