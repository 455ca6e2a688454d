"""What a plan feature can change: the hooks of the graph builder and of the memory model.

A feature is a subclass of Feature in a module of its own, registered in
slidedp/graph/features/__init__.py (its import and its entry in FEATURES). Three kinds of hooks,
each a no-op here:

plan-level rules (static; asked only of the features whose `applies(plan)` holds)
    grad_wire_bytes   bytes per element of a downloaded gradient chunk (graph/layout.py)
    grad_align        every gradient chunk boundary of a unit is a multiple of this
    grad_ring_slots   slots of one (rank, update worker) host gradient ring
memory terms (static; asked of every registered feature, so that a term exists either way)
    gpu_memory, host_memory   add or adjust terms of model/memory.py's footprints in place
                              (wire: the plan's graph.layout.grad_wire_bytes)
builder hooks (one instance per build, made only where `applies(plan)`; `self.b` is the
slidedp.graph.build.Builder, whose state `b.step` is the current iteration's tasks), called in
this order within iteration t:
    embedding_delivery(t)        the tasks EMBED_FWD(t, r) waits on per rank, or None to let
                                 the base schedule deliver the embedding
    after_embed_fwd(t)           after every rank's EMBED_FWD
    before_fwd(t, layer, r)      before FWD(t, layer, r), after the layer's delivery
    after_fwd(t, layer, r)       after FWD(t, layer, r)
    before_head_gradient(t)      after every rank's HEAD_LOSS, before the head's gradient path
    after_head(t)                after every rank's HEAD_LOSS and the head's gradient path
    backward_inputs(t, layer, r) tasks it appends before the layer's first backward compute
                                 task on rank r (RECOMPUTE, else BWD), which waits on them
    after_backward_layer(t, l)   after layer l's BWD on every rank and its gradient path
    after_backward(t)            after the last layer's backward, before EMBED_BWD
    embedding_gradient(t)        True: it issued the embedding's gradient path itself
    version_gates(t, gates)      the ADAMs (unit -> [(task, lo, hi)]) that gate iteration t+1's
                                 deliveries; `gates` is the base schedule's (or the previous
                                 feature's) answer
and, within every delivery (CAST -> H2D -> ALLGATHER of unit u in iteration t; `gated`: a
forward delivery of t > 0, which the previous iteration's ADAMs gate):
    delivery_gates(t, u, gated, gates)   the ADAMs (task, lo, hi) the delivery's casts wait on,
                                 given the base schedule's `gates`, when the caller gave none
    cast_task(t, u, k, lo, hi, staging)   the task that fills staging buffer `staging` with
                                 chunk k = [lo, hi) of the unit's BF16 parameters, issued by the
                                 feature, or None for the base schedule's CAST
and, whenever the base gradient path has a chunk ready for its ADAM:
    hold_chunk(chunk)            True: the feature issues that chunk's ADAM later itself
and at the end, meta(): the GraphMeta fields the feature sets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload

if TYPE_CHECKING:
    from slidedp.graph.build import Builder
    from slidedp.graph.recorder import GradChunk


def add_term(terms: dict[str, float], name: str, value: float, *, before: str) -> None:
    """Insert memory term `name` just before term `before`, keeping the others in order."""
    items = list(terms.items())
    i = [k for k, _ in items].index(before)
    terms.clear()
    terms.update(items[:i] + [(name, value)] + items[i:])


class Feature:
    """A plan feature's additions to the base schedule; every hook here adds nothing."""

    def __init__(self, b: Builder):
        self.b = b

    # ---- plan-level rules
    @staticmethod
    def applies(plan: Plan) -> bool:
        return False

    @staticmethod
    def grad_wire_bytes(plan: Plan, ranks: int, wire: int) -> int:
        return wire

    @staticmethod
    def grad_align(wl: Workload, plan: Plan, unit: int) -> int:
        return 1

    @staticmethod
    def grad_ring_slots(plan: Plan, ranks: int, key: tuple[int, int], slots: int,
                        worker_chunks: int) -> int:
        """Slots of ring key = (rank, worker), given `slots` so far and the `worker_chunks`
        gradient chunks that worker updates per iteration."""
        return slots

    # ---- memory terms
    @staticmethod
    def gpu_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        return None

    @staticmethod
    def host_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        return None

    # ---- builder hooks
    def meta(self) -> dict:
        """GraphMeta fields this feature sets."""
        return {}

    def embedding_delivery(self, t: int) -> list[list[int]] | None:
        return None

    def after_embed_fwd(self, t: int) -> None:
        return None

    def before_fwd(self, t: int, layer: int, r: int) -> None:
        return None

    def after_fwd(self, t: int, layer: int, r: int) -> None:
        return None

    def before_head_gradient(self, t: int) -> None:
        return None

    def after_head(self, t: int) -> None:
        return None

    def backward_inputs(self, t: int, layer: int, r: int) -> list[int]:
        return []

    def after_backward_layer(self, t: int, layer: int) -> None:
        return None

    def after_backward(self, t: int) -> None:
        return None

    def embedding_gradient(self, t: int) -> bool:
        return False

    def version_gates(self, t: int, gates: dict) -> dict:
        return gates

    def delivery_gates(self, t: int, u: int, gated: bool, gates: list) -> list:
        return gates

    def cast_task(self, t: int, u: int, k: int, lo: int, hi: int, staging: int) -> int | None:
        return None

    def hold_chunk(self, chunk: GradChunk) -> bool:
        return False
