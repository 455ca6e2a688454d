"""Deferred update (plan.defer_update) and exact gradient clipping (AdamWConfig.grad_clip), in
the joined schedule (plan.clip_schedule = joined, the synchronous reference; split_update.py
runs the split one, the default).

With defer_update every ADAM of a step comes after every gradient chunk of the step is on the
host (graph/build.py: DATA edges from every chunk producer to the first ADAM of each update
worker, waited on locally or through the shared counters). The rings then hold a whole step's
gradient, and a HOST_SUM adds the ranks' chunks in place into rank 0's chunk, which the ring
keeps until the deferred ADAM reads it (no private accumulator).

Both clipping and skipping a non-finite step need the global norm before any update: the engine
runs the plan with defer_update whenever the optimizer clips or skips (AdamWConfig.grad_clip,
AdamWConfig.skip_nonfinite).

Clipping as torch.nn.utils.clip_grad_norm_(params, max_norm) before torch.optim.AdamW: the
engine runs the plan with defer_update whenever the optimizer clips. The first ADAM of each
update worker sums every entry of sq in float64 (each is final: its producer is a predecessor,
in this process or another) and takes coef = min(1, max_norm / (norm + 1e-6)); every ADAM of the
worker multiplies its FP32 gradient by coef when coef < 1 (adamw.adamw_chunk), as
clip_grad_norm_ multiplies the gradients. Every worker of every process computes the same coef
from the same entries in the same order, so R ranks, any route, clip alike.

Skipping (AdamWConfig.skip_nonfinite): where that norm is NaN or Inf, every ADAM of the step
returns without touching the host state (master, m, v, the parameter copy); every worker of
every process decides from the same entries, so all skip alike, and the engine does not count
the step's updates (skips_update). A non-finite loss comes with a non-finite gradient (its
backward), so the norm decides.
"""

from __future__ import annotations

import math
from dataclasses import replace

from slidedp.exec import kernels
from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.buffers import BufferSpec
from slidedp.exec.features.base import Feature, Kernel
from slidedp.exec.kernels import Context, StepData, span
from slidedp.graph.tasks import Kind
from slidedp.spec.plan import Plan


class DeferredUpdate(Feature):
    name = "deferred_update"

    @staticmethod
    def adjust(plan: Plan, optimizer: AdamWConfig) -> Plan:
        needs_norm = optimizer.grad_clip is not None or optimizer.skip_nonfinite
        return replace(plan, defer_update=True) if needs_norm else plan

    @staticmethod
    def enabled(k: Context) -> bool:
        return k.plan.defer_update and not k.plan.splits_update

    @staticmethod
    def configure(spec: BufferSpec, k: Context) -> None:
        spec.host_sum_acc = False

    def __init__(self, k: Context):
        super().__init__(k)
        g = k.tpl.g
        self.coef = [1.0] * g.meta.update_workers  # per update worker: this step's coefficient
        self.skip = [False] * g.meta.update_workers  # per update worker: the norm is not finite
        # where the norm is read (clipping, skipping): the first ADAM of each update worker
        needs_norm = k.opt.grad_clip is not None or k.opt.skip_nonfinite
        self.clip_at = set() if not needs_norm else {
            int(ts[g.kind[ts] == Kind.ADAM][0]) for ts in g.agent_tasks
            if (g.kind[ts] == Kind.ADAM).any()}

    def kernels(self, table: list[Kernel | None]) -> dict[int, Kernel]:
        out: dict[int, Kernel] = dict.fromkeys(self.local_tasks(Kind.HOST_SUM), self.host_sum)
        for v in self.local_tasks(Kind.ADAM):
            out[v] = self.first_adam if v in self.clip_at else self.adam
        return out

    def begin_step(self, d: StepData, input_ids) -> None:
        self.coef = [1.0] * len(self.coef)
        self.skip = [False] * len(self.skip)

    @property
    def may_skip_update(self) -> bool:
        return self.k.opt.skip_nonfinite

    def skips_update(self, grad_sqnorm: float) -> bool:
        """Every worker of every process decided from the same entries: the global norm decides
        alike on a rank that runs no ADAM."""
        return self.k.opt.skip_nonfinite and not math.isfinite(grad_sqnorm)

    def host_sum(self, d: StepData, v: int) -> None:
        _, lo, hi = span(self.k, v)
        kernels.sum_chunks(self.k, v, hi - lo, in_place=True)

    def first_adam(self, d: StepData, v: int) -> None:
        """The worker's first ADAM: every gradient chunk of the step is in (its producers
        precede v): the clipping coefficient or the skip, then the update."""
        k = self.k
        w = k.tpl.worker[v]
        norm = math.sqrt(float(k.bufs.sq.double().sum()))
        self.skip[w] = k.opt.skip_nonfinite and not math.isfinite(norm)
        if k.opt.grad_clip is not None:
            self.coef[w] = min(1.0, k.opt.grad_clip / (norm + 1e-6))
        self.adam(d, v)

    def adam(self, d: StepData, v: int) -> None:
        """The update from the ring chunk (a summed one: rank 0's, which holds the sum)."""
        k = self.k
        if self.skip[k.tpl.worker[v]]:
            return
        u, lo, hi = span(k, v)
        (key, slot), = k.tpl.grad_src[v]
        g = k.bufs.rings.grad[key][slot][:hi - lo]
        kernels.update(k, d, u, lo, hi, g, self.coef[k.tpl.worker[v]])
