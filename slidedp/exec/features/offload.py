"""Activation offload (plan.offload_ratio): part of what each layer keeps goes to host memory.

Ratio r of what layer l keeps (its input included, never parameters, which live in slots) goes
to pinned host buffers after the task that produced it (ACT_OFFLOAD(l), on the D2H stream: after
the producer of its input when it keeps only that, else after FWD(l)) and comes back into a reload
buffer before RECOMPUTE(l) or BWD(l) (ACT_RELOAD(l), on the H2D stream). activations.py splits
the kept entries and reserves the host, reload and tail buffers at construction.
"""

from __future__ import annotations

from slidedp.exec.features.base import Feature, Kernel
from slidedp.exec.kernels import Context, StepData
from slidedp.graph.tasks import Kind


class ActivationOffload(Feature):
    name = "offload"

    @staticmethod
    def enabled(k: Context) -> bool:
        return k.plan.offload_ratio > 0

    def kernels(self, table: list[Kernel | None]) -> dict[int, Kernel]:
        out: dict[int, Kernel] = dict.fromkeys(self.local_tasks(Kind.ACT_OFFLOAD), self.offload)
        out.update(dict.fromkeys(self.local_tasks(Kind.ACT_RELOAD), self.reload))
        return out

    def offload(self, d: StepData, v: int) -> None:
        self.k.bufs.acts.offload(int(self.k.tpl.g.unit[v]))

    def reload(self, d: StepData, v: int) -> None:
        self.k.bufs.acts.reload_layer(int(self.k.tpl.g.unit[v]))
