"""The node's network interface as a resource of any machine (graph/kinds.py, "The machine").

A job of several nodes (GraphMeta.nodes > 1) has inter-node tasks (graph/features/internode.py)
that load Load.NIC. `with_nic(machine, g)` returns the machine with one more resource, `nic`
(capacity 1, drawn in seconds: the NIC is one serial server per node, shared by every update
worker's inter-node collectives at once), and the NIC tasks' draws on it; every other draw is the
machine's own. A one-node graph keeps the machine unchanged. The ring collectives' host-memory
traffic (the chunk read and written once per ring step) is not drawn: at most 2 (K - 1) / K
bytes per gradient byte, small beside the update's own traffic per parameter.
"""

from __future__ import annotations

from slidedp.graph.kinds import Load, Machine, TaskLoad
from slidedp.graph.tasks import TaskGraph

NIC = "nic"


class NodeNetwork:
    """A machine and its node's NIC (module docstring); a Machine."""

    def __init__(self, inner: Machine):
        self.inner = inner
        self.names = [*inner.names, NIC]
        self.capacity = {**inner.capacity, NIC: 1.0}
        self.slowdowns = inner.slowdowns

    def draws(self, t: TaskLoad) -> list[tuple[str, float]]:
        if t.load is Load.NIC:
            return [(NIC, t.seconds)]
        return self.inner.draws(t)


def with_nic(machine: Machine, g: TaskGraph) -> Machine:
    """`machine` with the NIC where the graph spans several nodes, else itself."""
    return NodeNetwork(machine) if g.meta.nodes > 1 else machine
