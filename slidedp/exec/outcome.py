"""How a training run ends, in one line: its exit code and what to print.

  0          every step trained, final/ written
  1          a run failure with a known cause (RunError: a non-finite loss or gradient norm, a
             checkpoint that cannot be written): one line, no traceback
  2          bad input or a plan that does not fit (SpecError, InfeasiblePlan), before training
  128 + sig  stopped by SIGINT (130) or SIGTERM (143): "stopped at step N; resume with: ..."
Anything else that escapes is a bug and keeps its traceback.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from slidedp.spec.errors import InfeasiblePlan, SpecError

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2


class RunError(RuntimeError):
    """The run cannot go on, for a reason its message says in one line (exit EXIT_FAILED)."""


@dataclass(frozen=True)
class RunEnd:
    code: int
    line: str | None = None  # printed last: stdout for code 0 or a stop, else stderr

    @property
    def to_stderr(self) -> bool:
        return self.code not in (EXIT_OK,) and self.code < 128

    def print(self, prog: str = "slidedp train") -> None:
        if self.line is None:
            return
        if self.to_stderr:
            print(f"{prog}: error: {self.line}", file=sys.stderr, flush=True)
        else:
            print(self.line, flush=True)


def expected_failure(exc: BaseException) -> int | None:
    """The exit code of an exception that is reported in one line, None for any other."""
    if isinstance(exc, SpecError | InfeasiblePlan):
        return EXIT_BAD_INPUT
    if isinstance(exc, RunError):
        return EXIT_FAILED
    return None


def resume_command(out: Path) -> str:
    return f"slidedp train --out {shlex.quote(str(out))} --resume"


def stopped(step: int, out: Path, saved: bool, signum: int) -> RunEnd:
    """The end of a run stopped by a signal at a step boundary."""
    if step == 0 or not saved:
        how = "nothing saved" if step == 0 else "not saved (--no-save-on-stop)"
        return RunEnd(128 + signum, f"stopped at step {step}, {how}")
    return RunEnd(128 + signum, f"stopped at step {step}; resume with: {resume_command(out)}")
