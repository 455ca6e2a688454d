"""SIGINT and SIGTERM as requests to stop: a run saves at the next step boundary and says how to go
on, instead of dying mid-step with tracebacks.

`StopSignals(mode)` installs handlers for both signals (main thread only; the previous ones come
back with restore()). Each signal also writes its number to a pipe (signal.set_wakeup_fd), so a
thread sees it even while the main thread is blocked in C code (a collective) and runs no Python
handler.
  mode "raise"  (one process: `slidedp train --nproc 1`) the handler acts in the main thread:
                outside deferring() a signal raises Stopped at once, as KeyboardInterrupt would
                (the run unwinds, its host state is closed; nothing to save before training);
                inside deferring() (the training loop) the first signal is only recorded in
                `first` and the trainer stops at the next step boundary; a second one raises
                Stopped(second=True): stop now, unsaved.
  mode "watch"  (a rank process) the handler does nothing: the session's watchdog thread reads
                the pipe with poll() and decides (exec/dist/session.py).
A stopped run exits 128 + the signal's number (130 for SIGINT, 143 for SIGTERM).
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
MODES = ("raise", "watch")
_active: set[StopSignals] = set()  # installed now, in this process


def _defaults_in_child() -> None:
    """A child forked without exec is not the run: default stop signals, no wakeup pipe (it
    would write into the parent's)."""
    if not _active:
        return
    _active.clear()
    try:
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the main one: nothing was inherited
        pass


os.register_at_fork(after_in_child=_defaults_in_child)


class Stopped(BaseException):  # noqa: N818 - a BaseException like KeyboardInterrupt, not an error
    """A stop signal ended the run (a BaseException: no `except Exception` swallows it)."""

    def __init__(self, signum: int, second: bool = False):
        self.signum, self.second = signum, second
        super().__init__(f"{signal.Signals(signum).name}{' (second)' if second else ''}")

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


class StopSignals:
    """Handlers for SIGINT and SIGTERM (module docstring); a context manager that restores the
    previous handlers. Created in the main thread."""

    def __init__(self, mode: str = "raise"):
        if mode not in MODES:
            raise ValueError(f"StopSignals: mode one of {MODES}, got {mode!r}")
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("StopSignals: signal handlers are set from the main thread")
        self.mode = mode
        self.first: int | None = None  # the first stop signal's number
        self.count = 0
        self._deferring = False
        self._r, self._w = os.pipe()
        for fd in (self._r, self._w):
            os.set_blocking(fd, False)
            os.set_inheritable(fd, False)
        self._old_fd = signal.set_wakeup_fd(self._w)
        self._old = {s: signal.signal(s, self._handler) for s in STOP_SIGNALS}
        _active.add(self)

    def _handler(self, signum: int, frame) -> None:
        if self.mode != "raise":
            return  # the watchdog reads the pipe
        self._note(signum)
        if not self._deferring or self.count > 1:
            raise Stopped(signum, second=self.count > 1)

    def _note(self, signum: int) -> None:
        self.count += 1
        if self.first is None:
            self.first = signum

    def poll(self) -> list[int]:
        """The stop signals received since the last poll (mode "watch"), counted in `first` and
        `count` as well."""
        try:
            raw = os.read(self._r, 256)
        except BlockingIOError:
            return []
        got = [s for s in raw if s in STOP_SIGNALS]
        for s in got:
            self._note(s)
        return got

    @contextmanager
    def deferring(self) -> Iterator[None]:
        """Within: a first signal is recorded, not raised (mode "raise")."""
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False

    def restore(self) -> None:
        """The previous handlers and wakeup fd back."""
        if self._r < 0:
            return
        for s, old in self._old.items():
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        signal.set_wakeup_fd(self._old_fd)
        _active.discard(self)
        os.close(self._r)
        os.close(self._w)
        self._r = self._w = -1

    def __enter__(self) -> StopSignals:
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
