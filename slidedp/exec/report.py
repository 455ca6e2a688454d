"""Experiment trackers beside metrics.jsonl (which stays the record): `--report-to`.

    none         nothing besides metrics.jsonl
    tensorboard  event files under OUT/tensorboard (torch.utils.tensorboard's SummaryWriter;
                 needs the `tensorboard` package: pip install 'slidedp[tensorboard]');
                 `tensorboard --logdir OUT/tensorboard`
    trackio      a local trackio run (trackio.init(project=OUT's name, config=the resolved
                 options), trackio.log per step, trackio.finish; needs `trackio`:
                 pip install 'slidedp[trackio]'); `trackio show`
Every numeric key of a metrics row is logged as a scalar at its step (channel_s flattened to
channel_s/<CHANNEL>); null values (gpu_peak_bytes on the CPU) are left out. check() runs before
training so that a missing package is one line and exit 2, not a failure after the first step.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from slidedp.spec.errors import SpecError

REPORT_TO = ("none", "tensorboard", "trackio")
PACKAGE = {"tensorboard": "tensorboard", "trackio": "trackio"}  # --report-to -> module it needs


def check(report_to: str) -> None:
    """SpecError (one line) when the tracker's package is not installed."""
    if report_to not in REPORT_TO:
        raise SpecError("command line", "--report-to", f"one of {', '.join(REPORT_TO)}, got "
                        f"{report_to!r}")
    pkg = PACKAGE.get(report_to)
    if pkg is not None and importlib.util.find_spec(pkg) is None:
        raise SpecError("command line", "--report-to", f"{report_to} needs the `{pkg}` package: "
                        f"pip install 'slidedp[{report_to}]' (it is not installed)")


def scalars(row: dict) -> dict[str, float]:
    """The row's numbers by name (channel_s/<CHANNEL> for the channels), step left out."""
    out: dict[str, float] = {}
    for k, v in row.items():
        if k == "step" or v is None or isinstance(v, bool):
            continue
        if isinstance(v, dict):
            out.update({f"{k}/{ch}": float(s) for ch, s in v.items() if s is not None})
        elif isinstance(v, int | float):
            out[k] = float(v)
    return out


class Reporter:
    """Logs metrics rows to the chosen tracker; log(row) per step, close() at the end."""

    def __init__(self, report_to: str, out: Path, config: dict):
        check(report_to)
        self.kind = report_to
        if report_to == "tensorboard":
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        elif report_to == "trackio":
            import trackio

            self.trackio = trackio
            trackio.init(project=out.resolve().name, config=config)

    def log(self, row: dict) -> None:
        values = scalars(row)
        if self.kind == "tensorboard":
            for k, v in values.items():
                self.writer.add_scalar(k, v, global_step=row["step"])
            self.writer.flush()
        elif self.kind == "trackio":
            self.trackio.log(values, step=row["step"])

    def close(self) -> None:
        if self.kind == "tensorboard":
            self.writer.close()
        elif self.kind == "trackio":
            self.trackio.finish()
