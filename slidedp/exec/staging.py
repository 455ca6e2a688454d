"""Bounded host buffers for the copy engines: the upload staging ring and the gradient rings.

The ring buffers are views of two flat host tensors (staging in the compute dtype, gradients in
FP32 or, with plan.grad_widen = host, in the compute dtype: graph.build.grad_wire_bytes), local
and page-locked for one rank, or in shared memory when several rank processes share them (every
process maps and pins them):
    staging[i]      i < plan.staging_chunks: a CAST writes the chunk in the compute dtype, the
                    H2Ds of every rank read it (the graph's CAST `buffer`)
    grad[(r, w)][i] the ring of rank r's gradient chunks for update worker w, i < its size
                    (graph.build.grad_ring_sizes): rank r's D2H writes it (widened to FP32 on the
                    GPU, or BF16 that Adam widens in cache), HOST_SUM (FP32 only) or ADAM of
                    worker w reads it (the graph's D2H / HOST_SUM / ADAM `buffer`); with one
                    rank r = 0
    acc[w]          per update worker of this process, an FP32 chunk in which HOST_SUM adds the
                    ranks' chunks (private memory); none with defer_update, where HOST_SUM adds
                    them into rank 0's chunk, which the ring keeps until the deferred ADAM
Sizes come from the graph (the largest chunk it schedules). Page-locking is an exact-size
cudaHostRegister (see host_state.py); `PinnedPool.empty` serves the activation offload buffers.
"""

from __future__ import annotations

import torch

from slidedp.exec.host_state import cuda_host_register, cuda_host_unregister


class PinnedPool:
    """Host tensors page-locked (exact size) when `pin` is true; unregistered on close()."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.pinned: list[torch.Tensor] = []

    def register(self, t: torch.Tensor) -> torch.Tensor:
        """Page-lock an existing tensor (a shared-memory mapping, say) for DMA."""
        if self.pin and t.numel():
            cuda_host_register(t)
            self.pinned.append(t)
        return t

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return self.register(torch.empty(shape, dtype=dtype))

    def close(self) -> None:
        for t in self.pinned:
            cuda_host_unregister(t)
        self.pinned.clear()


class HostRings:
    def __init__(
        self,
        staging_flat: torch.Tensor,
        staging_chunks: int,
        staging_elems: int,
        grad_flat: torch.Tensor,
        grad_chunks: dict[tuple[int, int], int],
        grad_elems: int,
        acc_workers: list[int],
        acc_elems: int,
    ):
        """grad_chunks: the slots of each gradient ring, by ring key (rank, worker)."""
        if (staging_flat.numel() != staging_chunks * staging_elems
                or grad_flat.numel() != self.grad_numel(grad_chunks, grad_elems)
                or (acc_workers and grad_flat.dtype != torch.float32)):
            raise ValueError("HostRings: a flat buffer has the wrong size or dtype")
        self.staging = list(staging_flat.split([staging_elems] * staging_chunks))
        pieces = iter(grad_flat.split(grad_elems))
        self.grad = {key: [next(pieces) for _ in range(n)] for key, n in grad_chunks.items()}
        self.acc = {w: torch.empty(acc_elems, dtype=torch.float32) for w in acc_workers}

    @staticmethod
    def grad_numel(grad_chunks: dict[tuple[int, int], int], grad_elems: int) -> int:
        return sum(grad_chunks.values()) * grad_elems

    def host_sum(self, worker: int, srcs: list[tuple[tuple[int, int], int]], n: int,
                 in_place: bool = False) -> torch.Tensor:
        """The sum in FP32 of the chunks (ring key, slot) in srcs, in their order, in acc[worker]
        or, in_place, in the first chunk. Each of the R - 1 additions reads two chunks and writes
        one (12 B per element; graph/build.py counts them, and the norm's read of the sum): the first
        writes acc directly instead of copying the first chunk there first."""
        chunks = [self.grad[key][slot][:n] for key, slot in srcs]
        return add_chunks(chunks, None if in_place else self.acc[worker][:n])


def add_chunks(chunks: list[torch.Tensor], out: torch.Tensor | None) -> torch.Tensor:
    """chunks[0] + chunks[1] + ... in their order, into `out` (the first addition writes it
    directly) or, with out None, into chunks[0]; R - 1 additions for R chunks."""
    first, second, *rest = chunks
    acc = first.add_(second) if out is None else torch.add(first, second, out=out)
    for c in rest:
        acc.add_(c)
    return acc
