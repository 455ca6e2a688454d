"""Per-step training metrics: OUT/metrics.jsonl, one JSON object per optimizer step.

Keys of a row: step (1-based), loss (mean over the global batch's tokens), lr, grad_norm (L2 norm
of the whole gradient, before the update), tokens (global batch x seq), tokens_per_s,
step_time_s, channel_s (per channel: seconds at least one of its tasks ran in the step),
gpu_peak_bytes (CUDA peak reserved so far; null on the CPU), host_pss_bytes (proportional set
size of this process: shared memory counted by share, method.md section 10; null where
/proc/self/smaps_rollup is absent).
A resumed run first drops the rows after the checkpoint's step (left by the interrupted run), so
the file always describes one history.
"""

from __future__ import annotations

import json
from pathlib import Path

from slidedp.exec.engine import StepResult

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
    """Appends rows to a JSONL file, flushed per row; `start_after(step)` drops later rows."""

    def __init__(self, path: Path, start_after: int):
        self.path = path
        kept = []
        if start_after and path.is_file():
            kept = [ln for ln in path.read_text().splitlines()
                    if ln.strip() and json.loads(ln)["step"] <= start_after]
        path.parent.mkdir(parents=True, exist_ok=True)
        self._f = path.open("w")
        self._f.writelines(ln + "\n" for ln in kept)
        self._f.flush()

    def write(self, row: dict) -> None:
        self._f.write(json.dumps(row) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()
