"""Feature moments = bf16 | int8: the Adam moments kept compact on the host (exec/moments.py).

Memory: the host state term counts the FP32 master plus plan.moments.bytes_per_param instead of
8 B/param of FP32 moments. Layout: with int8 moments every gradient chunk starts on a
MOMENT_QBLOCK boundary of its unit, so that an ADAM requantizes whole blocks of its own. Cost:
GraphMeta.moments selects the host's measured update rate for the format and the ADAM's DRAM
bytes (graph/rates.py). No tasks or edges of its own.
"""

from __future__ import annotations

from slidedp.graph.features.base import Feature
from slidedp.spec.elements import MOMENT_QBLOCK
from slidedp.spec.plan import Moments, Plan
from slidedp.spec.workload import Workload


class CompactMoments(Feature):
    @staticmethod
    def applies(plan: Plan) -> bool:
        return plan.moments != Moments.FP32

    @staticmethod
    def grad_align(wl: Workload, plan: Plan, unit: int) -> int:
        return MOMENT_QBLOCK if plan.moments == Moments.INT8 else 1

    @staticmethod
    def host_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        saved = Moments.FP32.bytes_per_param - plan.moments.bytes_per_param
        terms["state"] -= saved * wl.model.total_params()

    def meta(self) -> dict:
        return {"moments": str(self.b.plan.moments)}
