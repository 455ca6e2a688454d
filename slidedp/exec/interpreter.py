"""The interpreter: worker threads that walk the per-iteration template, one per agent.

Every agent with local tasks (gpu{r}.compute, gpu{r}.h2d, gpu{r}.d2h, fabric, cpu.cast0,
cpu.update{w}) is a thread, created once, that walks its local tasks in id order each step. A task
first waits for its predecessors: on another process through the shared completion counters, on
another local agent through a per-step threading.Event `issued[u]` (set once u's work is enqueued
on a GPU stream, or done on the CPU) and, after a GPU task, its end CUDA event; then it runs its
kernel. Only these waits synchronize: docs/executor.md ("Stream contract", "Process contract")
says which waits block the host and why ids in topological order cannot deadlock.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from contextlib import nullcontext, suppress

import numpy as np
import torch

from slidedp.exec.dist.session import DistSession, PeerFailure
from slidedp.exec.template import Template
from slidedp.graph.timeline import Record, Timeline

MODES = ("overlap", "sync")
_POLL_S = 0.05  # how often a waiting worker checks whether another worker failed
_REMOTE_POLL_S = (2e-5, 1e-3)  # first and longest sleep while polling a shared counter

Kernel = Callable[[object, int], None]  # kernel(step data, task id)


class Aborted(Exception):
    """Raised in a worker waiting on a task of a worker that failed."""


class Step:
    """One step's walk: which tasks are issued, their host times, the first error."""

    def __init__(self, issued: list[threading.Event], seq: int, data: object):
        """issued: the interpreter's events, reused by every step (creating them costs ~15 us
        each, on the step's clock): cleared here, when no thread of the previous step is left."""
        self.seq = seq  # this step's number, 1-based: the value of a completed task's counter
        for e in issued:
            e.clear()
        self.issued = issued
        self.data = data  # what the kernels share (kernels.StepData)
        self.host_s = [(0.0, 0.0)] * len(issued)
        self.error: BaseException | None = None
        self.remaining = 0
        self.done = threading.Condition()


def own_omp_team(threads: int) -> None:
    """Give the calling thread its own OpenMP team of `threads` for its later torch CPU ops.

    torch.set_num_threads sets the calling thread's OpenMP team size and a process-wide default,
    but a thread's first parallel op (or get_num_threads) re-initialises its team from that
    process-wide default unless the thread was initialised before: set alone, every worker would
    end up with the size the LAST worker set. Initialising first makes the setting stick to this
    thread."""
    torch.get_num_threads()  # initialise this thread's team (from the process default)
    torch.set_num_threads(threads)


class Interpreter:
    """Runs this process's tasks of the template, kernels[v](step data, v) for task v."""

    def __init__(self, tpl: Template, kernels: list[Kernel | None], *, mode: str,
                 device: torch.device, session: DistSession | None, done: np.ndarray | None,
                 process_threads: int):
        self.tpl, self.kernels, self.mode, self.device = tpl, kernels, mode, device
        self.session, self.done, self.process_threads = session, done, process_threads
        self.cuda = device.type == "cuda"
        self.streams = [torch.cuda.Stream(device) if self.cuda and tpl.is_gpu_agent[a] else None
                        for a in range(len(tpl.agent_names))]
        gpu_tasks = ([v for v in range(tpl.n) if tpl.local[v] and tpl.on_gpu(v)]
                     if self.cuda else [])
        self.ev_start = {v: torch.cuda.Event(enable_timing=True) for v in gpu_tasks}
        self.ev_end = {v: torch.cuda.Event(enable_timing=True) for v in gpu_tasks}
        self.ev_ref = torch.cuda.Event(enable_timing=True) if self.cuda else None
        self.issued = [threading.Event() for _ in range(tpl.n)]  # per task, every step
        self._queues: list[queue.Queue] = []
        self._threads: list[threading.Thread] = []
        self._notify: queue.Queue | None = None
        if mode == "overlap":
            self._start_threads()

    def _start_threads(self) -> None:
        names = self.tpl.agent_names
        loops = [(self._agent_loop, a, names[a]) for a in range(len(names))
                 if self.tpl.local_tasks[a]]
        if self.cuda and self.session is not None:
            loops.append((self._notifier_loop, -1, "notifier"))
        for target, a, name in loops:
            q: queue.Queue = queue.Queue()
            t = threading.Thread(target=target, args=(a, q), daemon=True, name=f"slidedp-{name}")
            t.start()
            self._queues.append(q)
            self._threads.append(t)
        if self.cuda and self.session is not None:
            self._notify = self._queues[-1]

    # ---- one step -----------------------------------------------------------------------------

    def run(self, st: Step) -> float:
        """Run every local task of the step; returns the perf_counter time of the step's reference
        event (the boundary synchronisation before the walk). Raises the step's first error."""
        if self.cuda:
            torch.cuda.synchronize(self.device)  # boundary sync: the reference event is recorded
            self.ev_ref.record()  # on an idle GPU
        t_ref = time.perf_counter()
        if self.mode == "overlap":
            st.remaining = len(self._threads) - (self._notify is not None)
            for q in self._queues:
                if q is not self._notify:
                    q.put(st)
            with st.done:
                st.done.wait_for(lambda: st.remaining == 0)
        else:
            self._run_sync(st)
        if st.error is not None:
            if self.cuda:  # let the failed step's queued copies land before anything reuses
                # their buffers (the next step's delivery, its staging chunk); the step's own
                # error is the one to report
                with suppress(Exception):
                    torch.cuda.synchronize(self.device)
            raise st.error
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return t_ref

    def _run_sync(self, st: Step) -> None:
        """The synchronous reference: every local task in id order, the device synchronized
        after each."""
        for v in range(self.tpl.n):
            if not self.tpl.local[v]:
                continue
            try:
                self._task(st, v)
            except BaseException as e:  # noqa: BLE001 - blamed, then raised by run()
                st.error = self._blame(e)
                break
            if self.cuda:
                torch.cuda.synchronize(self.device)

    def _agent_loop(self, a: int, q: queue.Queue) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)
        if self.cuda and (n := self._cpu_threads(a)) > 0:
            own_omp_team(n)
        while (st := q.get()) is not None:
            try:
                for v in self.tpl.local_tasks[a]:
                    self._task(st, v)
            except Aborted:
                pass
            except BaseException as e:  # noqa: BLE001 - handed to run(), which re-raises it
                st.error = st.error or self._blame(e)
            finally:
                with st.done:
                    st.remaining -= 1
                    st.done.notify_all()

    def _cpu_threads(self, a: int) -> int:
        """Threads of CPU agent `a` (0 for a GPU agent): the graph's team for its tasks (cast
        threads, or update threads / workers), within this process's budget (Plan.threads: by
        default three quarters of the cores for each team, as the model assumes).
        Applied on GPUs only: on the CPU the compute agents need the cores too, and the CPU tests
        compare the overlapped and the synchronous modes bit for bit, which fixed per-thread
        OpenMP teams of different sizes could break in reductions."""
        tasks = self.tpl.local_tasks[a]
        if self.tpl.is_gpu_agent[a] or not len(tasks):
            return 0
        want = max(float(self.tpl.g.threads[v]) for v in tasks)
        return max(1, min(round(want), self.process_threads)) if want > 0 else 0

    def _notifier_loop(self, _a: int, q: queue.Queue) -> None:
        """Publishes GPU tasks that another process waits on, once their end event completed."""
        torch.cuda.set_device(self.device)
        while (item := q.get()) is not None:
            st, v = item
            try:
                self.ev_end[v].synchronize()
                self.done[v] = st.seq
            except BaseException as e:  # noqa: BLE001 - handed to run(), which re-raises it
                st.error = st.error or self._blame(e)

    def _blame(self, e: BaseException) -> BaseException:
        """The error to report. A peer's recorded failure wins (a collective fails when a peer
        dies); otherwise this rank failed: mark it in the status block, so every peer stops."""
        if self.session is None or isinstance(e, PeerFailure):
            return e
        peer = self.session.settled_peer_failure()
        if peer is not None:
            return PeerFailure(peer)
        self.session.fail(f"{type(e).__name__}: {e}")
        return e

    # ---- one task -----------------------------------------------------------------------------

    def _wait_remote(self, st: Step, u: int) -> None:
        """Wait until task u of another process completed this step (its shared counter)."""
        done, sess = self.done, self.session
        delay, longest = _REMOTE_POLL_S
        deadline = time.monotonic() + sess.timeout_s
        while done[u] < st.seq:
            if st.error is not None:
                raise Aborted
            peer = sess.peer_failure()
            if peer is not None:
                raise PeerFailure(peer)
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.tpl.rank} waited {sess.timeout_s} s for "
                                   f"{self.tpl.g.label(u)} of rank {int(self.tpl.owner[u])}")
            time.sleep(delay)
            delay = min(2 * delay, longest)

    def _task(self, st: Step, v: int) -> None:
        tpl = self.tpl
        stream = self.streams[int(tpl.g.agent[v])]
        for u in tpl.remote[v]:
            self._wait_remote(st, u)
        for u in tpl.preds[v]:
            while not st.issued[u].wait(_POLL_S):
                if st.error is not None:
                    raise Aborted
            if self.cuda and tpl.on_gpu(u):
                if stream is not None:
                    stream.wait_event(self.ev_end[u])  # no host sync
                else:
                    self.ev_end[u].synchronize()  # the host must see the bytes
        t0 = time.perf_counter()
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            if stream is not None:
                self.ev_start[v].record(stream)
            self.kernels[v](st.data, v)
            if stream is not None:
                self.ev_end[v].record(stream)
        st.host_s[v] = (t0, time.perf_counter())
        st.issued[v].set()
        if tpl.publish[v]:
            self._publish(st, v)

    def _publish(self, st: Step, v: int) -> None:
        """done[v] = seq once v's work is complete (docs/executor.md, "Process contract")."""
        if not (self.cuda and self.tpl.on_gpu(v)):
            self.done[v] = st.seq
        elif self._notify is not None:
            self._notify.put((st, v))
        else:  # sync mode
            self.ev_end[v].synchronize()
            self.done[v] = st.seq

    # ---- after the step -----------------------------------------------------------------------

    def timeline(self, st: Step, t0: float, t_ref: float, iteration: int) -> Timeline:
        """This process's tasks of the step, times relative to t0 (GPU tasks: their CUDA events
        placed on the host clock through the reference event recorded at t_ref)."""
        tpl = self.tpl
        g, tl = tpl.g, Timeline(source=f"measured: slidedp.exec {self.mode} on {self.device}")
        for v in range(tpl.n):
            if not tpl.local[v]:
                continue
            issue = (st.host_s[v][0] - t0, st.host_s[v][1] - t0)  # the agent's host time
            if self.cuda and tpl.on_gpu(v):
                off = t_ref - t0
                s = off + self.ev_ref.elapsed_time(self.ev_start[v]) / 1e3
                e = off + self.ev_ref.elapsed_time(self.ev_end[v]) / 1e3
            else:
                s, e = issue
            tl.add(Record(iteration, tpl.kind[v].name, int(g.unit[v]), int(g.rank[v]),
                          int(g.chunk[v]), tpl.agent_names[int(g.agent[v])], s, e,
                          *(issue if tpl.on_gpu(v) else (None, None))))
        return tl

    def close(self) -> None:
        """Stop the worker threads (each finishes the step it is in first)."""
        for q in self._queues:
            q.put(None)
        for t in self._threads:
            t.join()
        self._queues.clear()
        self._threads.clear()
        self._notify = None
