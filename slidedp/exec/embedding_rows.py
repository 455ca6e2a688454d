"""The embedding's split update (plan.embedding_rows) in the executor: the looked-up rows.

graph/build.py ("embedding rows") schedules it; docs/embedding-rows.md explains it. Per step, U is
the sorted distinct token ids of the global batch (every process has the global batch, so every
rank computes the same U). This module holds what the engine's tasks need for it:
    compact gradient  |U| x h on the device, in U's order: HEAD_LOSS (tied) writes the head's share
                      of U's rows into it, EMBED_BWD adds the lookups; rows D2H reads it
    bulk ADAM         a chunk of the embedding (whole rows) updated with the gradient known before
                      EMBED_BWD while U's rows keep their state: saved, fused Adam, restored
    rows ADAM         U's rows of a compact chunk gathered from the master and the moments,
                      updated with the full gradient, scattered back
    rows CAST / H2D   U's rows gathered and cast into a staging chunk, uploaded into a compact
                      device buffer, scattered into the embedding slot
    bulk D2H          U's rows zeroed in the widened chunk, so that the norm counts them once
Buffers are reserved once (row capacity = min(V, tokens of the global batch)). U, its device copy
and each token's index in U are made each step before the step's boundary synchronisation (the
engine's step()), so the streams that read them see them complete; a bulk download makes one small
index tensor on its own stream.
"""

from __future__ import annotations

import torch

from slidedp.exec.adamw import AdamWConfig, adamw_chunk


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
                  v: torch.Tensor, lo: int, step: int, cfg: AdamWConfig, lr: float,
                  clip: float = 1.0) -> None:
        """Adam over a chunk of whole rows starting at element lo; U's rows keep their state."""
        h = self.h
        a, b = self.span(lo // h, (lo + len(p)) // h)
        rows = self.u[a:b] - lo // h
        k = len(rows)
        views = [t.view(-1, h) for t in (p, m, v)]
        for s, t in zip(self.saved[w], views, strict=True):
            torch.index_select(t, 0, rows, out=s[:k])
        adamw_chunk(p, g, m, v, step, cfg, lr, clip)
        for s, t in zip(self.saved[w], views, strict=True):
            t.index_copy_(0, rows, s[:k])

    def rows_adam(self, w: int, master: torch.Tensor, exp_avg: torch.Tensor,
                  exp_avg_sq: torch.Tensor, g: torch.Tensor, j0: int, j1: int, step: int,
                  cfg: AdamWConfig, lr: float, clip: float = 1.0) -> torch.Tensor:
        """Adam on U[j0:j1]'s rows (gathered, updated, scattered back); their updated values."""
        idx, k = self.u[j0:j1], j1 - j0
        full = [t.view(-1, self.h) for t in (master, exp_avg, exp_avg_sq)]
        part = [s[:k] for s in self.saved[w]]
        for s, t in zip(part, full, strict=True):
            torch.index_select(t, 0, idx, out=s)
        adamw_chunk(*(s.view(-1) for s in part[:1]), g, *(s.view(-1) for s in part[1:]), step,
                    cfg, lr, clip)
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
