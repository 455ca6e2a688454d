"""DistSession: this rank process's part in a single-host job, and what the ranks share.

Started in every process torchrun launched (RANK, WORLD_SIZE, LOCAL_RANK in the environment):
  process groups  the default group is NCCL on GPUs (gloo on the CPU) and carries the graph's
                  collectives; `ctl`, a gloo group (the default one on the CPU), carries the
                  host-side exchanges: names, barriers and the step-end sums.
  shared memory   `shared_tensor(tag, ...)` and `host_state(...)`: local rank 0 creates the file
                  in /dev/shm, every rank maps it after a barrier, and local rank 0 unlinks it
                  after a second barrier. The memory lives as long as some process maps it, and
                  nothing is left in /dev/shm whatever later happens to the processes.
  status block    shared: per rank its state (running / failed / exited), its pid and a message.
                  fail() writes this rank's; peer_failure() reads the others'.
  watchdog        a thread that every WATCHDOG_S marks a peer whose process is gone (or a
                  zombie) as failed, and on any peer failure prints
                      slidedp rank R: stopping: rank Q failed: <cause>
                  and leaves with os._exit(EXIT_PEER): a thread blocked in a collective cannot be
                  interrupted otherwise. A rank that failed itself is forced out after
                  FAIL_GRACE_S if its own teardown hangs.
  SIGTERM         torchrun terminates the survivors as soon as its monitor sees a rank gone,
                  which can be before their watchdogs have looked (a peer killed just before the
                  monitor's poll: 1 run in ~50 of the CPU fault test). So the session (created in
                  the main thread) defers SIGTERM (_DeferredTerm) to the watchdog, which waits up
                  to PEER_GRACE_S for a peer's failure to show and stops naming it; with none
                  (this rank alone was signalled: a user's kill, a preemption), this rank marks
                  itself failed ("terminated by SIGTERM"), so its peers name it, and leaves. A rank
                  already failing leaves at once.
Blame: an error in this rank (the engine's tasks, or one leaving the `with` block) waits up to
PEER_GRACE_S for a peer's failure to show (settled_peer_failure) before this rank takes the blame:
a peer killed by a signal breaks this rank's collectives before /proc shows it gone.
Timeouts: init_process_group and every collective use `timeout_s` (NCCL tears the process down
on a timeout: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless set); the engine's cross-process waits give
up after timeout_s as well. Used as a context manager, an exception leaving the block marks this
rank failed, prints the cause and exits the process (EXIT_FAILED; EXIT_PEER when a peer's failure
was the cause). Single host only: WORLD_SIZE must equal LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
import uuid
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from slidedp.exec.host_state import SHM_DIR, HostState, map_shared

RUNNING, FAILED, EXITED = 0, 1, 2
MSG_BYTES = 512
WATCHDOG_S = 0.1
FAIL_GRACE_S = 10.0
PEER_GRACE_S = 1.0  # an error waits this long for a peer's failure to show before taking the blame
EXIT_FAILED, EXIT_PEER = 1, 3


class PeerFailure(RuntimeError):
    """Another rank failed or died; the message names it and its cause."""


def _process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


class _DeferredTerm:
    """SIGTERM caught, not obeyed at once: the Python handler sets a flag and the C-level one writes
    the signal number to a pipe (signal.set_wakeup_fd: seen even while the main thread is blocked
    in a collective and cannot run Python handlers); the watchdog reads both. A forked child gets
    the default SIGTERM back and no wakeup fd (it is not a rank)."""

    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        self._flag = threading.Event()
        self._old_fd = signal.set_wakeup_fd(self._w)
        self._old_handler = signal.signal(signal.SIGTERM, lambda signum, frame: self._flag.set())
        os.register_at_fork(after_in_child=_default_term_in_child)

    def received(self) -> bool:
        try:
            if signal.SIGTERM in os.read(self._r, 256):
                self._flag.set()
        except BlockingIOError:
            pass
        return self._flag.is_set()

    def restore(self) -> None:
        """The previous handler and wakeup fd back; a SIGTERM that came after the watchdog's
        last look is raised again, now to the previous handler."""
        pending = self.received()
        signal.signal(signal.SIGTERM, self._old_handler if self._old_handler is not None
                      else signal.SIG_DFL)
        signal.set_wakeup_fd(self._old_fd)
        os.close(self._r)
        os.close(self._w)
        if pending:
            signal.raise_signal(signal.SIGTERM)


def _default_term_in_child() -> None:
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.set_wakeup_fd(-1)
    except ValueError:  # forked from a thread other than the main one: nothing was inherited
        pass


class DistSession:
    def __init__(self, device: str = "cuda", timeout_s: float = 300.0,
                 num_threads: int | None = None):
        env = os.environ
        try:
            self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
            self.local_rank = int(env["LOCAL_RANK"])
        except KeyError as e:
            raise RuntimeError(f"DistSession: {e.args[0]} is not set: start the job with torchrun "
                               "(slidedp.exec.dist.launch)") from None
        if int(env.get("LOCAL_WORLD_SIZE", self.world_size)) != self.world_size:
            raise RuntimeError("DistSession: one host only (WORLD_SIZE != LOCAL_WORLD_SIZE)")
        self.timeout_s, self.num_threads = timeout_s, num_threads
        timeout = timedelta(seconds=timeout_s)
        if torch.device(device).type == "cuda":
            env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", timeout=timeout, device_id=self.device)
            self.ctl = dist.new_group(backend="gloo", timeout=timeout)
        else:
            self.device = torch.device("cpu")
            dist.init_process_group("gloo", timeout=timeout)
            self.ctl = dist.group.WORLD
        name = [f"slidedp-{os.getpid()}-{uuid.uuid4().hex[:8]}" if self.rank == 0 else None]
        dist.broadcast_object_list(name, src=0, group=self.ctl)
        self.name: str = name[0]
        self._n_shared = 0
        R = self.world_size
        self._status = self.shared_tensor("status", 2 * R, torch.int64).numpy()  # states, pids
        self._msg = self.shared_tensor("msg", R * MSG_BYTES, torch.uint8).numpy()
        self._status[R + self.rank] = os.getpid()
        self.barrier()
        self._failed_at: float | None = None
        self._stop = threading.Event()
        self._term = _DeferredTerm() if threading.current_thread() is threading.main_thread() else None
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="slidedp-watchdog")
        self._watchdog.start()

    # ---- shared memory -------------------------------------------------------------------------

    def shared_tensor(self, tag: str, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor in memory every local rank maps (collective: same order on all)."""
        self._n_shared += 1
        path = SHM_DIR / f"{self.name}.{tag}{self._n_shared}"
        t = map_shared(path, numel, dtype) if self.local_rank == 0 else None
        self.barrier()
        if t is None:
            t = map_shared(path, numel, dtype)
        self.barrier()
        if self.local_rank == 0:
            path.unlink()
        return t

    def host_state(self, unit_numels: list[int], copy_dtype: torch.dtype | None = None,
                   init: Callable[[HostState], None] | None = None) -> HostState:
        """The one host state: local rank 0 creates it and runs init(state) (random weights, a
        checkpoint) before the others attach; collective. init must end within timeout_s."""
        hs = None
        if self.local_rank == 0:
            hs = HostState.create(unit_numels, copy_dtype, name=f"{self.name}.state")
            if init is not None:
                init(hs)
        self.barrier()
        if hs is None:
            hs = HostState.attach(f"{self.name}.state")
        self.barrier()
        if hs.owner:
            hs.unlink()
        return hs

    # ---- host-side collectives (gloo) ----------------------------------------------------------

    def barrier(self) -> None:
        dist.barrier(group=self.ctl)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.ctl)
        return t.tolist()

    # ---- failures ------------------------------------------------------------------------------

    def fail(self, message: str) -> None:
        """Mark this rank failed (first cause wins): every peer's watchdog stops its process."""
        if self._status[self.rank] != RUNNING:
            return
        self._write_msg(self.rank, message)
        self._status[self.rank] = FAILED
        self._failed_at = time.monotonic()

    def peer_failure(self) -> str | None:
        """'rank Q failed: <cause>' for the first peer marked failed, else None (cheap: polled)."""
        for q in range(self.world_size):
            if q != self.rank and self._status[q] == FAILED:
                return f"rank {q} failed: {self._read_msg(q)}"
        return None

    def settled_peer_failure(self, grace_s: float = PEER_GRACE_S) -> str | None:
        """peer_failure(), waiting up to grace_s for one to show, marking dead peers meanwhile:
        a peer killed by a signal closes its sockets (the error this rank is reporting) before its
        process is gone from /proc, so without the wait this rank would blame itself."""
        deadline = time.monotonic() + grace_s
        while True:
            self.mark_dead_peers()
            peer = self.peer_failure()
            if peer is not None or time.monotonic() >= deadline:
                return peer
            time.sleep(WATCHDOG_S / 5)

    def mark_dead_peers(self) -> None:
        """Mark failed every running peer whose process is gone (killed, os._exit)."""
        R = self.world_size
        for q in range(R):
            pid = int(self._status[R + q])
            if q != self.rank and self._status[q] == RUNNING and pid and _process_gone(pid):
                self._write_msg(q, f"its process (pid {pid}) died without a report "
                                   "(killed by a signal or exited)")
                self._status[q] = FAILED

    def _read_msg(self, q: int) -> str:
        raw = bytes(self._msg[q * MSG_BYTES:(q + 1) * MSG_BYTES]).rstrip(b"\0")
        return raw.decode(errors="replace")

    def _write_msg(self, q: int, message: str) -> None:
        raw = message.encode()[:MSG_BYTES]
        block = self._msg[q * MSG_BYTES:(q + 1) * MSG_BYTES]
        block[:] = 0
        block[:len(raw)] = list(raw)

    def _watch(self) -> None:
        try:
            while not self._stop.wait(WATCHDOG_S):
                self._look()
        except BaseException as e:  # noqa: BLE001 - a dead watchdog would leave SIGTERM unheard
            self._exit(EXIT_FAILED, f"failed: the watchdog raised {type(e).__name__}: {e}")

    def _look(self) -> None:
        """One watchdog round (module docstring: watchdog, SIGTERM)."""
        term = self._term is not None and self._term.received()
        if self._failed_at is not None:  # this rank is the cause: only bound its teardown
            if term or time.monotonic() - self._failed_at > FAIL_GRACE_S:
                self._exit(EXIT_FAILED, f"failed: {self._read_msg(self.rank)} ("
                           + ("terminated while tearing down)" if term else
                              f"teardown still running after {FAIL_GRACE_S} s)"))
            return
        if term:  # the peer that made torchrun stop us, or this rank was the one signalled
            peer = self.settled_peer_failure()
            if peer is not None and self._failed_at is None:
                self._exit(EXIT_PEER, f"stopping: {peer}")
            self.fail("terminated by SIGTERM")
            self._exit(EXIT_FAILED, f"failed: {self._read_msg(self.rank)}")
        self.mark_dead_peers()
        peer = self.peer_failure()
        if peer is not None:
            self._exit(EXIT_PEER, f"stopping: {peer}")

    def _exit(self, code: int, message: str) -> None:
        """Report and leave now, whatever happens to the report; a rank stopping for a peer is
        marked exited (not failed) unless it has failed itself meanwhile."""
        try:
            if code == EXIT_PEER and self._status[self.rank] == RUNNING:
                self._status[self.rank] = EXITED
            print(f"slidedp rank {self.rank}: {message}", file=sys.stderr, flush=True)
            sys.stdout.flush()
        finally:
            os._exit(code)

    # ---- lifetime ------------------------------------------------------------------------------

    def close(self) -> None:
        """Normal end: every rank gets here before any tears its groups down (a barrier, with
        the watchdog still on: a peer that dies instead stops this rank), then peers no longer
        watch this rank and the process groups are destroyed."""
        self.barrier()
        self._status[self.rank] = EXITED
        self._stop.set()
        self._watchdog.join()
        if self._term is not None:
            self._term.restore()
        dist.destroy_process_group()

    def __enter__(self) -> DistSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.close()
            return False
        if self._failed_at is None:  # not marked yet (the engine marks its own task failures)
            peer = None if isinstance(exc, PeerFailure) else self.settled_peer_failure()
            if isinstance(exc, PeerFailure) or peer is not None:
                self._exit(EXIT_PEER, f"stopping: {exc if isinstance(exc, PeerFailure) else peer}")
            self.fail(f"{exc_type.__name__}: {exc}")
        traceback.print_exception(exc)
        self._exit(EXIT_FAILED, f"failed: {self._read_msg(self.rank)}")
        return False


def leave_rank(code: int) -> NoReturn:
    """The end of a rank process whose work is done and whose session is closed: it leaves
    without the interpreter's finalization, as the session's failure exits do. Finalization can
    abort a rank ("terminate called without an active exception") after every file was written
    (about one tiny CPU validation in 25), and its launcher would report a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
