"""The embedding's split update (plan.embedding_rows) in the executor: the looked-up rows.

graph/build.py ("embedding rows") schedules it; docs/embedding-rows.md explains it. Per step, U is
the sorted distinct token ids of the global batch (every process has the global batch, so every
rank computes the same U). This module holds the feature's buffers and operations (EmbeddingRows)
and its kernels and step hooks (SplitEmbedding):
    compact gradient  |U| x h on the device, in U's order: HEAD_LOSS (tied) writes the head's share
                      of U's rows into it, EMBED_BWD adds the lookups; rows D2H reads it
    bulk ADAM         a chunk of the embedding (whole rows) updated with the gradient known before
                      EMBED_BWD while U's rows keep their state: saved, fused Adam, restored
    rows ADAM         U's rows of a compact chunk gathered from the master and the moments,
                      updated with the full gradient, scattered back
    rows CAST / H2D   U's rows gathered and cast into a staging chunk, uploaded into a compact
                      device buffer, scattered into the embedding slot
    bulk D2H          U's rows zeroed in the widened chunk, so that the norm counts them once
    HEAD_LOSS (tied)  the base kernel, then the head's share of U's rows into the compact gradient
    EMBED_BWD         the lookups' gradient into U's rows of the compact gradient
Buffers are reserved once (row capacity = min(V, tokens of the global batch)). U, its device copy
and each token's index in U are made each step before the step's boundary synchronisation (the
engine's step()), so the streams that read them see them complete; a bulk download makes one small
index tensor on its own stream. Each step delivers the NEXT step's embedding (every row during the
backward, then the rows the batch looked up); the feature delivers it whole, synchronously, before
the engine's first step, after a failed step and after host_state_changed().
"""

from __future__ import annotations

from functools import partial

import torch

from slidedp.exec import kernels
from slidedp.exec.adamw import AdamWConfig, adamw_chunk
from slidedp.exec.buffers import BufferSpec
from slidedp.exec.features.base import Feature, Kernel
from slidedp.exec.kernels import Context, StepData, span
from slidedp.graph.tasks import Kind
from slidedp.spec.plan import Plan


class EmbeddingRows:
    def __init__(self, vocab: int, hidden: int, capacity_rows: int, adam_elems: int,
                 cast_elems: int, workers: list[int], device: torch.device, dtype: torch.dtype,
                 zero_grad: bool):
        """adam_elems: the largest ADAM chunk; cast_elems: the largest rows CAST / H2D chunk;
        zero_grad: an untied embedding, whose bulk reads a zero gradient."""
        self.vocab, self.h = vocab, hidden
        self.grad = torch.empty(capacity_rows, hidden, device=device, dtype=dtype)
        self.upload = torch.empty(cast_elems, device=device, dtype=dtype)
        rows = max(1, adam_elems // hidden)
        # per update worker: saved / gathered p, m, v rows (one chunk of whole rows each)
        self.saved = {w: torch.empty(3, rows, hidden, dtype=torch.float32) for w in workers}
        self.cast_rows = torch.empty(max(1, cast_elems // hidden), hidden, dtype=torch.float32)
        # read by Adam only: unpinned
        self.zero = torch.zeros(adam_elems if zero_grad else 0, dtype=torch.float32)
        self.u = torch.empty(0, dtype=torch.long)  # U on the host
        self.u_dev = self.u.to(device)
        self.inv: list[torch.Tensor] = []  # per micro-batch: each token's row in U (device)

    @property
    def n(self) -> int:
        """|U|: the rows this step looked up."""
        return len(self.u)

    def begin_step(self, global_ids: torch.Tensor, local_ids: list[torch.Tensor]) -> None:
        """U from the global batch (host), each local token's index in U (device)."""
        self.u = torch.unique(global_ids.reshape(-1))  # sorted
        if len(self.u) > len(self.grad):
            raise ValueError(f"{len(self.u)} distinct tokens exceed the row capacity {len(self.grad)}")
        self.u_dev = self.u.to(self.grad.device)
        self.inv = [torch.searchsorted(self.u_dev, ids.reshape(-1)) for ids in local_ids]

    def span(self, row_lo: int, row_hi: int) -> tuple[int, int]:
        """[a, b): the entries of U in rows [row_lo, row_hi)."""
        a = int(torch.searchsorted(self.u, row_lo))
        return a, int(torch.searchsorted(self.u, row_hi))

    # ---- compute -----------------------------------------------------------------------------

    def gather_head(self, head_grad: torch.Tensor) -> None:
        """Tied: the head's share of U's rows (before the bulk gradient leaves the GPU)."""
        torch.index_select(head_grad, 0, self.u_dev, out=self.grad[:self.n])

    def add_lookups(self, grads: list[torch.Tensor], ids: list[torch.Tensor], pad: int | None,
                    tied: bool) -> None:
        """EMBED_BWD: the lookups' gradient into U's rows (untied: from zero)."""
        g = self.grad[:self.n]
        if not tied:
            g.zero_()
        for gx, inv, tok in zip(grads, self.inv, ids, strict=True):
            gx = gx.reshape(-1, gx.shape[-1])
            if pad is not None:  # nn.Embedding(padding_idx) gives that row no gradient
                gx = gx * (tok.reshape(-1) != pad)[:, None].to(gx.dtype)
            g.index_add_(0, inv, gx)

    def compact(self, lo: int, hi: int) -> tuple[int, int]:
        """A compact chunk [lo, hi) (elements) clipped to this step's rows: [j0, j1) of U."""
        return min(lo // self.h, self.n), min(hi // self.h, self.n)

    def zero_looked_up(self, chunk: torch.Tensor, lo: int, hi: int) -> None:
        """Zero U's rows of a bulk gradient chunk [lo, hi) (whole rows) of the embedding."""
        a, b = self.span(lo // self.h, hi // self.h)
        if b > a:
            rows = (self.u_dev if chunk.is_cuda else self.u)[a:b] - lo // self.h
            chunk.view(-1, self.h).index_fill_(0, rows, 0.0)

    # ---- host --------------------------------------------------------------------------------

    def bulk_adam(self, w: int, p: torch.Tensor, g: torch.Tensor, m: torch.Tensor,
                  v: torch.Tensor, lo: int, step: int, cfg: AdamWConfig, lr: float) -> None:
        """Adam over a chunk of whole rows starting at element lo; U's rows keep their state."""
        h = self.h
        a, b = self.span(lo // h, (lo + len(p)) // h)
        rows = self.u[a:b] - lo // h
        k = len(rows)
        views = [t.view(-1, h) for t in (p, m, v)]
        for s, t in zip(self.saved[w], views, strict=True):
            torch.index_select(t, 0, rows, out=s[:k])
        adamw_chunk(p, g, m, v, step, cfg, lr)
        for s, t in zip(self.saved[w], views, strict=True):
            t.index_copy_(0, rows, s[:k])

    def rows_adam(self, w: int, master: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, g: torch.Tensor, j0: int, j1: int, step: int,
                  cfg: AdamWConfig, lr: float) -> torch.Tensor:
        """Adam on U[j0:j1]'s rows (gathered, updated, scattered back); their updated values."""
        idx, k = self.u[j0:j1], j1 - j0
        full = [t.view(-1, self.h) for t in (master, exp_avg, exp_avg_sq)]
        part = [s[:k] for s in self.saved[w]]
        for s, t in zip(part, full, strict=True):
            torch.index_select(t, 0, idx, out=s)
        adamw_chunk(*(s.view(-1) for s in part[:1]), g, *(s.view(-1) for s in part[1:]), step,
                    cfg, lr)
        for s, t in zip(part, full, strict=True):
            t.index_copy_(0, idx, s)
        return part[0]

    def rows_cast(self, staging: torch.Tensor, master: torch.Tensor, j0: int, j1: int) -> None:
        """U[j0:j1]'s rows of the master, cast into a staging chunk."""
        k = j1 - j0
        torch.index_select(master.view(-1, self.h), 0, self.u[j0:j1], out=self.cast_rows[:k])
        staging[:k * self.h].view(k, self.h).copy_(self.cast_rows[:k])

    def rows_h2d(self, slot: torch.Tensor, staging: torch.Tensor, j0: int, j1: int) -> None:
        """A staging chunk of U[j0:j1]'s rows into the embedding slot (on its stream)."""
        k = j1 - j0
        buf = self.upload[:k * self.h]
        buf.copy_(staging[:k * self.h], non_blocking=True)
        slot.view(-1, self.h).index_copy_(0, self.u_dev[j0:j1], buf.view(k, self.h))


class SplitEmbedding(Feature):
    """The split update's kernels: the looked-up rows' tasks (the graph's `rows`), the bulk's
    D2H and ADAM (the embedding's other tasks), EMBED_BWD, and HEAD_LOSS with tied embeddings."""

    name = "embedding_rows"

    @staticmethod
    def graph_options(plan: Plan) -> dict:
        return {"first_delivery": False} if plan.splits_embedding else {}

    @staticmethod
    def enabled(k: Context) -> bool:
        return k.plan.splits_embedding

    @staticmethod
    def configure(spec: BufferSpec, k: Context) -> None:
        spec.embedding_grad = k.runner.tied  # untied: the gradient is the compact one only
        spec.masked_downloads = k.runner.tied  # the tied bulk zeroes U's rows (untied: no D2H)

    def __init__(self, k: Context):
        super().__init__(k)
        g, runner = k.tpl.g, k.runner
        rows_cast = int((g.elem_hi - g.elem_lo)[g.rows & (g.kind == Kind.CAST)].max())
        self.rows = EmbeddingRows(
            runner.vocab, runner.hidden, g.meta.embedding_rows_elems // runner.hidden,
            k.tpl.largest(Kind.ADAM), rows_cast, k.bufs.local_workers, k.device, k.dtype,
            zero_grad=not runner.tied)
        self.delivered = False  # the slot holds the next step's embedding

    def kernels(self, table: list[Kernel | None]) -> dict[int, Kernel]:
        g = self.k.tpl.g
        looked_up = {Kind.CAST: self.cast, Kind.H2D: self.h2d, Kind.REDUCE: self.reduce,
                     Kind.D2H: self.d2h, Kind.HOST_SUM: self.host_sum, Kind.ADAM: self.adam}
        bulk = {Kind.D2H: self.bulk_d2h, Kind.ADAM: self.bulk_adam}
        out: dict[int, Kernel] = {}
        for v in self.local_tasks(*looked_up):
            if g.rows[v]:
                out[v] = looked_up[self.k.tpl.kind[v]]
            elif g.unit[v] == 0 and self.k.tpl.kind[v] in bulk:
                out[v] = bulk[self.k.tpl.kind[v]]
        out.update(dict.fromkeys(self.local_tasks(Kind.EMBED_BWD), self.embed_bwd))
        if self.k.runner.tied:
            for v in self.local_tasks(Kind.HEAD_LOSS):
                out[v] = partial(self.head_loss, table[v])
        return out

    # ---- step hooks --------------------------------------------------------------------------

    def begin_step(self, d: StepData, input_ids: torch.Tensor) -> None:
        self.rows.begin_step(input_ids, d.ids)
        if not self.delivered:
            self.deliver()
        self.delivered = False  # until this step has delivered the next one's

    def end_step(self) -> None:
        self.delivered = True

    def host_state_changed(self) -> None:
        self.delivered = False

    def deliver(self) -> None:
        """The embedding into this rank's slot, whole and synchronously. Straight from the host
        state (pageable: a synchronous copy), a staging-ring chunk at a time; not through the
        ring, which the other ranks share."""
        k = self.k
        hs = k.host_state
        src = hs.unit_copy(0) if k.plan.host_bf16_copy else hs.unit_master(0)
        slot, step = k.bufs.window.slot(0), len(k.bufs.rings.staging[0])
        for lo in range(0, len(src), step):
            slot[lo:lo + step].copy_(src[lo:lo + step])
        if k.cuda:
            torch.cuda.synchronize(k.device)

    # ---- kernels -----------------------------------------------------------------------------

    def cast(self, d: StepData, v: int) -> None:
        k = self.k
        _, lo, hi = span(k, v)
        j0, j1 = self.rows.compact(lo, hi)
        if j1 > j0:
            staging = k.bufs.rings.staging[int(k.tpl.g.buffer[v])]
            self.rows.rows_cast(staging, k.host_state.unit_master(0), j0, j1)

    def h2d(self, d: StepData, v: int) -> None:
        k = self.k
        _, lo, hi = span(k, v)
        j0, j1 = self.rows.compact(lo, hi)
        if j1 > j0:
            staging = k.bufs.rings.staging[k.tpl.h2d_src[v]]
            self.rows.rows_h2d(k.bufs.window.slot(0), staging, j0, j1)

    def head_loss(self, kernel: Kernel, d: StepData, v: int) -> None:
        kernel(d, v)
        self.rows.gather_head(self.k.bufs.window.grad_views(0)["weight"])

    def embed_bwd(self, d: StepData, v: int) -> None:
        self.rows.add_lookups(d.cur, d.ids, self.k.runner.padding_idx, self.k.runner.tied)
        d.cur = []

    def reduce(self, d: StepData, v: int) -> None:
        rows = self.rows
        self.k.bufs.coll.reduce_rows(rows.grad.view(-1), rows.n * rows.h, rows.h)

    def d2h(self, d: StepData, v: int) -> None:
        """This step's looked-up rows of a compact gradient chunk."""
        k, rows = self.k, self.rows
        _, lo, hi = span(k, v)
        j0, j1 = rows.compact(lo, hi)
        if j1 == j0:
            if (j := k.tpl.norm_slot[v]) >= 0:
                k.bufs.sq[j] = 0.0
            return
        k.download(k, v, rows.grad.view(-1)[j0 * rows.h:j1 * rows.h])

    def bulk_d2h(self, d: StepData, v: int) -> None:
        """A bulk chunk with U's rows zeroed, so that the norm counts them once."""
        k = self.k
        _, lo, hi = span(k, v)
        k.download(k, v, k.bufs.window.grad(0)[lo:hi],
                   partial(self.rows.zero_looked_up, lo=lo, hi=hi))

    def host_sum(self, d: StepData, v: int) -> None:
        """This step's looked-up rows of the chunk (what the D2Hs copied)."""
        k = self.k
        _, lo, hi = span(k, v)
        j0, j1 = self.rows.compact(lo, hi)
        if j1 == j0:
            k.bufs.sq[k.tpl.norm_slot[v]] = 0.0
            return
        kernels.sum_chunks(k, v, (j1 - j0) * self.rows.h)

    def adam(self, d: StepData, v: int) -> None:
        k, rows = self.k, self.rows
        _, lo, hi = span(k, v)
        j0, j1 = rows.compact(lo, hi)
        if j1 == j0:
            return
        hs = k.host_state
        g = kernels.adam_grad(k, v, (j1 - j0) * rows.h)
        new = rows.rows_adam(k.tpl.worker[v], hs.unit_master(0), hs.unit_m(0), hs.unit_v(0), g,
                             j0, j1, d.adam_step[0], k.opt, d.lr)
        if hs.copy is not None:
            hs.unit_copy(0).view(-1, rows.h).index_copy_(0, rows.u[j0:j1], new.to(k.dtype))

    def bulk_adam(self, d: StepData, v: int) -> None:
        """A bulk chunk; the untied bulk (no gradient source) reads a zero gradient."""
        k = self.k
        _, lo, hi = span(k, v)
        g = kernels.adam_grad(k, v, hi - lo) if k.tpl.grad_src[v] else self.rows.zero[:hi - lo]
        hs = k.host_state
        p = hs.unit_master(0)[lo:hi]
        self.rows.bulk_adam(k.tpl.worker[v], p, g, hs.unit_m(0)[lo:hi], hs.unit_v(0)[lo:hi], lo,
                            d.adam_step[0], k.opt, d.lr)
        if hs.copy is not None:
            hs.unit_copy(0)[lo:hi].copy_(p)
