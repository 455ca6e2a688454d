"""Start one process per GPU with torchrun (torch.distributed.run), standalone on this host.

`launch(nproc, argv)` runs
    python -m torch.distributed.run --standalone --nproc-per-node N --monitor-interval 5 ARGV
and returns torchrun's exit status; ARGV is a script and its arguments, or `-m module args`
(`slidedp train --nproc N` passes ["-m", "slidedp.cli", "train", ...] without --nproc). Each
rank process finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in its environment
(`is_rank_process()`) and starts a DistSession. The monitor interval is longer than the
session's watchdog period (50x: a loaded machine can delay the watchdog thread by a second or
more) so that a failure is reported by the ranks themselves (naming the failed rank and its
cause) before torchrun terminates the survivors. A SIGTERM or SIGHUP to the launching process
(`slidedp train --nproc N` killed, preempted) is passed on to torchrun, which passes it to the
ranks: they stop (exec/dist/session.py) instead of training on as orphans.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

MONITOR_INTERVAL_S = 5.0


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    if nproc < 1:
        raise ValueError(f"launch: nproc must be >= 1, got {nproc}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--monitor-interval={MONITOR_INTERVAL_S}", *argv]


FORWARDED = (signal.SIGTERM, signal.SIGHUP)


def launch(nproc: int, argv: list[str], env: dict[str, str] | None = None,
           timeout_s: float | None = None) -> int:
    """Run ARGV in `nproc` rank processes; the exit status of torchrun (0: every rank succeeded).
    SIGTERM / SIGHUP received meanwhile (in the main thread) go to torchrun (module docstring);
    past `timeout_s` torchrun is killed and subprocess.TimeoutExpired raised."""
    proc = subprocess.Popen(torchrun_argv(nproc, argv), env=env)
    forward = threading.current_thread() is threading.main_thread()
    old = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum))
           for s in FORWARDED} if forward else {}
    try:
        return proc.wait(timeout=timeout_s)
    except BaseException:  # a timeout, or Ctrl-C (torchrun got the terminal's SIGINT as well)
        _stop(proc)
        raise
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)


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


def is_rank_process() -> bool:
    """True inside a process started by torchrun (do not launch again from there)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
