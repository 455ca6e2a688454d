"""DistSession: this rank process's part in a job of one or more nodes, and what the ranks share.

Started in every process torchrun launched (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE in the
environment). A node is one torchrun agent's ranks (GROUP_RANK: the node rank): every node runs
the same number of ranks (LOCAL_WORLD_SIZE; else the session refuses to start: SpecError), ranks
node * LOCAL_WORLD_SIZE + local rank (torchrun's order), and has its own host state in its own
shared memory. Below, "rank" is the global rank and "local rank" the rank within the node.
  process groups  the default group is NCCL on GPUs (gloo on the CPU); `node_group`, the ranks
                  of this node on the default backend (the default group itself with one node),
                  carries the graph's collectives; `ctl`, a gloo group of every rank (the default
                  one on the CPU), carries the host-side exchanges: names, barriers and the
                  step-end sums; `peer_group(local)` (several nodes) makes the gloo group of
                  local rank `local` of every node, which reduces host chunks across nodes.
  shared memory   `shared_tensor(tag, ...)` and `host_state(...)`: local rank 0 creates the file
                  in /dev/shm, every rank of its node maps it after a barrier, and local rank 0
                  unlinks it after a second barrier. The memory lives as long as some process
                  maps it. Every file of a node is named "<session name>.<tag>", the session name
                  being host_state.segment_name of the node's local rank 0 (its pid and start
                  time) and ".node<N>": one name per node, gathered from every node's local rank
                  0 (`node_names`). Every exit of a rank that is not the normal end
                  removes whatever of them is still in /dev/shm (a peer killed while local rank 0
                  fills the host state, the launcher gone, a stop); files of a job whose every
                  process was killed are reclaimed by the next run (host_state.reclaim_segments).
  status block    shared by the node: per local rank its state (running / failed / exited /
                  stopped), its pid and a message. fail() writes this rank's; peer_failure()
                  reads the others'.
  other nodes     (several nodes) the first failure or stop of any rank is also written to the
                  job's TCP store (torchrun's, at MASTER_ADDR:MASTER_PORT) as "rank Q failed:
                  <cause>"; every watchdog round reads it, and a rank of another node stops
                  naming it, exiting EXIT_NODE (non-zero: torchrun's agent would otherwise wait
                  for the failed node's agent at its exit barrier). A store that cannot be read
                  (node 0's agent, which holds it, gone) stops the rank as well.
  watchdog        a thread, started before anything else, that every WATCHDOG_S
                  - stops this rank when its launcher is gone: its parent (torchrun) changed or,
                    started by `slidedp train --nproc R` (launch.py), that process is gone
                    ("stopping: its launcher ... is gone"); PR_SET_PDEATHSIG (launch.py
                    watch_parent) covers the time before the session exists;
                  - marks a peer whose process is gone (or a zombie) as failed, and on any peer
                    failure prints
                        slidedp rank R: stopping: rank Q failed: <cause>
                    and leaves with os._exit(EXIT_PEER): a thread blocked in a collective cannot
                    be interrupted otherwise. A rank that failed itself is forced out after
                    FAIL_GRACE_S if its own teardown hangs.
  exit codes      the rank that failed exits EXIT_FAILED; a rank stopped by a peer's failure
                  exits EXIT_PEER = 0, so that torchrun's report ("Root Cause (first observed
                  failure)") names only failed ranks: with every rank exiting non-zero within
                  the same second torchrun named rank 0, a survivor. torchrun's own status stays
                  non-zero (the failed rank's), and with a launcher the failure's one line is
                  also in its report file (launch.py), printed last by the launcher.
  signals         SIGINT and SIGTERM (signals.py, mode "watch") are read by the watchdog, which
                  first waits up to PEER_GRACE_S for a peer's failure to show (torchrun
                  terminates the survivors as soon as its monitor sees a rank gone, which can be
                  before their watchdogs have looked) and stops naming it. Otherwise the signal
                  is the user's (a kill, Ctrl-C relayed by the launcher):
                  - `graceful_stop` off (the default): this rank fails ("terminated by SIGTERM"),
                    its peers name it;
                  - `graceful_stop` on (`slidedp train`): before begin_steps() the rank stops at
                    once (state stopped; nothing to save yet); afterwards the first signal is
                    recorded and agree_stop(), called by every rank at each step boundary, ends
                    the run there on every rank together (the trainer saves); a second signal
                    stops this rank at once, unsaved. A peer that stopped at once stops this
                    rank too.
Blame: an error in this rank (the engine's tasks, or one leaving the `with` block) waits up to
PEER_GRACE_S for a peer's failure to show (settled_peer_failure) before this rank takes the blame:
a peer killed by a signal breaks this rank's collectives before /proc shows it gone.
Timeouts: init_process_group and every collective use `timeout_s` (NCCL tears the process down
on a timeout: TORCH_NCCL_ASYNC_ERROR_HANDLING=1 unless set); the engine's cross-process waits give
up after timeout_s as well. Used as a context manager, an exception leaving the block marks this
rank failed, prints the cause and exits the process (EXIT_FAILED; EXIT_PEER when a peer's failure
was the cause); an expected failure (SpecError, InfeasiblePlan, RunError) prints its one line
only, anything else its traceback too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from slidedp.exec.dist.launch import launcher_gone, write_report
from slidedp.exec.host_state import SHM_DIR, HostState, map_shared, segment_name
from slidedp.exec.outcome import EXIT_FAILED, expected_failure
from slidedp.exec.signals import StopSignals, signal_name
from slidedp.spec.errors import SpecError

RUNNING, FAILED, EXITED, STOPPED = 0, 1, 2, 3
MSG_BYTES = 512
WATCHDOG_S = 0.1
FAIL_GRACE_S = 10.0
PEER_GRACE_S = 1.0  # an error waits this long for a peer's failure to show before taking the blame
EXIT_PEER = 0  # a rank stopped by a peer's failure (module docstring: exit codes)
EXIT_NODE = 3  # a rank stopped by the failure of a rank of another node (module docstring)
STORE_KEY = "slidedp/failure"  # in the job's TCP store: "<rank>\n<line>" of the first failure


class PeerFailure(RuntimeError):
    """Another rank failed or died; the message names it and its cause."""


def _process_gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


class DistSession:
    def __init__(self, device: str = "cuda", timeout_s: float = 300.0,
                 num_threads: int | None = None, graceful_stop: bool = False):
        env = os.environ
        try:
            self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
            self.local_rank = int(env["LOCAL_RANK"])
        except KeyError as e:
            raise RuntimeError(f"DistSession: {e.args[0]} is not set: start the job with torchrun "
                               "(slidedp.exec.dist.launch)") from None
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        self.node_rank = int(env.get("GROUP_RANK", 0))
        self.nodes = self.world_size // self.local_world_size
        self._store = None  # the job's TCP store, with several nodes (module docstring)
        self.timeout_s, self.num_threads = timeout_s, num_threads
        self.graceful_stop = graceful_stop
        self.name: str | None = None  # this node's, known once every node's is gathered
        self._status = self._msg = None
        self._failed_at: float | None = None
        self._in_steps = False  # begin_steps() called: a first signal waits for a step boundary
        self.stop_signal: int | None = None  # a stop request waiting for the next boundary
        self._ppid = os.getppid()
        self._closing = False
        self._stop = threading.Event()
        main = threading.current_thread() is threading.main_thread()
        self._signals = StopSignals("watch") if main else None
        self._watchdog = threading.Thread(target=self._watch, daemon=True, name="slidedp-watchdog")
        self._watchdog.start()
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
        self.node_names = self._gather_names()
        self.name = self.node_names[self.node_rank]
        self.node_group = self._node_groups(timeout)
        if self.nodes > 1:
            self._store = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                        is_master=False, timeout=timeout)
        self._n_shared = 0
        R = self.local_world_size
        status = self.shared_tensor("status", 2 * R, torch.int64).numpy()  # states, pids
        self._msg = self.shared_tensor("msg", R * MSG_BYTES, torch.uint8).numpy()
        status[R + self.local_rank] = os.getpid()
        self._status = status
        self.barrier()

    # ---- nodes ---------------------------------------------------------------------------------

    def _gather_names(self) -> list[str]:
        """Per node, its session name (module docstring: shared memory); SpecError when the nodes
        run different numbers of ranks."""
        mine = (self.node_rank, self.local_world_size,
                f"{segment_name()}.node{self.node_rank}" if self.local_rank == 0 else None)
        every: list = [None] * self.world_size
        dist.all_gather_object(every, mine, group=self.ctl)
        sizes = {}
        for node, size, _ in every:
            sizes.setdefault(node, size)
        if len(set(sizes.values())) > 1 or self.world_size % self.local_world_size:
            per_node = ", ".join(f"node {n}: {sizes[n]}" for n in sorted(sizes))
            raise SpecError("torchrun", "--nproc-per-node", "the same number of ranks on "
                            f"every node, got {per_node}")
        names = {node: name for node, _, name in every if name is not None}
        return [names[n] for n in range(self.nodes)]

    def _node_groups(self, timeout: timedelta):
        """This node's ranks as a group of the default backend (collective: every rank makes
        every node's group)."""
        if self.nodes == 1:
            return dist.group.WORLD
        mine = None
        for n in range(self.nodes):
            ranks = list(range(n * self.local_world_size, (n + 1) * self.local_world_size))
            group = dist.new_group(ranks, timeout=timeout)
            if n == self.node_rank:
                mine = group
        return mine

    def peer_group(self, local: int):
        """The gloo group of local rank `local` of every node (collective: every rank calls it,
        in the same order); None on a rank outside it."""
        ranks = [n * self.local_world_size + local for n in range(self.nodes)]
        group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=self.timeout_s))
        return group if self.rank in ranks else None

    def global_rank(self, local: int) -> int:
        return self.node_rank * self.local_world_size + local

    def _tell_nodes(self, line: str) -> None:
        """Record this rank's failure or stop for the other nodes (the first one wins)."""
        if self._store is None:
            return
        with contextlib.suppress(Exception):  # the store gone: the others see that themselves
            self._store.compare_set(STORE_KEY, "", f"{self.rank}\n{line}")

    def node_failure(self) -> str | None:
        """The failure of a rank of another node recorded in the store, or None."""
        if self._store is None or self._closing:
            return None
        try:
            if not self._store.check([STORE_KEY]):
                return None
            rank, _, line = self._store.get(STORE_KEY).decode(errors="replace").partition("\n")
        except Exception as e:  # noqa: BLE001 - any store error: the job's store is gone
            return (f"the job's store (torchrun's on node 0, {os.environ.get('MASTER_ADDR')}:"
                    f"{os.environ.get('MASTER_PORT')}) is gone ({type(e).__name__})")
        if int(rank) // self.local_world_size == self.node_rank:
            return None  # this node's own: its status block has it
        return line

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
                   init: Callable[[HostState], None] | None = None,
                   moments: str = "fp32") -> HostState:
        """The one host state: local rank 0 creates it and runs init(state) (random weights, a
        checkpoint) before the others attach; collective. init must end within timeout_s."""
        hs = None
        if self.local_rank == 0:
            hs = HostState.create(unit_numels, copy_dtype, name=f"{self.name}.state",
                                  moments=moments)
            if init is not None:
                init(hs)
        self.barrier()
        if hs is None:
            hs = HostState.attach(f"{self.name}.state")
        self.barrier()
        if hs.owner:
            hs.unlink()
        return hs

    def remove_files(self) -> None:
        """Unlink every file of this job still in /dev/shm (mappings stay valid)."""
        if self.name is not None:
            for path in SHM_DIR.glob(f"{self.name}.*"):
                path.unlink(missing_ok=True)

    # ---- host-side collectives (gloo) ----------------------------------------------------------

    def barrier(self) -> None:
        dist.barrier(group=self.ctl)

    def all_gather(self, obj) -> list:
        """Every rank's `obj`, in rank order (collective, over ctl)."""
        every: list = [None] * self.world_size
        dist.all_gather_object(every, obj, group=self.ctl)
        return every

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64)
        dist.all_reduce(t, group=self.ctl)
        return t.tolist()

    # ---- stop requests (graceful_stop) ---------------------------------------------------------

    def begin_steps(self) -> None:
        """From now on a first stop signal waits for agree_stop() at a step boundary."""
        self._in_steps = True

    def agree_stop(self, extra: list[float] = ()) -> tuple[int | None, list[float]]:
        """At a step boundary, on every rank (collective): the stop signal some rank has
        received (SIGINT if any rank got one, else SIGTERM), or None; and `extra` summed over the
        ranks (one all-reduce for both)."""
        mine = self.stop_signal
        got = self.all_reduce_sum([*extra, float(mine == signal.SIGINT),
                                   float(mine == signal.SIGTERM)])
        n_int, n_term = got[-2:]
        sig = signal.SIGINT if n_int else signal.SIGTERM if n_term else None
        return (None if sig is None else int(sig)), got[:-2]

    # ---- failures ------------------------------------------------------------------------------

    def fail(self, message: str, code: int = EXIT_FAILED) -> None:
        """Mark this rank failed (first cause wins): every peer's watchdog stops its process.
        `code`: the job's exit status in the launcher's report (2 for bad input)."""
        if self._status[self.local_rank] != RUNNING:
            return
        self._write_msg(self.local_rank, message)
        self._status[self.local_rank] = FAILED
        self._failed_at = time.monotonic()
        write_report(code, f"rank {self.rank} failed: {message}")
        self._tell_nodes(f"rank {self.rank} failed: {message}")

    def peer_failure(self) -> str | None:
        """'rank Q failed: <cause>' for the first peer of this node marked failed, else None
        (cheap: polled)."""
        for q in range(self.local_world_size):
            if q != self.local_rank and self._status[q] == FAILED:
                return f"rank {self.global_rank(q)} failed: {self._read_msg(q)}"
        return None

    def peer_stopped(self) -> str | None:
        """'rank Q stopped: <how>' for the first peer that stopped at once on a signal."""
        for q in range(self.local_world_size):
            if q != self.local_rank and self._status[q] == STOPPED:
                return f"rank {self.global_rank(q)} {self._read_msg(q)}"
        return None

    def settled_peer_failure(self, grace_s: float = PEER_GRACE_S) -> str | None:
        """peer_failure(), waiting up to grace_s for one to show, marking dead peers meanwhile:
        a peer killed by a signal closes its sockets (the error this rank is reporting) before its
        process is gone from /proc, so without the wait this rank would blame itself."""
        if self._status is None:
            return None
        deadline = time.monotonic() + grace_s
        while True:
            self.mark_dead_peers()
            peer = self.peer_failure() or self.node_failure()
            if peer is not None or time.monotonic() >= deadline:
                return peer
            time.sleep(WATCHDOG_S / 5)

    def mark_dead_peers(self) -> None:
        """Mark failed every running peer of this node whose process is gone (killed, os._exit)."""
        R = self.local_world_size
        for q in range(R):
            pid = int(self._status[R + q])
            if q != self.local_rank and self._status[q] == RUNNING and pid and _process_gone(pid):
                message = ("its process (pid {pid}) died without a report (killed by a signal "
                           "or exited)").format(pid=pid)
                self._write_msg(q, message)
                self._status[q] = FAILED
                write_report(EXIT_FAILED, f"rank {self.global_rank(q)} failed: {message}")
                self._tell_nodes(f"rank {self.global_rank(q)} failed: {message}")

    def _read_msg(self, q: int) -> str:
        raw = bytes(self._msg[q * MSG_BYTES:(q + 1) * MSG_BYTES]).rstrip(b"\0")
        return raw.decode(errors="replace")

    def _write_msg(self, q: int, message: str) -> None:
        raw = message.encode()[:MSG_BYTES]
        block = self._msg[q * MSG_BYTES:(q + 1) * MSG_BYTES]
        block[:] = 0
        block[:len(raw)] = list(raw)

    # ---- the watchdog --------------------------------------------------------------------------

    def _watch(self) -> None:
        try:
            while not self._stop.wait(WATCHDOG_S):
                self._look()
        except BaseException as e:  # noqa: BLE001 - a dead watchdog would leave signals unheard
            self._exit(EXIT_FAILED, f"failed: the watchdog raised {type(e).__name__}: {e}")

    def _look(self) -> None:
        """One watchdog round (module docstring: watchdog, signals)."""
        sigs = self._signals.poll() if self._signals is not None else []
        if self._failed_at is not None:  # this rank is the cause: only bound its teardown
            if sigs or time.monotonic() - self._failed_at > FAIL_GRACE_S:
                self._exit(EXIT_FAILED, f"failed: {self._read_msg(self.local_rank)} ("
                           + ("terminated while tearing down)" if sigs else
                              f"teardown still running after {FAIL_GRACE_S} s)"))
            return
        gone = launcher_gone(self._ppid)
        if gone is not None:
            self._exit(EXIT_FAILED, f"stopping: {gone}")
        if sigs:
            self._on_signals(sigs)
        if self._status is None:  # still starting: no peers to look at yet
            return
        self.mark_dead_peers()
        peer = self.peer_failure() or self.peer_stopped()
        if peer is not None:
            self._exit(EXIT_PEER, f"stopping: {peer}")
        remote = self.node_failure()
        if remote is not None:
            self._exit(EXIT_NODE, f"stopping: {remote}")

    def _on_signals(self, sigs: list[int]) -> None:
        """SIGINT / SIGTERM received (module docstring: signals)."""
        peer = self.settled_peer_failure()
        if peer is not None:  # torchrun stopping the survivors of a failed rank
            self._exit(self._peer_code(peer), f"stopping: {peer}")
        gone = launcher_gone(self._ppid)  # PR_SET_PDEATHSIG's SIGTERM: the launcher died
        if gone is not None:
            self._exit(EXIT_FAILED, f"stopping: {gone}")
        name = signal_name(sigs[-1])
        if not self.graceful_stop:
            if self._status is not None:
                self.fail(f"terminated by {name}")
            self._exit(EXIT_FAILED, f"failed: terminated by {name}")
        if self._in_steps and self._signals.count == 1:
            self.stop_signal = sigs[0]  # agree_stop() ends the run at the next boundary
            return
        how = ("stopped by a second " + name + ", unsaved") if self._in_steps \
            else f"stopped by {name} before training"
        if self._status is not None:
            self._write_msg(self.local_rank, how)
            self._status[self.local_rank] = STOPPED
        self._exit(128 + sigs[-1], how)

    def _peer_code(self, peer: str) -> int:
        """EXIT_PEER for a failure of this node (peer_failure's line), else EXIT_NODE."""
        local = self.peer_failure() or self.peer_stopped()
        return EXIT_PEER if local is not None and local == peer else EXIT_NODE

    def _exit(self, code: int, message: str) -> NoReturn:
        """Report and leave now, whatever happens to the report; removes the job's files still in
        /dev/shm; a rank stopping for a peer is marked exited (not failed) unless it has failed
        itself meanwhile."""
        try:
            self.remove_files()
            if code in (EXIT_PEER, EXIT_NODE):
                if self._status is not None and self._status[self.local_rank] == RUNNING:
                    self._status[self.local_rank] = EXITED
            elif self.nodes > 1 and self._failed_at is None:  # its own end: a launcher gone, a stop
                write_report(code, f"rank {self.rank} {message}")
                self._tell_nodes(f"rank {self.rank} {message}")
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
        self._closing = True  # node 0's agent, which holds the store, may end from now on
        self._status[self.local_rank] = EXITED
        self._stop.set()
        self._watchdog.join()
        if self._signals is not None:
            self._signals.restore()
        dist.destroy_process_group()

    def __enter__(self) -> DistSession:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc is None:
            self.close()
            return False
        if self._failed_at is None:  # not marked yet (the engine marks its own task failures)
            peer = str(exc) if isinstance(exc, PeerFailure) else self.settled_peer_failure()
            if peer is not None:
                self._exit(self._peer_code(peer), f"stopping: {peer}")
            self.fail(f"{exc_type.__name__}: {exc}", expected_failure(exc) or EXIT_FAILED)
        if expected_failure(exc) is None:
            traceback.print_exception(exc)
        self._exit(EXIT_FAILED, f"failed: {self._read_msg(self.local_rank)}")
        return False


def leave_rank(code: int) -> NoReturn:
    """The end of a rank process whose work is done and whose session is closed: it leaves
    without the interpreter's finalization, as the session's failure exits do. Finalization can
    abort a rank ("terminate called without an active exception") after every file was written
    (about one tiny CPU validation in 25), and its launcher would report a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
