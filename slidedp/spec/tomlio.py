"""Typed reading of TOML tables: every accessor names the file and the dotted field on error."""

from __future__ import annotations

import math
import tomllib
from pathlib import Path
from types import MappingProxyType
from typing import Any

from slidedp.spec.errors import SpecError


def read_toml(path: str | Path) -> dict[str, Any]:
    """Parse a TOML file; a missing file or a syntax error becomes a SpecError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise SpecError(str(p), "<file>", "file does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise SpecError(str(p), "<syntax>", f"valid TOML ({e})") from None


class Table:
    """A view on one TOML table that tracks which keys were read, so unknown keys are reported."""

    def __init__(self, data: dict[str, Any], where: str, prefix: str = ""):
        if not isinstance(data, dict):
            raise SpecError(where, prefix or "<root>", "a table")
        self.data, self.where, self.prefix = data, where, prefix
        self.used: set[str] = set()

    def _name(self, key: str) -> str:
        return f"{self.prefix}.{key}" if self.prefix else key

    def has(self, key: str) -> bool:
        return key in self.data

    def raw(self, key: str, default: Any = ...) -> Any:
        self.used.add(key)
        if key not in self.data:
            if default is ...:
                raise SpecError(self.where, self._name(key), "required but missing")
            return default
        return self.data[key]

    def num(self, key: str, default: Any = ..., positive: bool = True, allow_zero: bool = False) -> float:
        v = self.raw(key, default)
        if v is None:
            return v
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise SpecError(self.where, self._name(key), f"a number, got {v!r}")
        if positive and (v < 0 or (v == 0 and not allow_zero)):
            raise SpecError(self.where, self._name(key), f"a positive number, got {v!r}")
        return float(v)

    def int(self, key: str, default: Any = ..., minimum: int = 1) -> int:
        v = self.raw(key, default)
        if isinstance(v, bool) or not isinstance(v, int):
            raise SpecError(self.where, self._name(key), f"an integer, got {v!r}")
        if v < minimum:
            raise SpecError(self.where, self._name(key), f"an integer >= {minimum}, got {v}")
        return v

    def str(self, key: str, default: Any = ..., choices: tuple[str, ...] | None = None) -> str:
        v = self.raw(key, default)
        if not isinstance(v, str):
            raise SpecError(self.where, self._name(key), f"a string, got {v!r}")
        if choices is not None and v not in choices:
            raise SpecError(self.where, self._name(key), f"one of {', '.join(choices)}, got {v!r}")
        return v

    def bool(self, key: str, default: Any = ...) -> bool:
        v = self.raw(key, default)
        if not isinstance(v, bool):
            raise SpecError(self.where, self._name(key), f"true or false, got {v!r}")
        return v

    def sub(self, key: str, default: Any = ...) -> Table:
        v = self.raw(key, default)
        return Table(v, self.where, self._name(key))

    def subs(self, key: str) -> list[Table]:
        """An array of tables ([[key]])."""
        v = self.raw(key)
        if not isinstance(v, list) or not v:
            raise SpecError(self.where, self._name(key), "a non-empty array of tables")
        return [Table(x, self.where, f"{self._name(key)}[{i}]") for i, x in enumerate(v)]

    def done(self) -> None:
        """Reject keys that no accessor read (catches misspellings)."""
        extra = sorted(set(self.data) - self.used)
        if extra:
            raise SpecError(self.where, self._name(extra[0]), "unknown key (misspelled?)")


def sources_of(t: Table, keys: list[str]) -> MappingProxyType:
    """Each key's source: the table's `source`, or its own in the `sources` sub-table."""
    default = t.str("source")
    over = t.sub("sources", {})
    out = {k: (over.str(k) if over.has(k) else default) for k in keys}
    over.done()
    return MappingProxyType(out)


def triples(rows, where: str, name: str, shape: str, width: int = 3) -> list[list]:
    """A table of rows of `width` (3) positive finite numbers (`shape` names them), else
    SpecError."""
    if not isinstance(rows, list):
        raise SpecError(where, name, f"a list of {shape}, got {rows!r}")
    for r in rows:
        if not (isinstance(r, list) and len(r) == width
                and all(isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)
                        and v > 0 for v in r)):
            raise SpecError(where, name, f"{shape} positive numbers, got {r!r}")
    return rows
