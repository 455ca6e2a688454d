"""Activation offload (plan.offload_ratio): part of what each layer keeps goes to host memory.

Ratio r of what layer l keeps (activations.py: its input included, never parameters, which live
in slots) goes to pinned host buffers after the task that produced it (ACT_OFFLOAD(l), on the
D2H stream: after the producer of its input when it keeps only that, else after FWD(l)) and
comes back into a reload buffer before RECOMPUTE(l) or BWD(l) (ACT_RELOAD(l), on the H2D stream).

The first round(r x total) bytes of a layer's entries, in keep order, go to host memory, the rest
stays on the device (OffloadedActivations):
    an entry wholly in that prefix   its storage is held until ACT_OFFLOAD copies it into
                                     host[l-1][b] (non-blocking, on the D2H stream, which the
                                     storage is record_stream()-ed on), then dropped
    an entry wholly after it         the storage itself stays (a reference, no copy)
    the one entry straddling it      its resident tail is copied into tail[l-1][b] when kept (on
                                     the compute stream), its head goes as an offloaded entry
ACT_RELOAD copies host[l-1] into GPU reload buffer l mod reload_ahead_layers (the graph's
ACT_RELOAD `buffer`); `tensor` rebuilds a kept tensor from its resident and reloaded parts. Host
parts of entries start at multiples of ALIGN bytes, so a wholly offloaded entry is used in place
in the reload buffer; the straddling one is joined with its tail (a copy, during backward).

Copies: the copies per layer and micro-batch are exactly the offloaded bytes (D2H into host, H2D
into reload) plus, at most once, the straddling entry's resident tail and its join: copying that
tail lets the entry's whole storage be freed after ACT_OFFLOAD, so the device holds (1 - r) of the
kept bytes and no more. The buffers that receive copies (host, reload, tail) are reserved at
construction from the layout: the device memory for kept activations is bounded by the layout
(resident parts + reload_ahead_layers reload buffers + one tail per layer and micro-batch) and
does not depend on allocator reuse across steps.
"""

from __future__ import annotations

import torch

from slidedp.exec.activations import KeptActivations
from slidedp.exec.features.base import Feature, Kernel
from slidedp.exec.kernels import Context, StepData
from slidedp.exec.staging import PinnedPool
from slidedp.graph.tasks import Kind

ALIGN = 64  # bytes: start of each entry's part in the host and reload buffers


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class OffloadedActivations(KeptActivations):
    """KeptActivations whose entries' first `offload_ratio` of bytes per layer go to host memory
    (module docstring)."""

    def __init__(self, layouts: list[tuple[int, ...]], accum: int, offload_ratio: float,
                 reload_ahead: int, device: torch.device, pool: PinnedPool):
        self.reload_ahead = reload_ahead
        self.cuda = device.type == "cuda"
        self.split: list[list[tuple[int, int]]] = []  # per layer, per entry: (offloaded, at)
        host_width, tail_width = [], []
        for sizes in layouts:
            left, at, split, tail = round(offload_ratio * sum(sizes)), 0, [], 0
            for n in sizes:
                off = min(n, left)
                split.append((off, at))
                left, at = left - off, at + _align(off)
                if 0 < off < n:
                    tail = n - off
            self.split.append(split)
            host_width.append(at)
            tail_width.append(tail)
        self.host = [pool.empty((accum, w), torch.uint8) for w in host_width]
        # one tensor per reload buffer (a write into one does not bump the version counter of
        # tensors autograd saved from another), flat and viewed (accum, layer's width) per
        # layer: the reload copy is then contiguous on both sides (a narrower column slice of a
        # wider 2-D buffer would make CUDA copy through a temporary allocated per step)
        self.reload = [torch.empty(accum * max(host_width, default=0), dtype=torch.uint8,
                                   device=device) for _ in range(reload_ahead)]
        self.tail = [torch.empty(accum, w, dtype=torch.uint8, device=device) for w in tail_width]
        super().__init__(layouts, accum)

    def reset(self) -> None:
        super().reset()
        self._pending: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}

    def offload_bytes(self, layer: int) -> int:
        """Bytes ACT_OFFLOAD moves per micro-batch for layer `layer`."""
        return sum(off for off, _ in self.split[layer - 1])

    def _keep(self, layer: int, b: int, k: int, flat: torch.Tensor) -> None:
        off, _ = self.split[layer - 1][k]
        if off == 0:
            super()._keep(layer, b, k, flat)
            return
        key = (layer, b)
        resident = self._resident.setdefault(key, [])
        if off < flat.numel():
            self.tail[layer - 1][b].copy_(flat[off:])
        resident.append(self.tail[layer - 1][b] if off < flat.numel() else None)
        self._pending.setdefault(key, []).append((k, flat))

    def offload(self, layer: int) -> None:
        """ACT_OFFLOAD: the offloaded parts of every micro-batch's entries to host memory."""
        for b in range(self.accum):
            for k, flat in self._pending.pop((layer, b), []):
                off, at = self.split[layer - 1][k]
                if self.cuda:
                    flat.record_stream(torch.cuda.current_stream())
                self.host[layer - 1][b, at:at + off].copy_(flat[:off], non_blocking=True)

    def reload_layer(self, layer: int) -> None:
        """ACT_RELOAD: layer `layer`'s host parts into its reload buffer."""
        self._reload_view(layer).copy_(self.host[layer - 1], non_blocking=True)

    def _reload_view(self, layer: int) -> torch.Tensor:
        """Layer `layer`'s reload buffer, (accum, its host width), contiguous."""
        w = self.host[layer - 1].shape[1]
        return self.reload[layer % self.reload_ahead][:self.accum * w].view(self.accum, w)

    def _part(self, layer: int, b: int, k: int) -> torch.Tensor:
        off, at = self.split[layer - 1][k]
        resident = self._resident[(layer, b)][k]
        if off == 0:
            return resident
        flat = self._reload_view(layer)[b, at:at + off]
        return flat if resident is None else torch.cat([flat, resident])


class ActivationOffload(Feature):
    """Keeps the layers' activations in an OffloadedActivations; runs ACT_OFFLOAD, ACT_RELOAD."""

    name = "offload"

    @staticmethod
    def enabled(k: Context) -> bool:
        return k.plan.offload_ratio > 0

    def __init__(self, k: Context):
        super().__init__(k)
        acts = k.bufs.acts
        k.bufs.acts = k.layer_runner.acts = OffloadedActivations(
            acts.layouts, acts.accum, k.plan.offload_ratio, k.plan.reload_ahead_layers, k.device,
            k.bufs.pool)

    def kernels(self, table: list[Kernel | None]) -> dict[int, Kernel]:
        out: dict[int, Kernel] = dict.fromkeys(self.local_tasks(Kind.ACT_OFFLOAD), self.offload)
        out.update(dict.fromkeys(self.local_tasks(Kind.ACT_RELOAD), self.reload))
        return out

    def offload(self, d: StepData, v: int) -> None:
        self.k.bufs.acts.offload(int(self.k.tpl.g.unit[v]))

    def reload(self, d: StepData, v: int) -> None:
        self.k.bufs.acts.reload_layer(int(self.k.tpl.g.unit[v]))
