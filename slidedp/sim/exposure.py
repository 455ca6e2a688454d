"""Exposure: when a GPU's compute stream is idle, which channel and which predecessor it waits for.

A task starts when its last predecessor finishes (its critical predecessor: the latest finish,
first in edge order on ties, as in slidedp.model.critical_path). For an idle gap [lo, hi) of a
rank's compute stream ending when compute task v starts, walk back v's critical predecessors:
u1 (finished at hi) ran over [start(u1), hi), u2 ran over [start(u2), start(u1)), ... until the
walk reaches lo. Each piece of the gap is charged to the channel of the task running on the chain
then, so a gap is split exactly, e.g. 'waiting for the all-gather, which waited for its H2D,
which waited for the cast, which waited for last iteration's Adam (version gate)'. Consecutive
pieces of the same channel merge into one Exposure, named after the latest task of the piece and
the edge it released (data, order, buffer, version gate). The idle tail after a rank's last
compute task is walked back from the last task of the run.
"""

from __future__ import annotations

import numpy as np

from slidedp.graph.kinds import CHANNEL_NAMES
from slidedp.graph.tasks import EdgeKind, TaskGraph
from slidedp.graph.timeline import Exposure
from slidedp.sim.engine import GATE, RawRun

WHY = {int(EdgeKind.DATA): "data", int(EdgeKind.ORDER): "order", int(EdgeKind.BUFFER): "buffer",
       int(EdgeKind.JOIN): "step join", GATE: "version gate"}


class Chains:
    """Critical-predecessor walks over a finished run."""

    def __init__(self, g: TaskGraph, run: RawRun):
        self.g, self.run = g, run
        self.start, self.finish = run.start_s, run.finish_s
        self.channel = [CHANNEL_NAMES[k] for k in g.kind.tolist()]

    def critical_pred(self, v: int) -> tuple[int, int]:
        """(predecessor that finished last, why code); (-1, -1) when v has none."""
        lo, hi = self.run.pred_ptr[v], self.run.pred_ptr[v + 1]
        if lo == hi:
            return -1, -1
        preds = self.run.pred_src[lo:hi]
        i = int(np.argmax(self.finish[preds]))
        return int(preds[i]), int(self.run.pred_why[lo + i])

    def pieces(self, v: int, lo: float, hi: float) -> list[tuple[float, float, int, int]]:
        """[(start, end, task, why)] covering [lo, hi), latest first, along v's critical chain."""
        out = []
        cur, t_hi = v, hi
        while t_hi > lo:
            u, why = self.critical_pred(cur)
            if u < 0:
                break
            s = max(float(self.start[u]), lo)
            if s < t_hi:
                out.append((s, t_hi, u, why))
            t_hi, cur = min(t_hi, float(self.start[u])), u
        return out


def exposures(g: TaskGraph, run: RawRun, min_gap_s: float = 0.0) -> list[Exposure]:
    """Every idle gap of every rank's compute stream, split by channel (module docstring)."""
    ch = Chains(g, run)
    out: list[Exposure] = []
    end_task = int(np.argmax(run.finish_s))
    for r in range(g.n_ranks):
        if f"gpu{r}.compute" not in g.agents:
            continue
        tasks = g.agent_tasks[g.agents.index(f"gpu{r}.compute")].tolist()
        prev_end = 0.0
        gaps = []
        for v in tasks:
            if run.start_s[v] > prev_end + min_gap_s:
                gaps.append((v, prev_end, float(run.start_s[v])))
            prev_end = float(run.finish_s[v])
        if run.finish_s[end_task] > prev_end + min_gap_s:
            # the tail: the step ends with the last task of the run; chain back from a virtual
            # waiter that starts when it finishes
            gaps.append((-1, prev_end, float(run.finish_s[end_task])))
        for v, lo, hi in gaps:
            if v < 0:
                pieces = [(max(float(run.start_s[end_task]), lo), hi, end_task, int(EdgeKind.DATA))]
                pieces += ch.pieces(end_task, lo, pieces[0][0])
            else:
                pieces = ch.pieces(v, lo, hi)
            out += _merge(r, pieces, ch, g)
    return out


def _merge(rank: int, pieces, ch: Chains, g: TaskGraph) -> list[Exposure]:
    merged: list[Exposure] = []
    for s, e, u, why in pieces:  # latest first
        c = ch.channel[u]
        if merged and merged[-1].channel == c and abs(merged[-1].start_s - e) <= 1e-12 * max(1.0, e):
            m = merged[-1]
            merged[-1] = Exposure(rank, s, m.end_s, c, m.waiting_on)
        else:
            merged.append(Exposure(rank, s, e, c, f"{g.label(u)} [{WHY.get(why, 'data')}]"))
    return merged[::-1]


def exposed_by_channel_s(exps: list[Exposure], rank: int, t0: float, t1: float) -> dict[str, float]:
    """Seconds of rank's compute idle inside [t0, t1], by the channel it waited on."""
    out: dict[str, float] = {}
    for e in exps:
        if e.rank == rank:
            d = min(e.end_s, t1) - max(e.start_s, t0)
            if d > 0:
                out[e.channel] = out.get(e.channel, 0.0) + d
    return out
