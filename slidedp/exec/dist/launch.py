"""Start one process per GPU with torchrun (torch.distributed.run), standalone on this host.

`launch(nproc, argv)` runs
    python -m torch.distributed.run --standalone --nproc-per-node N --monitor-interval 5 ARGV
and returns torchrun's exit status; ARGV is a script and its arguments, or `-m module args`
(`slidedp train --nproc N` passes ["-m", "slidedp.cli", "train", ...] without --nproc). Each
rank process finds RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT in its environment
(`is_rank_process()`) and starts a DistSession. The monitor interval is longer than the
session's watchdog period (50x: a loaded machine can delay the watchdog thread by a second or
more) so that a failure is reported by the ranks themselves (naming the failed rank and its
cause) before torchrun terminates the survivors.
"""

from __future__ import annotations

import os
import subprocess
import sys

MONITOR_INTERVAL_S = 5.0


def torchrun_argv(nproc: int, argv: list[str]) -> list[str]:
    if nproc < 1:
        raise ValueError(f"launch: nproc must be >= 1, got {nproc}")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={nproc}", f"--monitor-interval={MONITOR_INTERVAL_S}", *argv]


def launch(nproc: int, argv: list[str], env: dict[str, str] | None = None,
           timeout_s: float | None = None) -> int:
    """Run ARGV in `nproc` rank processes; the exit status of torchrun (0: every rank succeeded)."""
    return subprocess.run(torchrun_argv(nproc, argv), env=env, timeout=timeout_s).returncode


def is_rank_process() -> bool:
    """True inside a process started by torchrun (do not launch again from there)."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
