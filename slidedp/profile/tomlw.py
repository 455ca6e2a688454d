"""A small TOML writer for the hardware document (the standard library reads TOML, not writes it).

Values: str, int, float (finite), lists of those or of lists, dicts. Within a table, plain keys
come first; a dict of numbers is written inline (`efficiency = { ... }`), any other dict as a
sub-table (`[gpu.sources]`), and a list of dicts as an array of tables (`[[gpu.layer_time]]`).
"""

from __future__ import annotations

import json
import math


def _value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        if not math.isfinite(v):
            raise ValueError(f"TOML has no {v}")
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)  # a JSON string is a valid TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    if isinstance(v, dict) and _inline(v):
        return "{ " + ", ".join(f"{k} = {_value(x)}" for k, x in v.items()) + " }"
    raise TypeError(f"cannot write {type(v).__name__} as a TOML value")


def _inline(v) -> bool:
    return isinstance(v, dict) and all(isinstance(x, int | float) for x in v.values())


def _table(name: str, t: dict, out: list[str], header: str) -> None:
    out.append(header)
    subs, arrays = [], []
    for k, v in t.items():
        if isinstance(v, dict) and not _inline(v):
            subs.append((k, v))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            arrays.append((k, v))
        else:
            out.append(f"{k} = {_value(v)}")
    for k, v in subs:
        _table(f"{name}.{k}", v, out, f"[{name}.{k}]")
    for k, rows in arrays:
        for row in rows:
            _table(f"{name}.{k}", row, out, f"[[{name}.{k}]]")


def dumps(doc: dict[str, dict], comment: str = "") -> str:
    """TOML text of `doc`, a dict of top-level tables, with `comment` lines first."""
    out = [f"# {line}" if line else "#" for line in comment.splitlines()]
    for name, t in doc.items():
        if out:
            out.append("")
        _table(name, t, out, f"[{name}]")
    return "\n".join(out) + "\n"
