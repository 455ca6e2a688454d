"""Split update (plan.splits_update: defer_update with clip_schedule = split): exact clipping
whose update of step t runs in step t+1 (graph/features/split_update.py).

The engine's template is a steady step (build_graph update_pending): its forward deliveries
apply the previous step's pending update (UPDATE_CAST), its backward commits it (ADAM), and its
own gradient chunks stay in the rings for the next step. What is pending is set at the end of a
step, once the global norm is known on every process (skips_update, after the engine's step-end
all-reduce, when every producer of the step in every process is done): the step's StepData
(its Adam step counts and learning rate), the clipping coefficient coef = min(1, max_norm /
(norm + 1e-6)) from every entry of sq summed in float64, as the joined schedule's first ADAM
takes it (features/deferred_update.py), and whether the norm is non-finite (skip_nonfinite).

  UPDATE_CAST  the pending update of its upload chunk, piece by piece over the pending gradient
               chunks it overlaps, into the staging chunk (adamw.adamw_chunk_into: the master
               and the moments untouched); with nothing pending, or a skipped step, a CAST
  ADAM         the commit: the pending update of its chunk into the master and the moments
               (kernels.update, the joined schedule's), after the UPDATE_CASTs that read them;
               with nothing pending or a skipped step, nothing
  HOST_SUM     in place into rank 0's ring chunk, which keeps the sum for the next step

A step takes the pending update over at its start (begin_step): a step that fails leaves the
state as far as its tasks got, as any failed step does, and nothing of it is applied twice.
flush() runs the pending commits of this process synchronously, in task order (the engine's
flush then joins the processes): the host state is then the last step's, as the joined schedule
leaves it. The trainer flushes before every read of the host state (evaluation, checkpoints,
the final export); a step after a flush has nothing pending. host_state_changed() drops what is
pending: the state it was computed from is gone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slidedp.exec import kernels
from slidedp.exec.adamw import adamw_chunk_into
from slidedp.exec.features.base import Kernel
from slidedp.exec.features.deferred_update import DeferredUpdate
from slidedp.exec.kernels import Context, StepData, span
from slidedp.graph.tasks import Kind
from slidedp.spec.plan import Plan


@dataclass(frozen=True)
class Pending:
    """A step's update that is still to run."""

    data: StepData  # its Adam step counts (adam_step) and learning rate (lr)
    coef: float  # the clipping coefficient (1: no clipping)
    skip: bool  # its norm is not finite and non-finite steps are skipped


class SplitUpdate(DeferredUpdate):
    name = "split_update"

    @staticmethod
    def graph_options(plan: Plan) -> dict:
        return {"update_pending": True} if plan.splits_update else {}

    @staticmethod
    def enabled(k: Context) -> bool:
        return k.plan.splits_update

    def __init__(self, k: Context):
        super().__init__(k)
        g = k.tpl.g
        self.current: StepData | None = None
        self.pending: Pending | None = None  # the last step's update, to run
        self.running: Pending | None = None  # what this step's kernels run
        commits: dict[int, list[tuple[int, int, tuple[int, int], int]]] = {}
        for v in (g.kind == Kind.ADAM).nonzero()[0].tolist():
            u, lo, hi = span(k, v)
            commits.setdefault(u, []).append((lo, hi, self._ring(v), int(g.buffer[v])))
        # per UPDATE_CAST: the pending gradient chunks (lo, hi, ring key, slot) it overlaps
        self.pieces = {}
        for v in self.local_tasks(Kind.UPDATE_CAST):
            u, lo, hi = span(k, v)
            self.pieces[v] = [c for c in commits[u] if c[0] < hi and lo < c[1]]

    def _ring(self, v: int) -> tuple[int, int]:
        g = self.k.tpl.g
        return int(g.ring_rank[v]), int(g.ring_worker[v])

    def kernels(self, table: list[Kernel | None]) -> dict[int, Kernel]:
        out: dict[int, Kernel] = dict.fromkeys(self.local_tasks(Kind.HOST_SUM), self.host_sum)
        out.update(dict.fromkeys(self.local_tasks(Kind.UPDATE_CAST), self.update_cast))
        out.update(dict.fromkeys(self.local_tasks(Kind.ADAM), self.commit))
        return out

    def begin_step(self, d: StepData, input_ids) -> None:
        self.current, self.running, self.pending = d, self.pending, None

    def skips_update(self, grad_sqnorm: float) -> bool:
        """The step's update becomes the pending one (module docstring); whether it is skipped."""
        k = self.k
        norm = math.sqrt(float(k.bufs.sq.double().sum()))
        skip = k.opt.skip_nonfinite and not math.isfinite(norm)
        coef = 1.0 if k.opt.grad_clip is None else min(1.0, k.opt.grad_clip / (norm + 1e-6))
        self.pending = Pending(self.current, coef, skip)
        return skip

    @staticmethod
    def _live(p: Pending | None) -> Pending | None:
        return None if p is None or p.skip else p

    def update_cast(self, d: StepData, v: int) -> None:
        p = self._live(self.running)
        if p is None:
            kernels.cast(self.k, d, v)
            return
        k, hs = self.k, self.k.host_state
        u, lo, hi = span(k, v)
        staging = k.bufs.rings.staging[int(k.tpl.g.buffer[v])]
        master, m, vv = hs.unit_master(u), hs.unit_m(u), hs.unit_v(u)
        for glo, ghi, key, slot in self.pieces[v]:  # as the commit of [glo, ghi) computes it
            a, z = max(lo, glo), min(hi, ghi)
            grad = k.bufs.rings.grad[key][slot][:ghi - glo]
            adamw_chunk_into(staging[a - lo:z - lo], master[glo:ghi], grad, m[glo:ghi],
                             vv[glo:ghi], p.data.adam_step[u], k.opt, p.data.lr, p.coef,
                             a - glo)

    def commit(self, d: StepData, v: int) -> None:
        self._commit(self._live(self.running), v)

    def _commit(self, p: Pending | None, v: int) -> None:
        if p is None:
            return
        k = self.k
        u, lo, hi = span(k, v)
        grad = k.bufs.rings.grad[self._ring(v)][int(k.tpl.g.buffer[v])][:hi - lo]
        kernels.update(k, p.data, u, lo, hi, grad, p.coef)

    def flush(self) -> None:
        """This process's pending commits, now, in task order; nothing is pending after."""
        p = self._live(self.pending)
        if p is not None:
            for v in self.local_tasks(Kind.ADAM):
                self._commit(p, v)
        self.pending = None

    def host_state_changed(self) -> None:
        self.pending = None
