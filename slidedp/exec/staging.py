"""Bounded host buffers for the copy engines: the upload staging ring and the gradient rings.

    staging[i]      i < plan.staging_chunks: a CAST writes the chunk in the compute dtype, an H2D
                    reads it (the graph's CAST `buffer`)
    grad[w][i]      per update worker w, i < plan.d2h_staging_chunks: a D2H writes a gradient
                    chunk, ADAM reads it (the graph's D2H / ADAM `buffer`)
    scratch[w]      per update worker, an FP32 chunk to widen a BF16 gradient for Adam
                    (absent when the compute dtype is FP32)
Sizes come from the graph (the largest chunk it schedules). On a GPU the ring buffers are
page-locked with an exact-size cudaHostRegister (see host_state.py); `pinned_empty` serves the
activation offload buffers too.
"""

from __future__ import annotations

import torch

from slidedp.exec.host_state import cuda_host_register, cuda_host_unregister


class PinnedPool:
    """Host tensors allocated once; page-locked (exact size) when `pin` is true."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.pinned: list[torch.Tensor] = []

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(shape, dtype=dtype)
        if self.pin and t.numel():
            cuda_host_register(t)
            self.pinned.append(t)
        return t

    def close(self) -> None:
        for t in self.pinned:
            cuda_host_unregister(t)
        self.pinned.clear()


class HostRings:
    def __init__(
        self,
        pool: PinnedPool,
        dtype: torch.dtype,
        staging_chunks: int,
        staging_elems: int,
        workers: int,
        grad_chunks: int,
        grad_elems: int,
    ):
        self.staging = [pool.empty(staging_elems, dtype) for _ in range(staging_chunks)]
        self.grad = [
            [pool.empty(grad_elems, dtype) for _ in range(grad_chunks)] for _ in range(workers)
        ]
        self.scratch = (
            [torch.empty(grad_elems, dtype=torch.float32) for _ in range(workers)]
            if dtype != torch.float32
            else None
        )

    def grad_fp32(self, worker: int, slot: int, n: int) -> torch.Tensor:
        """The gradient chunk in ring slot `slot` of `worker`, as FP32 (a view when it already is)."""
        g = self.grad[worker][slot][:n]
        if self.scratch is None:
            return g
        return self.scratch[worker][:n].copy_(g)
