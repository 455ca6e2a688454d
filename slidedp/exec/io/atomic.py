"""Atomic directory writes: build a directory under a temporary name next to its final place,
fsync every file, then rename it into place, so a crash mid-write never leaves a half-written
directory under the final name (the previous one, if any, stays intact until the rename).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from slidedp.spec.errors import SpecError

TMP_MARK = ".tmp-"  # temp dirs are named ".<final name>.tmp-<random>"


def fsync_dir(path: Path) -> None:
    """Make a rename or file creation inside `path` durable (POSIX: fsync the directory)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for dirpath, _, files in os.walk(root):
        for name in files:
            fd = os.open(Path(dirpath) / name, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


@contextmanager
def atomic_dir(final: Path | str, overwrite: bool = False) -> Iterator[Path]:
    """Yield an empty temp dir in `final`'s parent; on a clean exit rename it to `final`.

    On an exception the temp dir is removed and `final` is untouched. With `overwrite`, an existing
    `final` is moved aside, replaced, then deleted; without it an existing non-empty `final` is a
    SpecError (checked before anything is written).
    """
    final = Path(final)
    if final.exists() and (not final.is_dir() or any(final.iterdir())) and not overwrite:
        raise SpecError(
            str(final), "<directory>", "a new or empty directory (it already holds files)"
        )
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}{TMP_MARK}", dir=final.parent))
    try:
        yield tmp
        _fsync_tree(tmp)
        if final.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
            os.replace(final, old / final.name)
            os.replace(tmp, final)
            shutil.rmtree(old)
        else:
            os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
