"""Per-step training metrics: OUT/metrics.jsonl, one JSON object per optimizer step.

Keys of a row: step (1-based), loss (mean over the global batch's tokens), lr, grad_norm (L2 norm
of the whole gradient, before the update), tokens (global batch x seq), tokens_per_s,
step_time_s, channel_s (per channel: seconds at least one of its tasks ran in the step),
gpu_peak_bytes (CUDA peak reserved so far; null on the CPU), host_pss_bytes (proportional set
size of this process: shared memory counted by share, method.md section 10; null where
/proc/self/smaps_rollup is absent).
A non-finite loss or norm is written as JSON's NaN / Infinity tokens (as Python's json writes
and reads them). Rows of steps whose update --skip-nonfinite skipped carry "skipped": true.
A resumed run first keeps only the rows up to the checkpoint's step, one per step (what the
interrupted run wrote after it, and a last line torn by a crash mid-write, are dropped), and
replaces the file with them atomically before appending: the file always describes one history.
A line before the last that is not JSON is a SpecError naming the file and the line.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from slidedp.exec.engine import StepResult
from slidedp.spec.errors import SpecError

SMAPS_ROLLUP = Path("/proc/self/smaps_rollup")
KIB = 1024


def host_pss_bytes() -> int | None:
    """This process's PSS in bytes (Linux), None elsewhere."""
    try:
        text = SMAPS_ROLLUP.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) * KIB
    return None


def metrics_row(step: int, res: StepResult, lr: float, tokens: int) -> dict:
    return {
        "step": step,
        "loss": res.loss,
        "lr": lr,
        "grad_norm": res.grad_norm,
        "tokens": tokens,
        "tokens_per_s": tokens / res.step_time_s,
        "step_time_s": res.step_time_s,
        "channel_s": res.channel_s,
        "gpu_peak_bytes": res.gpu_peak_bytes,
        "host_pss_bytes": host_pss_bytes(),
    }


class MetricsLog:
    """Appends rows to a JSONL file, flushed per row; keeps the rows up to `start_after`
    (module docstring)."""

    def __init__(self, path: Path, start_after: int):
        self.path = path
        kept = kept_rows(path, start_after) if start_after and path.is_file() else []
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        os.replace(tmp, path)
        self._f = path.open("a")

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def kept_rows(path: Path, last_step: int) -> list[str]:
    """The lines of rows 1..last_step of a metrics file, one per step (the last written wins),
    in step order; a torn last line is dropped, an unreadable earlier one is a SpecError."""
    lines = path.read_text(errors="replace").split("\n")
    by_step: dict[int, str] = {}
    for i, ln in enumerate(lines):
        if not ln.strip():
            continue
        try:
            step = json.loads(ln)["step"]
        except (ValueError, KeyError, TypeError):
            if i == len(lines) - 1:  # no newline after it: torn by a crash mid-write
                continue
            raise SpecError(f"{path}:{i + 1}", "<row>", "a JSON object with a step (the file "
                            "is damaged before its last line)") from None
        if isinstance(step, int) and 1 <= step <= last_step:
            by_step[step] = ln
    return [by_step[k] for k in sorted(by_step)]
