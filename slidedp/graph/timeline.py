"""The Timeline: one record format for simulated and measured runs, and its Chrome trace export.

A record is (iteration, kind, unit, rank, chunk, agent, start_s, end_s); the simulator writes it
from simulated clocks, the executor from CUDA events and host clocks. A measured GPU task also
carries when its agent's thread issued it (issue_start_s, issue_end_s: host clock, the same
reference): a span much longer than its kernels with an issue as long says the GPU waited on
the issuing thread, not on its work. Chrome trace JSON (opens in
Perfetto / chrome://tracing): one process per rank plus one for the host and one for the fabric,
one thread per agent; exposed intervals (a GPU's compute stream idle, with the channel it waits on)
can be added as their own lane. Times are written in microseconds rounded to the nanosecond
(smaller files; nothing a measured clock resolves is lost), gzip-compressed when the file name
ends with .gz (Perfetto and chrome://tracing open it as it is).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from slidedp.graph.kinds import KINDS
from slidedp.graph.tasks import Kind


def union_intervals(intervals) -> list[tuple[float, float]]:
    """The union of (start, end) intervals, as disjoint sorted (start, end) pairs."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


@dataclass(frozen=True)
class Record:
    iteration: int
    kind: str  # Kind name
    unit: int
    rank: int
    chunk: int
    agent: str
    start_s: float
    end_s: float
    # a GPU task measured by the executor: from just before its start event was recorded to just
    # after its end event was (its agent's thread enqueueing the work); None: simulated, or a
    # CPU task (whose span is host time already)
    issue_start_s: float | None = None
    issue_end_s: float | None = None

    @property
    def channel(self) -> str:
        return KINDS[Kind[self.kind]].channel.name

    def shifted(self, dt_s: float) -> Record:
        """The record `dt_s` seconds later, its issue interval too."""
        later = {k: v + dt_s for k in ("issue_start_s", "issue_end_s")
                 if (v := getattr(self, k)) is not None}
        return replace(self, start_s=self.start_s + dt_s, end_s=self.end_s + dt_s, **later)


ISSUE_ARGS = ("issue_start_us", "issue_end_us")  # a Chrome trace event's args for them


def issue_args(r: Record) -> dict:
    """A Chrome trace event's args for a record's issue interval (microseconds, as ts), if any."""
    if r.issue_start_s is None or r.issue_end_s is None:
        return {}
    return dict(zip(ISSUE_ARGS, (round(r.issue_start_s * 1e6, 3), round(r.issue_end_s * 1e6, 3)),
                    strict=True))


@dataclass(frozen=True)
class Exposure:
    """An interval where a GPU's compute stream waits: on which channel and which task."""

    rank: int
    start_s: float
    end_s: float
    channel: str
    waiting_on: str  # label of the predecessor that was last to finish


class Timeline:
    def __init__(self, records: list[Record] | None = None, exposures: list[Exposure] | None = None,
                 source: str = ""):
        self.records = list(records or [])
        self.exposures = list(exposures or [])
        self.source = source  # "simulated" or "measured", with what produced it

    def add(self, rec: Record) -> None:
        self.records.append(rec)

    def kind_seconds(self) -> dict[str, float]:
        """Summed durations of the records of each task kind (not a union: concurrent tasks of a
        kind, e.g. the ranks', each count), in Kind order."""
        out = {k.name: 0.0 for k in Kind}
        for r in self.records:
            out[r.kind] += r.end_s - r.start_s
        return {k: v for k, v in out.items() if v > 0}

    def issue_overlap_s(self) -> dict[str, tuple[float, float]]:
        """Per task kind with issue intervals (measured GPU tasks), (summed span seconds, the
        part of them while the task's own issue was still under way): a GPU task's span runs from
        its start event, so the part before its agent had finished enqueueing it is the GPU
        waiting on the issuing thread (a launch-bound recompute, a copy issued late), not on
        its work."""
        out: dict[str, list[float]] = {}
        for r in self.records:
            if r.issue_start_s is None or r.issue_end_s is None:
                continue
            acc = out.setdefault(r.kind, [0.0, 0.0])
            acc[0] += r.end_s - r.start_s
            acc[1] += max(0.0, min(r.end_s, r.issue_end_s) - max(r.start_s, r.issue_start_s))
        return {k: (span, during) for k, (span, during) in out.items()}

    def compute_idle_s(self) -> dict[int, float]:
        """Per rank, the seconds its GPU's compute stream ran nothing: the timeline's span (first
        start to last end, every record) minus the union of that rank's COMPUTE records. On a
        measured step, what the host work and the transfers left exposed on that GPU."""
        if not self.records:
            return {}
        t0 = min(r.start_s for r in self.records)
        t1 = max(r.end_s for r in self.records)
        by_rank: dict[int, list[tuple[float, float]]] = {}
        for r in self.records:
            if r.channel == "COMPUTE":
                by_rank.setdefault(r.rank, []).append((r.start_s, r.end_s))
        return {k: (t1 - t0) - sum(e - s for s, e in union_intervals(iv))
                for k, iv in sorted(by_rank.items())}

    def to_rows(self) -> list[dict]:
        return [asdict(r) | {"channel": r.channel} for r in self.records]

    def save_jsonl(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for row in self.to_rows():
                f.write(json.dumps(row) + "\n")

    @staticmethod
    def load_jsonl(path: str | Path) -> Timeline:
        recs = []
        with open(path) as f:
            for line in f:
                d = json.loads(line)
                d.pop("channel", None)
                recs.append(Record(**d))
        return Timeline(recs, source=str(path))

    def chrome_trace(self) -> dict:
        """Chrome trace events: pid per rank (host = -1 -> pid 1000), tid per agent, times in us."""
        events, tids = [], {}

        def pid_of(agent: str, rank: int) -> int:
            if agent.startswith("gpu"):
                return int(agent[3:agent.index(".")])
            return 1001 if agent == "fabric" else 1000

        for r in self.records:
            pid = pid_of(r.agent, r.rank)
            tid = tids.setdefault(r.agent, len(tids))
            name = f"{r.kind} u{r.unit}" + (f" c{r.chunk}" if r.chunk >= 0 else "")
            events.append({"name": name, "cat": r.channel, "ph": "X", "pid": pid, "tid": tid,
                           "ts": round(r.start_s * 1e6, 3),
                           "dur": round(max(r.end_s - r.start_s, 0.0) * 1e6, 3),
                           "args": {"iteration": r.iteration, "rank": r.rank} | issue_args(r)})
        for e in self.exposures:
            tid = tids.setdefault(f"gpu{e.rank}.exposed", len(tids))
            events.append({"name": f"exposed: {e.channel}", "cat": "EXPOSED", "ph": "X",
                           "pid": e.rank, "tid": tid, "ts": round(e.start_s * 1e6, 3),
                           "dur": round((e.end_s - e.start_s) * 1e6, 3),
                           "args": {"waiting_on": e.waiting_on}})
        meta = []
        for agent, tid in tids.items():
            pid = pid_of(agent.replace(".exposed", ".x"), -1) if agent.startswith("gpu") else pid_of(agent, -1)
            meta.append({"name": "thread_name", "ph": "M", "pid": pid, "tid": tid, "args": {"name": agent}})
        pids = {ev["pid"] for ev in events}
        for pid in pids:
            label = {1000: "host", 1001: "fabric"}.get(pid, f"rank {pid}")
            meta.append({"name": "process_name", "ph": "M", "pid": pid, "args": {"name": label}})
        return {"traceEvents": meta + events, "displayTimeUnit": "ms",
                "otherData": {"source": self.source}}

    def save_chrome_trace(self, path: str | Path) -> None:
        write_trace_json(self.chrome_trace(), path)


def write_trace_json(doc: dict, path: str | Path) -> None:
    """A Chrome trace document as JSON, gzip-compressed when `path` ends with .gz (no time stamp
    in the gzip header: the same trace gives the same bytes)."""
    path = Path(path)
    data = json.dumps(doc).encode()
    path.write_bytes(gzip.compress(data, mtime=0) if path.name.endswith(".gz") else data)
