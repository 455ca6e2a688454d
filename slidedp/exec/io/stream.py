"""Streaming safetensors writer: the header is planned from (name, dtype, shape) up front, then
tensors are written one at a time, in any order, straight to their byte range in the file.

safetensors' own `save_file` serializes the whole dict in memory first; for a model unit of a
billion parameters that is a second copy of gigabytes. Here the only extra memory is one chunk of
a dtype conversion (`CHUNK_ELEMS`). File format (safetensors spec): u64 little-endian header
length N, N bytes of JSON header {name: {dtype, shape, data_offsets: [begin, end]}}, padded with
spaces to a multiple of 8, then the tensor bytes in header order.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from pathlib import Path

import torch

ST_DTYPE = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}
CHUNK_ELEMS = 1 << 24  # elements converted at a time (64 MiB of FP32 input)


class SafetensorsWriter:
    """Write tensors of a planned header into `path`; `close()` checks all were written + fsyncs."""

    def __init__(
        self,
        path: Path | str,
        plan: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
        metadata: dict[str, str] | None = None,
    ):
        self.path = Path(path)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        self._slots: dict[str, tuple[torch.dtype, tuple[int, ...], int]] = {}
        off = 0
        for name, dtype, shape in plan:
            nbytes = dtype.itemsize * _numel(shape)
            header[name] = {
                "dtype": ST_DTYPE[dtype],
                "shape": list(shape),
                "data_offsets": [off, off + nbytes],
            }
            self._slots[name] = (dtype, tuple(shape), off)
            off += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._data_start = 8 + len(raw)
        self._todo = set(self._slots)
        self._f = open(self.path, "wb")  # noqa: SIM115 (closed in close())
        self._f.write(struct.pack("<Q", len(raw)) + raw)
        self._f.truncate(self._data_start + off)  # the full size up front

    def write(self, name: str, t: torch.Tensor) -> None:
        """Write tensor `name` (any float dtype and shape with the planned numel; cast to plan)."""
        dtype, shape, off = self._slots[name]
        if t.numel() != _numel(shape):
            raise ValueError(
                f"{self.path}: tensor {name}: {_numel(shape)} elements, got {t.numel()}"
            )
        flat = t.detach().reshape(-1)
        self._f.seek(self._data_start + off)
        for lo in range(0, flat.numel(), CHUNK_ELEMS):
            chunk = flat[lo : lo + CHUNK_ELEMS].to(device="cpu", dtype=dtype).contiguous()
            self._f.write(chunk.view(torch.uint8).numpy())
        self._todo.discard(name)

    def close(self) -> None:
        if self._todo:
            self._f.close()
            raise ValueError(f"{self.path}: tensors never written: {sorted(self._todo)[:5]}")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def __enter__(self) -> SafetensorsWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self._f.close()


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
