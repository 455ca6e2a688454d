"""Pause points for fault tests, so that a test can kill a process at a chosen moment without
guessing it from timing.

With SLIDEDP_PAUSE_AT="<point>:<dir>" in the environment, a process that reaches pause_point(
"<point>") writes the file <dir>/<point>-<pid> and sleeps there until a signal ends or interrupts
it (the test kills it, or a peer, or the launcher). Without the variable pause_point returns at
once. Points: "load" (exec/trainer.py: the host state exists in /dev/shm, before its first unit is
read).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PAUSE_ENV = "SLIDEDP_PAUSE_AT"


def pause_point(point: str) -> None:
    spec = os.environ.get(PAUSE_ENV, "")
    name, _, folder = spec.partition(":")
    if name != point or not folder:
        return
    Path(folder, f"{point}-{os.getpid()}").write_text(str(os.getpid()))
    while True:
        time.sleep(0.05)
