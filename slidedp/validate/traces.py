"""Timelines in and out of Chrome traces, and the steady step of a simulated run.

A Chrome trace written by Timeline.chrome_trace() holds everything a Timeline holds: a task event's
name is "KIND u<unit>[ c<chunk>]", its args hold iteration and rank, its thread (named in the
metadata events) is the agent; an "EXPOSED" event is an Exposure. So a stored trace is the stored
Timeline: load_trace() reads it back for plots and comparisons.

Traces are stored gzip-compressed (NAME.json.gz: Perfetto and chrome://tracing open it as it is);
every reader also takes the plain NAME.json (an older store, a trace handed in): read_trace_doc
tells the two apart by their first bytes, find_trace looks for either name.
"""

from __future__ import annotations

import gzip
import json
from dataclasses import replace
from pathlib import Path

from slidedp.graph.timeline import ISSUE_ARGS, Exposure, Record, Timeline, write_trace_json

US = 1e-6
GZIP_MAGIC = b"\x1f\x8b"


def trace_names(path: Path) -> tuple[Path, ...]:
    """path and, for NAME.json.gz, the plain NAME.json that holds the same trace uncompressed."""
    path = Path(path)
    plain = path.with_name(path.name.removesuffix(".gz"))
    return (path, plain) if plain != path else (path,)


def find_trace(path: Path) -> Path | None:
    """The trace file at path or, where path names NAME.json.gz, the plain NAME.json beside it;
    None when neither exists."""
    return next((p for p in trace_names(path) if p.is_file()), None)


def read_trace_doc(path: Path) -> dict:
    """A Chrome trace's JSON document, from a gzip file or a plain one (whatever its name)."""
    data = Path(path).read_bytes()
    return json.loads(gzip.decompress(data) if data[:2] == GZIP_MAGIC else data)


def write_trace_doc(doc: dict, path: Path) -> None:
    """A Chrome trace's JSON document (graph.timeline.write_trace_json: gzip-compressed when path
    ends with .gz). The plain NAME.json of a NAME.json.gz is removed: it held an older copy of
    the same trace."""
    write_trace_json(doc, path)
    for other in trace_names(Path(path))[1:]:
        other.unlink(missing_ok=True)


def save_trace(tl: Timeline, path: Path) -> None:
    """A Timeline as a stored Chrome trace (write_trace_doc)."""
    write_trace_doc(tl.chrome_trace(), path)


def load_trace(path: Path) -> Timeline:
    """The Timeline of a Chrome trace file, gzip-compressed or plain."""
    doc = read_trace_doc(path)
    events = doc["traceEvents"]
    agents = {ev["tid"]: ev["args"]["name"] for ev in events
              if ev.get("ph") == "M" and ev["name"] == "thread_name"}
    recs, exps = [], []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        s, e = ev["ts"] * US, (ev["ts"] + ev["dur"]) * US
        if ev["cat"] == "EXPOSED":
            exps.append(Exposure(ev["pid"], s, e, ev["name"].removeprefix("exposed: "),
                                 ev["args"]["waiting_on"]))
            continue
        kind, unit, *chunk = ev["name"].split()
        args = ev["args"]
        issue = [args[k] * US if k in args else None for k in ISSUE_ARGS]
        recs.append(Record(args["iteration"], kind, int(unit[1:]), args["rank"],
                           int(chunk[0][1:]) if chunk else -1, agents[ev["tid"]], s, e, *issue))
    return Timeline(recs, exps, source=doc.get("otherData", {}).get("source", str(path)))


def steady_step(tl: Timeline) -> Timeline:
    """The last iteration alone, shifted so that the previous iteration's end is time 0 (a
    simulated run's steady step on the clock of a measured step), its exposures clipped to it."""
    last = max(r.iteration for r in tl.records)
    t0 = max((r.end_s for r in tl.records if r.iteration == last - 1), default=0.0)
    recs = [r.shifted(-t0) for r in tl.records if r.iteration == last]
    t1 = max(r.end_s for r in recs)
    exps = [replace(e, start_s=max(e.start_s - t0, 0.0), end_s=min(e.end_s - t0, t1))
            for e in tl.exposures if e.end_s > t0 and e.start_s < t0 + t1]
    return Timeline(recs, exps, source=tl.source + " (steady step)")
