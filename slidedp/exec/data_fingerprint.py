"""A fingerprint of the training data's contents, so that a resume on other data of the same shape
is refused.

The fingerprint is the BLAKE2b (512-bit) digest of the data file's bytes, the same digest as
`b2sum FILE`; for a directory (a dataset of several files) it hashes, in sorted order, each file's
relative path, size and bytes. Hashing reads the whole data once (about 1 GB/s on one core), so
the result is cached in the run directory (CACHE) under the data's key: its absolute path and each
file's size and modification time (ns). A file changed in place gets a new size or mtime, and so
a new hash. Data that is not a file (tokens produced in memory) is hashed from the token array.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

CACHE = "data-fingerprint.json"
BLOCK_BYTES = 8 << 20


def _files(path: Path) -> list[Path]:
    return [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())


def _key(path: Path) -> dict:
    files = _files(path)
    return {"path": str(path.resolve()),
            "files": [[str(f.relative_to(path)) if f != path else "", st.st_size, st.st_mtime_ns]
                      for f in files for st in [f.stat()]]}


def _hash_files(path: Path) -> str:
    h = hashlib.blake2b()
    files = _files(path)
    for f in files:
        if f != path:  # a directory's file: its name and size first
            h.update(str(f.relative_to(path)).encode() + b"\0" + f.stat().st_size.to_bytes(8, "little"))
        with open(f, "rb") as fh:
            while block := fh.read(BLOCK_BYTES):
                h.update(block)
    return h.hexdigest()


def _hash_tokens(tokens: np.ndarray) -> str:
    h = hashlib.blake2b()
    rows = max(1, BLOCK_BYTES // max(1, tokens[:1].nbytes))
    for lo in range(0, len(tokens), rows):
        h.update(np.ascontiguousarray(tokens[lo:lo + rows]).tobytes())
    return h.hexdigest()


def data_fingerprint(where: str, tokens: np.ndarray, cache_dir: Path | None) -> dict:
    """{"blake2b": hex digest, "where": what was hashed} of the data at `where` (a file or a
    directory; else the `tokens` array), cached in cache_dir/CACHE when given."""
    path = Path(where)
    if not path.exists():
        return {"blake2b": _hash_tokens(tokens), "where": f"tokens of {where}"}
    key = _key(path)
    cache = cache_dir / CACHE if cache_dir is not None else None
    if cache is not None and cache.is_file():
        try:
            rec = json.loads(cache.read_text())
            if rec.get("key") == key:
                return {"blake2b": rec["blake2b"], "where": key["path"]}
        except (OSError, ValueError, KeyError):
            pass
    digest = _hash_files(path)
    if cache is not None:
        tmp = cache.with_name(f".{CACHE}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps({"key": key, "blake2b": digest}))
        os.replace(tmp, cache)
    return {"blake2b": digest, "where": key["path"]}
