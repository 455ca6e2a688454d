"""The critical-path recurrence of method.md section 5 over the task graph.

    f(v) = d_v + max({a_v} U {f(u) : u in P(v)})

with P(v) the DATA, ORDER and BUFFER predecessors. Every agent is a serial server (ORDER edges)
and shared bandwidth is not contended: this is the dependency part of the model; the resource
lower bound is the other part. The graph builder emits edges from lower to higher task ids, so
task id order is a topological order and one pass suffices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from slidedp.graph.tasks import TaskGraph


@dataclass(frozen=True)
class Schedule:
    """Start and finish of every task under the recurrence, and the critical predecessor."""

    start_s: np.ndarray
    finish_s: np.ndarray
    critical_pred: np.ndarray  # -1 where the task started at its release time

    def critical_path(self, end: int) -> list[int]:
        """Task ids on the longest path ending at `end`, first to last (back-pointers)."""
        path = [end]
        while self.critical_pred[path[-1]] >= 0:
            path.append(int(self.critical_pred[path[-1]]))
        return path[::-1]


def _pred_csr(g: TaskGraph) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(g.edge_dst, kind="stable")
    src = g.edge_src[order]
    ptr = np.zeros(g.n_tasks + 1, np.int64)
    np.add.at(ptr, g.edge_dst + 1, 1)
    return np.cumsum(ptr), src


def longest_path(g: TaskGraph, durations: np.ndarray, release_s: np.ndarray | None = None) -> Schedule:
    """Evaluate f(v) for every task in one pass over task ids (a topological order)."""
    if g.n_edges and not np.all(g.edge_src < g.edge_dst):
        raise ValueError("task graph edges must go from lower to higher task ids")
    ptr, src = _pred_csr(g)
    n = g.n_tasks
    rel = np.zeros(n) if release_s is None else release_s
    finish = [0.0] * n
    start = [0.0] * n
    crit = [-1] * n
    d = durations.tolist()
    relv = rel.tolist()
    p = ptr.tolist()
    s = src.tolist()
    for v in range(n):
        best, arg = relv[v], -1
        for u in s[p[v]:p[v + 1]]:
            fu = finish[u]
            if fu > best:
                best, arg = fu, u
        start[v] = best
        finish[v] = best + d[v]
        crit[v] = arg
    return Schedule(np.asarray(start), np.asarray(finish), np.asarray(crit, np.int64))
