"""Gradient chunks downloaded in the compute dtype and widened by the update (plan.grad_widen).

Where the graph downloads gradients narrower than FP32 (meta.grad_wire_bytes: plan.grad_widen =
host, except on the cpu gradient route with several ranks, whose HOST_SUM adds in FP32), the
gradient rings hold the compute dtype, and ADAM widens each chunk block by block in cache
(adamw.adamw_chunk). A D2H then downloads the chunk as it is; on the GPU it still widens it into
d2h_fp32 for the norm (the host makes one pass over the gradient, Adam's). A masked chunk (part of
it zeroed on the GPU first) is narrowed again into d2h_narrow and downloaded from there: exact,
as the widening was.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from slidedp.exec import kernels
from slidedp.exec.buffers import BufferSpec
from slidedp.exec.features.base import Feature
from slidedp.exec.kernels import Context
from slidedp.spec.elements import FP32_BYTES


class WidenOnHost(Feature):
    name = "grad_widen"

    @staticmethod
    def enabled(k: Context) -> bool:
        return k.tpl.g.meta.grad_wire_bytes != FP32_BYTES and k.dtype != torch.float32

    @staticmethod
    def configure(spec: BufferSpec, k: Context) -> None:
        spec.grad_dtype = k.dtype

    def __init__(self, k: Context):
        super().__init__(k)
        k.download = download_narrow


def download_narrow(k: Context, v: int, src: torch.Tensor,
                    mask: Callable[[torch.Tensor], None] | None = None) -> None:
    """kernels.download into a ring chunk of the compute dtype (see the module docstring)."""
    dst = kernels.ring_chunk(k, v, len(src))
    wide = kernels.widened(k, v, src, dst, mask)
    if wide is None:
        return
    if mask is None:
        dst.copy_(src, non_blocking=True)
    else:
        dst.copy_(k.bufs.d2h_narrow[:len(src)].copy_(wide), non_blocking=True)
