"""Whole-layer activation checkpoints: the input of every decoder layer, per micro-batch.

The input of layer l (1..L) for micro-batch b is T = micro_batch x seq tokens x hidden. Its first
n_off = round(offload_ratio x T) tokens go to host memory (ACT_OFFLOAD on the D2H stream, into
`host[l-1, b]`), the other T - n_off tokens stay on the GPU in `resident[l-1, b]`. Before layer
l's recompute, ACT_RELOAD copies the host part into GPU reload buffer l mod reload_ahead_layers
(the graph's ACT_RELOAD `buffer`), and `load` joins the two parts again. All buffers are
reserved at construction.
"""

from __future__ import annotations

import torch

from slidedp.exec.staging import PinnedPool


class Checkpoints:
    def __init__(
        self,
        n_layers: int,
        accum: int,
        micro_batch: int,
        seq_len: int,
        hidden: int,
        offload_ratio: float,
        reload_ahead: int,
        device: torch.device,
        dtype: torch.dtype,
        pool: PinnedPool,
    ):
        self.shape = (micro_batch, seq_len, hidden)
        tokens = micro_batch * seq_len
        self.n_off = int(round(offload_ratio * tokens))
        self.reload_ahead = reload_ahead
        self.resident = torch.empty(
            n_layers, accum, tokens - self.n_off, hidden, device=device, dtype=dtype
        )
        self.host = pool.empty((n_layers, accum, self.n_off, hidden), dtype)
        self.reload = torch.empty(
            reload_ahead, accum, self.n_off, hidden, device=device, dtype=dtype
        )

    def keep(self, layer: int, b: int, x: torch.Tensor) -> None:
        """Keep the resident part of layer `layer`'s input (the offloaded part goes by `offload`)."""
        self.resident[layer - 1, b].copy_(x.reshape(-1, self.shape[-1])[self.n_off :])

    def offload(self, layer: int, b: int, x: torch.Tensor) -> None:
        self.host[layer - 1, b].copy_(
            x.reshape(-1, self.shape[-1])[: self.n_off], non_blocking=True
        )

    def reload_layer(self, layer: int) -> None:
        self.reload[layer % self.reload_ahead].copy_(self.host[layer - 1], non_blocking=True)

    def load(self, layer: int, b: int) -> torch.Tensor:
        """Layer `layer`'s input for micro-batch b, (micro_batch, seq, hidden)."""
        res = self.resident[layer - 1, b]
        if self.n_off:
            res = torch.cat([self.reload[layer % self.reload_ahead, b], res])
        return res.view(self.shape)
