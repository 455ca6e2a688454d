"""Measured and simulated timelines of one configuration overlaid per channel (matplotlib, PNG).

One row per channel, two lanes each: the measured step (solid) above the simulated steady step
(hatched), each the union of its channel's task intervals over every rank and agent, with the
busy seconds written at the right; dashed lines mark each step's end. Both timelines are on the
clock of a step's start (slidedp.validate.traces.steady_step for a simulated run).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from slidedp.graph.tasks import Channel  # noqa: E402
from slidedp.graph.timeline import Timeline, union_intervals  # noqa: E402
from slidedp.sim.plot import COLOURS  # noqa: E402


def channel_intervals(tl: Timeline, channel: str) -> list[tuple[float, float]]:
    """The union of a channel's task intervals, as disjoint sorted (start, end) pairs."""
    return union_intervals((r.start_s, r.end_s) for r in tl.records if r.channel == channel)


def overlay(measured: Timeline, simulated: Timeline, path: str | Path, title: str = "") -> None:
    """Write the overlay PNG (module docstring)."""
    channels = [c for c in Channel
                if any(r.channel == c.name for r in measured.records + simulated.records)]
    fig, ax = plt.subplots(figsize=(13, 0.9 * len(channels) + 1.6))
    ticks, labels = [], []
    for i, c in enumerate(channels):
        y = 2 * (len(channels) - 1 - i)
        for lane, (tl, style) in enumerate(((measured, {}), (simulated, {"hatch": "///", "alpha": 0.55}))):
            iv = channel_intervals(tl, c.name)
            row = y + 1 - lane
            ax.broken_barh([(s, e - s) for s, e in iv], (row - 0.4, 0.8), facecolors=COLOURS[c],
                           linewidth=0, **style)
            busy = sum(e - s for s, e in iv)
            ticks.append(row)
            labels.append(f"{c.name.lower()} {'measured' if lane == 0 else 'simulated'} ({busy:.3g} s)")
    for tl, colour, name in ((measured, "k", "measured"), (simulated, "tab:red", "simulated")):
        end = max(r.end_s for r in tl.records)
        ax.axvline(end, color=colour, linestyle="--", linewidth=1, label=f"{name} step {end:.4g} s")
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("seconds from the step's start")
    ax.set_title(title or "measured (solid) and simulated (hatched) step, per channel")
    ax.legend(loc="upper right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
