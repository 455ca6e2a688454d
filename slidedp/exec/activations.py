"""What each decoder layer keeps from its forward to its backward.

A layer's activation policy (slidedp.spec.segments; policy_runner.py runs it) keeps, per
micro-batch b, a list of entries: whole tensor storages, the layer input x first, then, in the
order the forward meets them, every tensor autograd saves in the pieces it does not recompute and
the values its recompute starts from (one entry per storage however many views of it are saved;
parameters, which live in the window's slots, and the step's RoPE tables are never entries). The
entry sizes of a layer are the same every step and every micro-batch: its layout, found once at
construction (policy_runner.kept_layout), so that any buffer a store needs is reserved then.

KeptActivations holds each entry as a reference to the storage the forward produced (no copy),
released by `release` after the layer's backward; `tensor` rebuilds a kept tensor from its entry.
The activation offload (exec/features/offload.py) subclasses it: `_keep` decides how an entry is
held and `_part` what backward reads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch


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


class KeptActivations:
    """layouts[l-1]: the entry sizes in bytes of decoder layer l (module docstring)."""

    def __init__(self, layouts: list[tuple[int, ...]], accum: int):
        self.layouts, self.accum = layouts, accum
        self.reset()

    def reset(self) -> None:
        """Forget every kept entry (at each step's start: a failed step leaves its own behind)."""
        self._index: dict[tuple[int, int], dict[int, int]] = {}  # storage pointer -> entry
        self._resident: dict[tuple[int, int], list[torch.Tensor | None]] = {}
        self._first: dict[tuple[int, int], Kept] = {}
        self._cache: dict[tuple[int, int, int], torch.Tensor] = {}

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
            self._keep(layer, b, k, flat)
        h = Kept(layer, b, k, t.dtype, tuple(t.shape), t.stride(), t.storage_offset())
        self._first.setdefault(key, h)
        return h

    def _keep(self, layer: int, b: int, k: int, flat: torch.Tensor) -> None:
        """Hold entry k of (layer, b), whose storage is `flat`: a reference."""
        self._resident.setdefault((layer, b), []).append(flat)

    def input(self, layer: int, b: int) -> torch.Tensor:
        """The first tensor kept for (layer, b): the layer input x."""
        return self.tensor(self._first[(layer, b)])

    def tensor(self, h: Kept) -> torch.Tensor:
        flat = self._entry(h.layer, h.b, h.k).view(h.dtype)
        return flat.as_strided(h.size, h.stride, flat.storage_offset() + h.offset)

    def _entry(self, layer: int, b: int, k: int) -> torch.Tensor:
        key = (layer, b, k)
        if key not in self._cache:
            self._cache[key] = self._part(layer, b, k)
        return self._cache[key]

    def _part(self, layer: int, b: int, k: int) -> torch.Tensor:
        """Entry k of (layer, b) as backward reads it, flat bytes."""
        return self._resident[(layer, b)][k]

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
