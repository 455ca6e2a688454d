"""Start one process per GPU with torchrun (torch.distributed.run), standalone on this host, and
see the job to its end: nothing left running, one line saying how it ended.

With nodes = K > 1 it starts K torchrun agents on this host instead, each a node of `nproc`
ranks with its own host state (DistSession), joined by a c10d rendezvous on localhost at a free
port (node 0's agent holds the rendezvous store: is_host), as K hosts of a cluster would be:
    python -m torch.distributed.run --nnodes K --node-rank i --rdzv-backend c10d
        --rdzv-endpoint localhost:PORT --rdzv-id ID --nproc-per-node N ... ARGV
With gpus_per_node, node i sees the GPUs i N .. (i + 1) N - 1 of this host (CUDA_VISIBLE_DEVICES).
Everything below holds per agent: the launcher relays signals to every node's ranks, waits for
every agent, and a rank recognizes any of them as its launcher. A node whose agent dies stops
the others through the job's store (session.py: other nodes).

`launch(nproc, argv)` runs
    python -m torch.distributed.run --standalone --nproc-per-node N --monitor-interval 5 ARGV
as a child of this process (the launcher: `slidedp train --nproc N`) and returns the job's exit
status; ARGV is a script and its arguments, or `-m module args` (`slidedp train --nproc N` passes
["-m", "slidedp.cli", "train", ...] without --nproc). Each rank process finds RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR/PORT in its environment (`is_rank_process()`) and starts a DistSession.
The monitor interval is longer than the session's watchdog period (50x: a loaded machine can
delay the watchdog thread by a second or more) so that a failure is reported by the ranks
themselves (naming the failed rank and its cause) before torchrun terminates the survivors.

Lifetimes:
  - torchrun runs in a session of its own, so a terminal's Ctrl-C reaches the launcher alone.
    SIGINT, SIGTERM or SIGHUP to the launcher is relayed to the rank processes as SIGTERM: a
    stop request (`slidedp train` saves at the next step boundary; exec/dist/session.py); a
    second signal is relayed too (the ranks stop at once, unsaved); a third kills the ranks and
    torchrun with SIGKILL. Before the ranks exist the signal goes to torchrun. The launcher then
    exits 128 + the first signal's number.
  - Ranks watch their launchers (session.py watchdog: launcher_gone): torchrun dying reparents
    them (the launcher records torchrun's pid beside the report, so a rank reparented before it
    looked knows too), and the launcher's pid and start time are in SLIDEDP_LAUNCHER;
    PR_SET_PDEATHSIG (watch_parent) sends SIGTERM when torchrun dies before the watchdog runs.
  - After torchrun has exited, the launcher waits up to ORPHAN_WAIT_S for rank processes left
    behind (torchrun killed) to stop, then kills them: `launch` returns with none running.
Report: the ranks write the job's one-line outcome (a failure and its cause, or a stop) to the
file named by SLIDEDP_REPORT (write_report: the first writer wins), and the launcher prints it
last, after torchrun's own output, whose "root cause" table can be only part of the story.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from slidedp.exec.host_state import process_start

MONITOR_INTERVAL_S = 5.0
LAUNCHER_ENV = "SLIDEDP_LAUNCHER"  # "pid:start" of the launching process
REPORT_ENV = "SLIDEDP_REPORT"  # the file a rank writes the job's one-line outcome to
RELAYED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
POLL_S = 0.2  # how often the launcher looks at torchrun and its rank processes
ORPHAN_WAIT_S = 15.0  # ranks left by a dead torchrun stop within seconds (their watchdog)
PR_SET_PDEATHSIG = 1
TORCHRUN_PID = "torchrun.pid"  # beside the report: the ranks' expected parent


def torchrun_argv(nproc: int, argv: list[str], node: tuple[int, int, int, str] | None = None
                  ) -> list[str]:
    """torchrun's command line: standalone, or node = (node rank, nodes, port, job id) of a
    c10d rendezvous on localhost."""
    if nproc < 1:
        raise ValueError(f"launch: nproc must be >= 1, got {nproc}")
    where = ["--standalone"]
    if node is not None:
        i, nodes, port, job = node
        where = [f"--nnodes={nodes}", f"--node-rank={i}", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=localhost:{port}", f"--rdzv-id={job}",
                 f"--rdzv-conf=is_host={int(i == 0)}"]
    return [sys.executable, "-m", "torch.distributed.run", *where,
            f"--nproc-per-node={nproc}", f"--monitor-interval={MONITOR_INTERVAL_S}", *argv]


def free_port() -> int:
    """A TCP port free on localhost now (the rendezvous binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the launcher ---------------------------------------------------------------------------


class _Relay:
    """The launcher's handlers for RELAYED signals (module docstring: Lifetimes), for every
    node's torchrun."""

    def __init__(self, procs: list[subprocess.Popen]):
        self.procs, self.first, self.count = procs, None, 0
        self.ranks: set[int] = set()  # rank pids seen so far
        main = threading.current_thread() is threading.main_thread()
        self._old = {s: signal.signal(s, self._handler) for s in RELAYED} if main else {}

    def _handler(self, signum: int, frame) -> None:
        self.count += 1
        self.first = self.first or signum
        for proc in self.procs:
            ranks = children(proc.pid)
            if self.count >= 3:
                for pid in [*ranks, proc.pid]:
                    _kill(pid, signal.SIGKILL)
            else:
                for pid in ranks or [proc.pid]:
                    _kill(pid, signal.SIGTERM)

    def restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)


def launch(nproc: int, argv: list[str], env: dict[str, str] | None = None,
           timeout_s: float | None = None, prog: str = "slidedp", nodes: int = 1,
           gpus_per_node: int | None = None) -> int:
    """Run ARGV in `nproc` rank processes on each of `nodes` nodes (module docstring); the job's
    exit status: 128 + the first relayed signal, else the rank report's code when there is one,
    else torchrun's (1 if one was killed). The one-line outcome is printed last. Past
    `timeout_s` the job is stopped and subprocess.TimeoutExpired raised."""
    with tempfile.TemporaryDirectory(prefix="slidedp-launch-") as tmp:
        report = Path(tmp) / "report.json"
        me = os.getpid()
        env = dict(os.environ if env is None else env) | {
            LAUNCHER_ENV: f"{me}:{process_start(me)}", REPORT_ENV: str(report)}
        procs = _start(nproc, argv, env, nodes, gpus_per_node)
        (Path(tmp) / TORCHRUN_PID).write_text("\n".join(str(p.pid) for p in procs))
        relay = _Relay(procs)
        try:
            rcs = [_wait(p, relay, timeout_s) for p in procs]
        except BaseException:  # a timeout, or an error of the launcher itself
            for p in procs:
                _stop(p)
            raise
        finally:
            relay.restore()
            left = _wait_orphans(relay.ranks, str(report))
        killed = [(p.pid, rc) for p, rc in zip(procs, rcs, strict=True) if rc < 0]
        pid, rc = killed[0] if killed else (procs[0].pid, next((rc for rc in rcs if rc), 0))
        report_line = _read_report(report)
        if killed and nodes > 1 and report_line is not None:
            rc = 1  # a node's agent killed: its ranks' report names the cause
        return _outcome(prog, pid, rc, report_line, relay.first, left)


def _start(nproc: int, argv: list[str], env: dict[str, str], nodes: int,
           gpus_per_node: int | None) -> list[subprocess.Popen]:
    """The torchrun agents: one standalone, or one per node (module docstring)."""
    if nodes == 1:
        return [subprocess.Popen(torchrun_argv(nproc, argv), env=env, start_new_session=True)]
    port, job = free_port(), f"slidedp-{os.getpid()}"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    devices = visible.split(",") if visible else [str(i) for i in range(nodes * (gpus_per_node
                                                                                  or 0))]
    procs = []
    for i in range(nodes):
        node_env = dict(env)
        if gpus_per_node:
            node_env["CUDA_VISIBLE_DEVICES"] = ",".join(
                devices[i * gpus_per_node:(i + 1) * gpus_per_node])
        procs.append(subprocess.Popen(torchrun_argv(nproc, argv, (i, nodes, port, job)),
                                      env=node_env, start_new_session=True))
    return procs


def _wait(proc: subprocess.Popen, relay: _Relay, timeout_s: float | None) -> int:
    """torchrun's exit status, noting the rank processes of every agent meanwhile."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        try:
            return proc.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            for p in relay.procs:
                relay.ranks.update(children(p.pid))
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(proc.args, timeout_s) from None


def _wait_orphans(known: set[int], marker: str) -> list[int]:
    """Rank processes still running after torchrun's exit (the known ones, and any process with
    this job's report path in its environment), waited for up to ORPHAN_WAIT_S, then killed;
    the pids that had to be killed."""
    pids = {p for p in known if process_start(p) is not None} | set(_with_env(marker))
    deadline = time.monotonic() + ORPHAN_WAIT_S
    while pids and time.monotonic() < deadline:
        time.sleep(POLL_S / 2)
        pids = {p for p in pids if process_start(p) is not None}
    for pid in pids:
        _kill(pid, signal.SIGKILL)
    return sorted(pids)


def _outcome(prog: str, torchrun_pid: int, rc: int, report: dict | None, first: int | None,
             killed: list[int]) -> int:
    """Print the job's last line; its exit status (launch's docstring)."""
    lines: list[tuple[bool, str]] = []  # (to stderr, text)
    if rc < 0 and first is None:
        lines.append((True, f"torchrun (pid {torchrun_pid}) was killed by "
                            f"{signal.Signals(-rc).name}; its rank processes stopped"))
        code = 1
    elif report is not None:
        code = int(report["code"]) if first is None else 128 + first
        lines.append((0 < int(report["code"]) < 128, str(report["line"])))
    elif first is not None:
        code = 128 + first
        lines.append((False, f"stopped by {signal.Signals(first).name}"))
    else:
        code = rc
        if rc != 0:
            lines.append((True, f"torchrun exited with status {rc}"))
    if killed:
        lines.append((True, f"rank processes {killed} still ran {ORPHAN_WAIT_S:g} s after "
                            "torchrun ended: killed"))
        code = code or 1
    for err, text in lines:
        if err:
            print(f"{prog}: error: {text}", file=sys.stderr, flush=True)
        else:
            print(text, flush=True)
    return code


STOP_GRACE_S = 60.0  # torchrun's own grace from SIGTERM to SIGKILL for the ranks is 30 s


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to torchrun (it stops the ranks), SIGKILL if it is still there after STOP_GRACE_S."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


# ---- processes ------------------------------------------------------------------------------


def _kill(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid` (from /proc/*/stat)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] not in ("Z", "X"):
            out.append(int(stat.parent.name))
    return out


def _with_env(marker: str) -> list[int]:
    """This user's processes whose environment holds REPORT_ENV=marker."""
    needle = f"{REPORT_ENV}={marker}".encode()
    out = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                out.append(int(environ.parent.name))
        except OSError:
            continue
    return out


# ---- the rank's side --------------------------------------------------------------------------


def is_rank_process() -> bool:
    """True inside a process started by torchrun (do not launch again from there)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def _launcher() -> tuple[int, int] | None:
    spec = os.environ.get(LAUNCHER_ENV, "")
    pid, _, start = spec.partition(":")
    return (int(pid), int(start)) if pid.isdigit() and start.isdigit() else None


def _torchrun_pids() -> list[int]:
    """The torchrun pids the launcher recorded beside the report (one per node), [] without."""
    try:
        text = (Path(os.environ[REPORT_ENV]).parent / TORCHRUN_PID).read_text()
        return [int(x) for x in text.split()]
    except (KeyError, OSError, ValueError):
        return []


def launcher_gone(ppid: int) -> str | None:
    """Why this rank's launcher counts as gone, or None: its parent is no longer `ppid` (the
    parent it started with: torchrun died and the rank was reparented), nor one of the
    torchruns the launcher started, or the launcher in SLIDEDP_LAUNCHER has exited."""
    now, launcher, torchruns = os.getppid(), _launcher(), _torchrun_pids()
    if now != ppid or now == 1 or (torchruns and now not in torchruns):
        return f"its launcher torchrun (pid {torchruns[0] if len(torchruns) == 1 else ppid}) " \
               "is gone"
    if launcher is not None and process_start(launcher[0]) != launcher[1]:
        return f"its launcher slidedp (pid {launcher[0]}) is gone"
    return None


def watch_parent() -> None:
    """Ask the kernel for SIGTERM when this process's parent exits (PR_SET_PDEATHSIG), then make
    sure the parent did not exit before the request: until the session's watchdog runs, the
    default SIGTERM ends the rank, which has nothing to clean up yet."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0) != 0:
        return  # not Linux: the watchdog alone watches
    if launcher_gone(os.getppid()) is not None:
        os.kill(os.getpid(), signal.SIGTERM)


def write_report(code: int, line: str) -> bool:
    """Write the job's one-line outcome for the launcher (the first writer wins); False when the
    process has no launcher to print it (started by torchrun directly)."""
    path = os.environ.get(REPORT_ENV)
    if not path:
        return False
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return True
    except OSError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"code": code, "line": line}, f)
    return True


def _read_report(path: Path) -> dict | None:
    try:
        rec = json.loads(path.read_text())
        return rec if isinstance(rec.get("code"), int) and isinstance(rec.get("line"), str) \
            else None
    except (OSError, ValueError, AttributeError):
        return None
