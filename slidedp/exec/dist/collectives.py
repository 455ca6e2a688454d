"""The fabric agent's collectives, in place on the window's buffers (the node's process group:
DistSession.node_group, whose ranks are the node's local ranks 0..R-1).

The comm thread calls them inside its comm stream's context (interpreter.py): with NCCL the
collective waits for the work already on the comm stream and, being synchronous (async_op=False),
makes the comm stream wait for it, so the task's end event on the comm stream marks its
completion; with gloo (CPU) the call returns when it is done.
    all_gather(u)  rank r uploaded shard r of unit u (sizes.shard_ranges) into its slot; after it
                   every rank's slot holds the whole unit. all_gather_into_tensor(slot,
                   slot[shard r]) when R divides the unit (NCCL's in-place all-gather), else one
                   broadcast per shard from its owner.
    reduce(u)      the gradient sum of unit u across ranks. update_sharding=rank0: reduce to
                   rank 0 in place (rank 0's gradient buffer holds the sum). sharded:
                   reduce_scatter_tensor into a reserved buffer copied back over this rank's
                   shard of the gradient buffer (R divides the unit), else one reduce per shard
                   to its owner (per whole-row share, align = hidden, for a split embedding's
                   bulk: sizes.update_shards). Either way D2H then reads the sum where it reads
                   a gradient with one rank: window.grad(u)[lo:hi].
    reduce_rows(buf, n, align)  the embedding's looked-up rows (plan.embedding_rows): the first
                   n elements of the compact gradient `buf`, the same rows on every rank; to
                   rank 0, or each update share (whole rows) to its owner.
NCCL sums BF16 gradients in BF16; the cpu gradient route sums them in FP32 on the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from slidedp.exec.window import Window
from slidedp.graph.sizes import shard_ranges, update_shards


class Collectives:
    def __init__(self, window: Window, ranks: int, rank: int, scatter: bool,
                 device: torch.device, dtype: torch.dtype, group=None):
        self.window, self.R, self.rank, self.scatter = window, ranks, rank, scatter
        self.group = group  # None: the default group
        largest = max(lay.numel for lay in window.layouts)
        self.scatter_out = (torch.empty(largest // ranks, device=device, dtype=dtype)
                            if scatter else None)

    def all_gather(self, unit: int) -> None:
        slot = self.window.slot(unit)
        n, R = slot.numel(), self.R
        if n % R == 0:
            s = n // R
            dist.all_gather_into_tensor(slot, slot[self.rank * s:(self.rank + 1) * s],
                                        group=self.group)
            return
        for p, (lo, hi) in enumerate(shard_ranges(n, R)):
            dist.broadcast(slot[lo:hi], group=self.group, group_src=p)

    def reduce(self, unit: int, align: int = 1) -> None:
        grad = self.window.grad(unit)
        n, R = grad.numel(), self.R
        if not self.scatter:
            dist.reduce(grad, group=self.group, group_dst=0)
            return
        if n % R == 0 and align == 1:
            s = n // R
            out = self.scatter_out[:s]
            dist.reduce_scatter_tensor(out, grad, group=self.group)
            grad[self.rank * s:(self.rank + 1) * s].copy_(out)
            return
        self._reduce_shares(grad, update_shards(n, R, align))  # (whole rows: an embedding's bulk)

    def reduce_rows(self, buf: torch.Tensor, n: int, align: int) -> None:
        if not self.scatter:
            dist.reduce(buf[:n], group=self.group, group_dst=0)
            return
        self._reduce_shares(buf, [(lo, min(hi, n))
                                  for lo, hi in update_shards(len(buf), self.R, align)])

    def _reduce_shares(self, buf: torch.Tensor, shares: list[tuple[int, int]]) -> None:
        """Share p of buf, [lo, hi), summed into rank p's buffer (empty shares skipped)."""
        for p, (lo, hi) in enumerate(shares):
            if hi > lo:
                dist.reduce(buf[lo:hi], group=self.group, group_dst=p)
