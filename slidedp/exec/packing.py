"""Documents -> rows of `seq` tokens: concatenated, one per row (padded), or packed with boundaries.

A document is its token ids and, where only some tokens are trained on (chat data, exec/data_chat.py),
its labels (-100 = no loss); without labels every token is one. A document longer than `seq` is
cut into pieces of `seq` tokens (the last one shorter), each then a document of its own: no token
is dropped, and a piece does not see the piece before it.

Three layouts:
    concat_rows  the documents back to back, cut every `seq` tokens; the tail shorter than a row
                 is dropped (counted). Attention crosses document boundaries (the classic
                 pre-training layout; plain text without --pack).
    pad_rows     one piece per row, padded to `seq` with `pad_id` (labels -100 on the padding).
                 The padding comes after the piece, so causal attention keeps the piece exact.
    pack_rows    pieces packed into rows best-fit decreasing (longest first, each into the row
                 with the least room that holds it, else a new row; ties by input order), the
                 rest of a row padded. Every piece, and the padding, restarts the position ids at
                 0: the executor attends within a document only (layer_runner.document_mask) and
                 RoPE sees each from position 0. The label at each piece's first position is -100,
                 so the token before it (the previous document's last) predicts nothing, as when
                 the documents run one by one: a packed row computes the same loss.
BFD keeps rows as full as first-fit decreasing or better; its cost is O(pieces x open rows) for
the sorted list of free room (bisect + list insert).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

IGNORE = -100
ROW_DTYPE = np.int32  # token ids, labels and positions of padded and packed rows


@dataclass(frozen=True)
class Document:
    """Token ids and labels (None: every token is a label), 1-D integer arrays or sequences."""

    ids: np.ndarray | Sequence[int]
    labels: np.ndarray | Sequence[int] | None = None


@dataclass
class Rows:
    """(n, seq) token ids; labels and position ids where the layout needs them (else None)."""

    tokens: np.ndarray
    labels: np.ndarray | None = None
    position_ids: np.ndarray | None = None
    dropped_tokens: int = 0
    documents: int = 0  # pieces placed (pad_rows, pack_rows)


def pieces(docs: Iterable[Document], seq: int) -> list[Document]:
    """Every document cut into pieces of at most `seq` tokens; empty documents left out."""
    out = []
    for d in docs:
        for lo in range(0, len(d.ids), seq):
            out.append(Document(d.ids[lo:lo + seq],
                                None if d.labels is None else d.labels[lo:lo + seq]))
    return out


def concat_rows(docs: Iterable[Document], seq: int) -> Rows:
    """Back to back, cut every `seq` tokens (labels: the ids themselves)."""
    parts = []
    for d in docs:
        if d.labels is not None:
            raise ValueError("concat_rows: documents with labels need pad_rows or pack_rows")
        parts.append(np.asarray(d.ids, dtype=np.int64))
    ids = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    n = len(ids) // seq
    return Rows(ids[: n * seq].reshape(n, seq), dropped_tokens=len(ids) - n * seq)


def _fill(rows: list[list[Document]], seq: int, pad_id: int, positions: bool) -> Rows:
    n = len(rows)
    tokens = np.full((n, seq), pad_id, dtype=ROW_DTYPE)
    labels = np.full((n, seq), IGNORE, dtype=ROW_DTYPE)
    pos = np.zeros((n, seq), dtype=ROW_DTYPE) if positions else None
    for r, row in enumerate(rows):
        at = 0
        for d in row:
            k = len(d.ids)
            tokens[r, at:at + k] = d.ids
            labels[r, at:at + k] = d.ids if d.labels is None else d.labels
            if positions:
                labels[r, at] = IGNORE
                pos[r, at:at + k] = np.arange(k)
            at += k
        if positions:
            pos[r, at:] = np.arange(seq - at)
    return Rows(tokens, labels, pos, documents=sum(len(row) for row in rows))


def pad_rows(docs: Iterable[Document], seq: int, pad_id: int) -> Rows:
    """One piece per row, padded with pad_id (labels -100 there); causal positions."""
    return _fill([[d] for d in pieces(docs, seq)], seq, pad_id, positions=False)


def pack_rows(docs: Iterable[Document], seq: int, pad_id: int) -> Rows:
    """Pieces packed best-fit decreasing, each restarting the position ids (module docstring)."""
    ps = pieces(docs, seq)
    order = sorted(range(len(ps)), key=lambda i: -len(ps[i].ids))  # stable: ties in input order
    rows: list[list[Document]] = []
    free: list[tuple[int, int]] = []  # (room left, row), sorted
    for i in order:
        k = len(ps[i].ids)
        j = bisect.bisect_left(free, (k, -1))
        if j == len(free):
            rows.append([ps[i]])
            room, r = seq - k, len(rows) - 1
        else:
            room, r = free.pop(j)
            rows[r].append(ps[i])
            room -= k
        if room:
            bisect.insort(free, (room, r))
    return _fill(rows, seq, pad_id, positions=True)
