"""Gantt chart of a simulated run (matplotlib, PNG): one lane per agent, grouped by rank, one lane
of exposed intervals per rank (hatched, coloured by the channel waited on), and one lane per
shared host resource showing its load (fraction of capacity) over time.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from slidedp.graph.kinds import CHANNELS  # noqa: E402
from slidedp.graph.tasks import Channel  # noqa: E402
from slidedp.sim.result import SimResult  # noqa: E402

COLOURS = {Channel.UPLOAD: "tab:blue", Channel.ACTIVATION: "tab:purple", Channel.COMPUTE: "tab:green",
           Channel.REDUCTION: "tab:orange", Channel.DOWNLOAD: "tab:cyan", Channel.UPDATE: "tab:brown"}


def load_curve(res: SimResult, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(times, load as a fraction of capacity) of one resource, each draw spread over its task."""
    u, g, run = res.use, res.graph, res.run
    j = u.index(name)
    task_of = np.repeat(np.arange(g.n_tasks), np.diff(u.ptr))
    sel = u.res == j
    v = task_of[sel]
    length = run.finish_s[v] - run.start_s[v]
    ok = length > 0
    rate = u.amount[sel][ok] / length[ok] / u.capacity[j]
    t = np.concatenate([run.start_s[v][ok], run.finish_s[v][ok]])
    dl = np.concatenate([rate, -rate])
    o = np.argsort(t, kind="stable")
    return t[o], np.cumsum(dl[o])


def gantt(res: SimResult, path: str | Path, window: tuple[float, float] | None = None) -> None:
    """Write a Gantt PNG of `window` (default: the last, steady step)."""
    g, run = res.graph, res.run
    t0, t1 = window or res.window_s
    lanes: list[str] = []
    for r in range(g.n_ranks):
        lanes += [a for a in g.agents if a.startswith(f"gpu{r}.")] + [f"gpu{r} exposed"]
    lanes += [a for a in g.agents if not a.startswith("gpu")]
    shared = [n for n in res.use.names if not n.startswith("gpu")]  # the machine's shared resources
    lanes += [f"load {n}" for n in shared]
    row = {name: i for i, name in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(14, 0.32 * len(lanes) + 1.5))
    inside = (run.finish_s > t0) & (run.start_s < t1)
    chan = CHANNELS[g.kind]
    for a, name in enumerate(g.agents):
        for c in Channel:
            m = inside & (g.agent == a) & (chan == c)
            if m.any():
                bars = list(zip(run.start_s[m], run.finish_s[m] - run.start_s[m], strict=True))
                ax.broken_barh(bars, (row[name] - 0.4, 0.8), facecolors=COLOURS[c], linewidth=0)
    for e in res.exposures:
        if e.end_s > t0 and e.start_s < t1:
            ax.broken_barh([(e.start_s, e.end_s - e.start_s)], (row[f"gpu{e.rank} exposed"] - 0.4, 0.8),
                           facecolors="white", edgecolors=COLOURS[Channel[e.channel]], hatch="////")
    for n in shared:
        t, load = load_curve(res, n)
        y = row[f"load {n}"] - 0.4
        ax.fill_between(t, y, y + 0.8 * np.clip(load, 0, 1), step="post", color="grey", lw=0)
    ax.set_yticks(range(len(lanes)), lanes, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(t0, t1)
    ax.set_xlabel("simulated time (s)")
    ax.set_title(f"step {res.step_time_s:.3f} s (window {t0:.2f}-{t1:.2f} s); hatched: compute "
                 "idle, coloured by the channel it waits on; grey: load / capacity", fontsize=9)
    ax.legend(handles=[Patch(color=COLOURS[c], label=c.name.lower()) for c in Channel],
              loc="upper right", fontsize=7, ncol=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
