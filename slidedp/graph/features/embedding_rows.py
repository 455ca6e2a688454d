"""Feature embedding_rows (plan.splits_embedding: embedding_rows without defer_update): the
embedding's update leaves the step boundary, in two parts.

Bulk: ADAM of every chunk of the embedding with the gradient known before EMBED_BWD, each keeping
the looked-up rows' state as it was (their p, m, v saved and restored: work + 2 x the rows'
elements):
  tied     the head's share, through the unit's usual REDUCE / D2H / HOST_SUM path after
           HEAD_LOSS, its chunks' D2Hs and ADAMs issued ceil(chunks / L) after each layer's in the
           backward (all at once they held the download ring and the update workers and stalled
           the backward: measured on nvidia-h200, Qwen3-4B);
  untied   a zero gradient, no download, at the step's start, after every rank's EMBED_FWD.
The bulk delivery for the NEXT step (CAST / H2D / ALLGATHER of the embedding, gated by these
ADAMs) follows the backward's deliveries and waits for the embedding's readers (EMBED_FWD, and
HEAD_LOSS when tied).
Rows: EMBED_BWD writes a compact gradient of the looked-up rows (row_capacity(wl) x hidden
elements, the most a batch can look up; tasks flagged `rows`, ranges in that compact space, whole
rows; their work scaled to the expected looked_up_rows(wl); the embedding's own gradient chunks
and update shares are whole rows: GraphMeta.embedding_grad_align), which takes the usual gradient
path (REDUCE / D2H / HOST_SUM -> ADAM, after every bulk ADAM and every host-side reader of the
bulk delivery: its CASTs, or its H2Ds of the host copy) -> CAST -> H2D to every rank (after its
bulk delivery: the rows overwrite their stale bulk copy). The next step's EMBED_FWD waits for its
rank's bulk delivery and rows H2Ds instead of a delivery of its own (iteration 0 delivers the
embedding at its start, unless the builder leaves that to the executor: first_delivery).
Version gates: from the bulk ADAMs of t to the bulk delivery made in t, from the rows ADAMs to
the rows CASTs: same-iteration edges, as those deliveries are the next step's.
"""

from __future__ import annotations

import itertools
import math

from slidedp.graph.features.base import Feature, add_term
from slidedp.graph.recorder import GradChunk, GradPath
from slidedp.graph.sizes import grad_chunks
from slidedp.graph.tasks import EdgeKind, Kind
from slidedp.spec.elements import FP32_BYTES, PARAM_BYTES
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import Plan
from slidedp.spec.units import MIB
from slidedp.spec.workload import Workload

DATA = EdgeKind.DATA


def row_capacity(wl: Workload) -> int:
    """Most distinct embedding rows a global batch can look up: min(V, tokens of the batch)."""
    return min(wl.model.vocab_size, wl.global_batch * wl.seq_len)


def looked_up_rows(wl: Workload) -> int:
    """Expected distinct embedding rows a global batch looks up, for uniformly random token ids:
    V (1 - (1 - 1/V)^T), T = tokens of the global batch. Real text repeats tokens more (the rows
    are fewer), so this is the upper end the embedding-rows tasks are sized by."""
    v, t = wl.model.vocab_size, wl.global_batch * wl.seq_len
    return max(1, min(v, t, round(v * -math.expm1(t * math.log1p(-1.0 / v)))))


class EmbeddingRows(Feature):
    @staticmethod
    def applies(plan: Plan) -> bool:
        return plan.splits_embedding

    @staticmethod
    def grad_align(wl: Workload, plan: Plan, unit: int) -> int:
        return wl.model.hidden if unit == 0 else 1

    @staticmethod
    def gpu_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        """The looked-up rows' compact gradient and one upload chunk; an untied embedding keeps
        its gradient there, not in a gradient buffer of its own; with BF16 downloads a tied
        bulk's chunk is narrowed again into one more BF16 chunk (exec/features/embedding_rows.py)."""
        m, on = wl.model, plan.splits_embedding
        if on and not m.tie_embeddings:
            terms["grad_buffers"] -= m.unit_params()[0] * 2
        add_term(terms, "embedding_rows",
                 row_capacity(wl) * m.hidden * 2 + plan.h2d_chunk_mib * MIB if on else 0.0,
                 before="d2h_widen")
        if on and m.tie_embeddings and wire < FP32_BYTES:
            terms["d2h_widen"] += plan.d2h_chunk_mib * MIB

    @staticmethod
    def host_memory(wl: Workload, plan: Plan, terms: dict[str, float], wire: int) -> None:
        """The rows' buffers: three FP32 ADAM chunks per update worker (the saved rows), the
        cast's rows and, untied, the zero gradient; an ADAM chunk holds d2h_chunk_mib of wire
        bytes, so twice the MiB in FP32 when gradients come as BF16."""
        add_term(terms, "embedding_rows",
                 (3 * plan.update_workers + 1 + (not wl.model.tie_embeddings))
                 * plan.d2h_chunk_mib * MIB * FP32_BYTES / wire if plan.splits_embedding else 0.0,
                 before="runtime")

    def __init__(self, b):
        super().__init__(b)
        wl, hidden = b.wl, b.m.hidden
        if wl.nodes > 1:  # the rows each node looked up differ: no one compact buffer to reduce
            raise SpecError("plan", "embedding_rows", f"off with {wl.nodes} nodes (each node "
                            "looks up its own rows)")
        # the rows tasks tile the capacity (the most rows a batch can look up); their work is the
        # expected share of it (`fill`), as the executor skips the rows past the batch's own
        self.elems = row_capacity(wl) * hidden
        self.fill = looked_up_rows(wl) / row_capacity(wl)
        self.chunks = grad_chunks(self.elems, b.R, b.plan, b.wire, hidden)
        self.bulk_extra = 2.0 * self.fill * self.elems / b.units[0]  # saved + restored rows
        self.bulk_per_layer = -(-len(b.grad_plans[0]) // b.L)
        self.tied = b.m.tie_embeddings
        self.next_emb: list[list[int]] | None = None  # per rank, what EMBED_FWD of t+1 waits on
        self.prev: list[int] = []  # the previous step's rows update and its host-side readers
        self.bulk: list[tuple[int, int, int]] = []  # this step's bulk ADAMs (task, lo, hi)
        self.bulk_path = iter(())
        self.next_bulk: list[list[int]] = []
        self.bulk_casts: list[int] = []

    def meta(self) -> dict:
        return {"embedding_rows_elems": self.elems, "embedding_grad_align": self.b.m.hidden}

    def embedding_delivery(self, t: int) -> list[list[int]] | None:
        if self.next_emb is not None:
            return self.next_emb
        return None if self.b.first_delivery else [[] for _ in range(self.b.R)]

    def after_embed_fwd(self, t: int) -> None:
        """Untied: the bulk's ADAMs with a zero gradient (nothing to download), after the
        previous step's rows update and its readers, and after every rank's EMBED_FWD (each
        rank's own first delivery of the embedding, the executor's, reads the master before its
        first step: the bulk must not change it meanwhile)."""
        b = self.b
        self.bulk = []
        if self.tied:
            return
        for k, (w, lo, hi) in enumerate(b.grad_plans[0]):
            a = b.adam(GradChunk(t, 0, k, w, lo, hi, -1, (-1, -1), -1,
                                 extra=round(self.bulk_extra * (hi - lo))))
            b.rec.edges(self.prev + b.step.emb_fwd, a, DATA)
            self.bulk.append((a, lo, hi))

    def after_head(self, t: int) -> None:
        """Tied: the head's share of every row, after HEAD_LOSS, its chunks spread over the
        backward (a few after each layer's), so that the update workers and the download ring
        never stall the backward on the whole bulk at once."""
        b = self.b
        path = GradPath(b.grad_plans[0], b.units[0], extra=self.bulk_extra)
        self.bulk_path = b.gradient_path(t, 0, b.step.head, None, path) if self.tied else iter(())

    def _spread_bulk(self, n: int | None) -> None:
        for a, lo, hi in itertools.islice(self.bulk_path, n):
            self.b.rec.edges(self.prev, a, DATA)
            self.bulk.append((a, lo, hi))

    def after_backward_layer(self, t: int, layer: int) -> None:
        self._spread_bulk(self.bulk_per_layer)

    def after_backward(self, t: int) -> None:
        """The rest of the bulk, then the next step's bulk delivery after its readers here."""
        b = self.b
        self._spread_bulk(None)
        for r in range(b.R):
            b.readers[("embed", r)] = [b.step.head[r] if self.tied else b.step.emb_fwd[r]]
        first = b.rec.n
        self.next_bulk = b.deliver(t, 0, ("embed",), b.W, True, gates=self.bulk)
        # the host-side readers of the bulk delivery: CASTs of the master, or with
        # host_bf16_copy the H2Ds of the copy, which the rows update rewrites
        reader = Kind.H2D if b.plan.host_bf16_copy else Kind.CAST
        self.bulk_casts = [v for v in range(first, b.rec.n) if b.rec.kind_of(v) == reader]

    def embedding_gradient(self, t: int) -> bool:
        """The rows' gradient path, after the bulk (which restored the rows' state and read the
        master), then the rows to every rank."""
        b = self.b
        path = GradPath(self.chunks, self.elems, first_chunk=len(b.grad_plans[0]),
                        scale=self.fill, rows=True)
        rows_adams = b.reduce_and_update(t, 0, b.step.emb_bwd, None, path)
        for a, _, _ in rows_adams:
            b.rec.edges([x for x, _, _ in self.bulk] + self.bulk_casts, a, DATA)
        first = b.rec.n
        rows_ready = self._deliver_rows(t, rows_adams)
        self.next_emb = [self.next_bulk[r] + rows_ready[r] for r in range(b.R)]
        # what the next bulk must not overtake: the rows update, and whatever read the host
        # state it changes (the rows' CASTs; the bulk's CASTs or copy H2Ds)
        self.prev = [a for a, _, _ in rows_adams] + self.bulk_casts + [
            v for v in range(first, b.rec.n) if b.rec.kind_of(v) == Kind.CAST]
        return True

    def _deliver_rows(self, t: int, rows_adams: list) -> list[list[int]]:
        """The looked-up rows to every rank's embedding slot, after the rank's bulk delivery:
        per rank, the H2Ds the next step's EMBED_FWD waits on (besides the bulk delivery)."""
        b, rec = self.b, self.b.rec
        h2ds = [[] for _ in range(b.R)]
        k0 = sum(len(x) for x in b.up_plans[0])  # rows chunks are numbered after the bulk's
        for k, (_, lo, hi) in enumerate(self.chunks):
            i, prev = b.staging.take()
            src = rec.task(Kind.CAST, t, 0, -1, k0 + k, b.cast, (hi - lo) * self.fill, lo, hi,
                           threads=b.cast_threads, buffer=i, rows=True)
            rec.edges(prev, src, EdgeKind.BUFFER)
            b.gate(src, lo, hi, rows_adams)
            for r in range(b.R):
                v = rec.task(Kind.H2D, t, 0, r, k0 + len(h2ds[r]), b.h2d[r],
                             (hi - lo) * PARAM_BYTES * self.fill, lo, hi, buffer=b.W, rows=True,
                             staging_slot=i)
                rec.edge(src, v, DATA)
                rec.edges(self.next_bulk[r], v, EdgeKind.BUFFER)
                b.staging.readers[i].append(v)
                h2ds[r].append(v)
        return h2ds
