"""Timelines in and out of Chrome traces, and the steady step of a simulated run.

A Chrome trace written by Timeline.chrome_trace() holds everything a Timeline holds: a task event's
name is "KIND u<unit>[ c<chunk>]", its args hold iteration and rank, its thread (named in the
metadata events) is the agent; an "EXPOSED" event is an Exposure. So a stored trace is the stored
Timeline: load_trace() reads it back for plots and comparisons.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from slidedp.graph.timeline import Exposure, Record, Timeline

US = 1e-6


def save_trace(tl: Timeline, path: Path) -> None:
    """Chrome trace JSON, times rounded to the nanosecond (smaller files, nothing lost that a
    measured clock resolves)."""
    doc = tl.chrome_trace()
    for ev in doc["traceEvents"]:
        for k in ("ts", "dur"):
            if k in ev:
                ev[k] = round(ev[k], 3)
    Path(path).write_text(json.dumps(doc))


def load_trace(path: Path) -> Timeline:
    doc = json.loads(Path(path).read_text())
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
        recs.append(Record(ev["args"]["iteration"], kind, int(unit[1:]), ev["args"]["rank"],
                           int(chunk[0][1:]) if chunk else -1, agents[ev["tid"]], s, e))
    return Timeline(recs, exps, source=doc.get("otherData", {}).get("source", str(path)))


def steady_step(tl: Timeline) -> Timeline:
    """The last iteration alone, shifted so that the previous iteration's end is time 0 (a
    simulated run's steady step on the clock of a measured step), its exposures clipped to it."""
    last = max(r.iteration for r in tl.records)
    t0 = max((r.end_s for r in tl.records if r.iteration == last - 1), default=0.0)
    recs = [replace(r, start_s=r.start_s - t0, end_s=r.end_s - t0)
            for r in tl.records if r.iteration == last]
    t1 = max(r.end_s for r in recs)
    exps = [replace(e, start_s=max(e.start_s - t0, 0.0), end_s=min(e.end_s - t0, t1))
            for e in tl.exposures if e.end_s > t0 and e.start_s < t0 + t1]
    return Timeline(recs, exps, source=tl.source + " (steady step)")
