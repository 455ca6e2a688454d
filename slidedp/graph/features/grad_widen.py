"""Feature grad_widen = host: gradient chunks come down in BF16 and the CPU update widens them.

The wire then carries GRAD_BYTES per element instead of FP32_BYTES (D2H work, the host rings,
the ADAM's DRAM traffic and rate: graph/costs.py reads GraphMeta.grad_wire_bytes), except on the
cpu route with several ranks, whose HOST_SUM adds the ranks' chunks in FP32 (staging.host_sum: a
sum of BF16 chunks into FP32 would cost an extra pass). No tasks or edges of its own.
"""

from __future__ import annotations

from slidedp.graph.features.base import Feature
from slidedp.spec.elements import GRAD_BYTES
from slidedp.spec.plan import GradRoute, GradWiden, Plan


class HostWiden(Feature):
    @staticmethod
    def applies(plan: Plan) -> bool:
        return plan.grad_widen == GradWiden.HOST

    @staticmethod
    def grad_wire_bytes(plan: Plan, ranks: int, wire: int) -> int:
        summed = plan.grad_route == GradRoute.CPU and ranks > 1
        return wire if summed else GRAD_BYTES
