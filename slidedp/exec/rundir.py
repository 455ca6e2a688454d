"""The run directory (`slidedp train --out DIR`) as a unit: one run at a time, its options on disk,
and the checks that it can hold what the run will write, made before anything large exists.

DIR/.lock         held (flock, exclusive) by the process that started the run: `slidedp train`
                  itself, or with --nproc R its launcher, for as long as it lives. The kernel drops
                  a flock when its holder dies however it dies, so a lock left by a dead process is
                  free for the next run: nothing stale to clean up. The file records the holder
                  (pid, command line) for the refusal's message.
DIR/.lock.rank-R  held by rank process R of a --nproc run while it lives: a launcher killed with
                  SIGKILL frees .lock at once while its ranks take a moment to notice and stop
                  (exec/dist/session.py); a new run waits for none of them, it is refused while
                  any rank lock is held (free ones, left by ended ranks, it removes).
DIR/config.toml   the resolved options (commands/train.py writes it; `--resume` reads it back).

A second run on a held DIR is refused (SpecError: one line, exit 2) naming the holder.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from pathlib import Path

from slidedp.spec.errors import InfeasiblePlan, SpecError

LOCK = ".lock"
RANK_LOCK = ".lock.rank-"
CONFIG = "config.toml"


class RunLock:
    """An exclusive flock on a file of the run directory, held until release() or this process
    ends. `acquire(out)` for the process that starts a run, `hold_rank(out, rank)` for a rank."""

    def __init__(self, path: Path, fd: int):
        self.path, self.fd = path, fd

    @classmethod
    def _take(cls, path: Path, option: str) -> RunLock | None:
        """The lock on `path` (created if missing), None if another process holds it."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise SpecError(str(path.parent), option, f"a writable directory ({e.strerror})") \
                from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None
        return cls(path, fd)

    def _record(self, **holder) -> None:
        data = json.dumps({"pid": os.getpid(), "argv": sys.argv, **holder}).encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    @classmethod
    def acquire(cls, out: Path) -> RunLock:
        """Take DIR/.lock for a new run or a resume; SpecError naming the holder if another run
        (or a rank process of an earlier one) holds DIR."""
        lock = cls._take(out / LOCK, "--out")
        if lock is None:
            raise SpecError(str(out), "--out", "a run directory no other run is using: held by "
                            f"{_holder(out / LOCK)} (wait for it to end, or choose another --out)")
        for rank_file in sorted(out.glob(f"{RANK_LOCK}*")):
            held = cls._take(rank_file, "--out")
            if held is None:
                lock.release()
                raise SpecError(str(out), "--out", "a run directory no other run is using: "
                                f"{_holder(rank_file)}, a rank process of an earlier run, still "
                                "holds it (it stops within seconds of its launcher's death)")
            held.release(unlink=True)
        lock._record()
        return lock

    @classmethod
    def hold_rank(cls, out: Path, rank: int) -> RunLock:
        """Take DIR/.lock.rank-R for rank process R (module docstring)."""
        lock = cls._take(out / f"{RANK_LOCK}{rank}", "--out")
        if lock is None:
            raise SpecError(str(out), "--out", f"a run directory whose rank {rank} lock is free: "
                            f"held by {_holder(out / f'{RANK_LOCK}{rank}')}")
        lock._record(rank=rank)
        return lock

    def release(self, unlink: bool = False) -> None:
        if self.fd < 0:
            return
        if unlink:
            self.path.unlink(missing_ok=True)
        os.close(self.fd)  # drops the flock
        self.fd = -1


def _holder(path: Path) -> str:
    """'pid P (command line)' from a lock file's record, as far as it can be read."""
    try:
        rec = json.loads(path.read_text())
        return f"pid {rec['pid']} ({' '.join(rec['argv'])[:160]})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def prepare_out(out: Path) -> bool:
    """Create the run directory (whether it was created); SpecError naming --out when it is a
    file or cannot be made."""
    if out.exists() and not out.is_dir():
        raise SpecError(str(out), "--out", "a directory, got a file")
    created = not out.exists()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise SpecError(str(out), "--out", f"a directory that can be created ({e.strerror})") \
            from None
    return created


def check_trace(path: Path) -> None:
    """That the Chrome trace can be written to `path` at the end of the run: its directory
    exists and a file can be created there (one that did not exist is removed again)."""
    if path.is_dir():
        raise SpecError(str(path), "--trace", "a file path, got a directory")
    existed = path.exists()
    try:
        with open(path, "a"):
            pass
    except OSError as e:
        raise SpecError(str(path), "--trace", f"a file that can be written ({e.strerror})") \
            from None
    if not existed:
        path.unlink()


def check_disk(out: Path, need_bytes: float, what: str) -> None:
    """InfeasiblePlan when the filesystem of `out` has less than `need_bytes` free."""
    st = os.statvfs(out)
    free = st.f_bavail * st.f_frsize
    if need_bytes > free:
        raise InfeasiblePlan(f"disk space in {out}", need_bytes, free, what)


def write_config(out: Path, text: str) -> Path:
    """DIR/config.toml, replaced atomically (a crash leaves the old one or the new one)."""
    path = out / CONFIG
    tmp = out / f".{CONFIG}.tmp-{os.getpid()}"
    tmp.write_text(text + "\n")
    os.replace(tmp, path)
    return path
