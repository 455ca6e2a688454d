"""What each decoder layer keeps from its forward to its backward, and its offload to host memory.

A layer's activation policy (slidedp.spec.segments; policy_runner.py runs it) keeps, per
micro-batch b, a list of entries: whole tensor storages, the layer input x first, then, in the
order the forward meets them, every tensor autograd saves in the pieces it does not recompute and
the values its recompute starts from (one entry per storage however many views of it are saved;
parameters, which live in the window's slots, and the step's RoPE tables are never entries). The
entry sizes of a layer are the same every step and every micro-batch: its layout, found once at
construction (policy_runner.kept_layout), so every buffer below is reserved then.

Offload with ratio r = plan.offload_ratio: the first round(r x total) bytes of a layer's entries,
in keep order, go to host memory, the rest stays on the device:
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

Copies, decided: a resident entry is a reference to the storage the forward produced (nothing is
copied at r = 0). The copies per layer and micro-batch are exactly the offloaded bytes (D2H into
host, H2D into reload) plus, at most once, the straddling entry's resident tail and its join:
copying that tail lets the entry's whole storage be freed after ACT_OFFLOAD, so the device holds
(1 - r) of the kept bytes and no more. The buffers that receive copies (host, reload, tail) are
reserved at construction from the layout: the device memory for kept activations is bounded by
the layout (resident parts + reload_ahead_layers reload buffers + one tail per layer and
micro-batch) and does
not depend on allocator reuse across steps; resident references need no reservation (they are
the forward's own tensors, released by `release` after the layer's backward).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from slidedp.exec.staging import PinnedPool

ALIGN = 64  # bytes: start of each entry's part in the host and reload buffers


class Kept(NamedTuple):  # a NamedTuple: one is made per saved tensor per layer and micro-batch
    """A kept tensor: entry k of layer `layer`, micro-batch b, seen as (dtype, size, stride,
    storage offset in elements)."""

    layer: int
    b: int
    k: int
    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage of `t` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def _align(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class KeptActivations:
    """layouts[l-1]: the entry sizes in bytes of decoder layer l (module docstring)."""

    def __init__(self, layouts: list[tuple[int, ...]], accum: int, offload_ratio: float,
                 reload_ahead: int, device: torch.device, pool: PinnedPool):
        self.layouts, self.accum, self.reload_ahead = layouts, accum, reload_ahead
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
        self.reset()

    def reset(self) -> None:
        """Forget every kept entry (at each step's start: a failed step leaves its own behind)."""
        self._index: dict[tuple[int, int], dict[int, int]] = {}  # storage pointer -> entry
        self._resident: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._pending: dict[tuple[int, int], list[tuple[int, torch.Tensor]]] = {}
        self._first: dict[tuple[int, int], Kept] = {}
        self._cache: dict[tuple[int, int, int], torch.Tensor] = {}

    def offload_bytes(self, layer: int) -> int:
        """Bytes ACT_OFFLOAD moves per micro-batch for layer `layer`."""
        return sum(off for off, _ in self.split[layer - 1])

    def add(self, layer: int, b: int, t: torch.Tensor) -> Kept:
        """Keep `t` (its storage, unless already kept) for layer `layer`'s backward."""
        key = (layer, b)
        index = self._index.setdefault(key, {})
        ptr = t.untyped_storage().data_ptr()
        k = index.get(ptr)
        if k is None:
            k, sizes, flat = len(index), self.layouts[layer - 1], storage_bytes(t)
            if k >= len(sizes) or flat.numel() != sizes[k]:
                raise RuntimeError(f"layer {layer} keeps a {flat.numel()}-byte entry {k}, not its "
                                   f"layout {sizes} found at construction")
            index[ptr] = k
            off, _ = self.split[layer - 1][k]
            resident = self._resident.setdefault(key, [])
            if off == 0:
                resident.append(flat)
            else:
                if off < flat.numel():
                    self.tail[layer - 1][b].copy_(flat[off:])
                resident.append(self.tail[layer - 1][b] if off < flat.numel() else None)
                self._pending.setdefault(key, []).append((k, flat))
        h = Kept(layer, b, k, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        self._first.setdefault(key, h)
        return h

    def input(self, layer: int, b: int) -> torch.Tensor:
        """The first tensor kept for (layer, b): the layer input x."""
        return self.tensor(self._first[(layer, b)])

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

    def tensor(self, h: Kept) -> torch.Tensor:
        flat = self._entry(h.layer, h.b, h.k).view(h.dtype)
        return flat.as_strided(h.size, h.stride, flat.storage_offset() + h.offset)

    def _entry(self, layer: int, b: int, k: int) -> torch.Tensor:
        key = (layer, b, k)
        if key not in self._cache:
            off, at = self.split[layer - 1][k]
            resident = self._resident[(layer, b)][k]
            if off == 0:
                flat = resident
            else:
                flat = self._reload_view(layer)[b, at:at + off]
                if resident is not None:
                    flat = torch.cat([flat, resident])
            self._cache[key] = flat
        return self._cache[key]

    def kept_bytes(self, layer: int, b: int) -> int:
        """Bytes of the entries kept so far for (layer, b)."""
        return sum(self.layouts[layer - 1][:len(self._index.get((layer, b), ()))])

    def release(self, layer: int, b: int) -> None:
        """After (layer, b)'s backward: drop what it kept."""
        key = (layer, b)
        for k in self._index.pop(key, {}).values():
            self._cache.pop((layer, b, k), None)
        self._resident.pop(key, None)
        self._first.pop(key, None)
