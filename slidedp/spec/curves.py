"""Measured rate curves and tables: piecewise-linear interpolation that saturates at the ends.

A RateCurve maps a size (threads, tokens, hidden width) to a rate; beyond the last point the rate
stays at the last value (saturation), below the first point it stays at the first value.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass

from slidedp.spec.errors import SpecError


@dataclass(frozen=True)
class RateCurve:
    """Rate against x, with the unit of the rate and where the points come from."""

    xs: tuple[float, ...]
    rates: tuple[float, ...]
    unit: str
    source: str

    def at(self, x: float) -> float:
        xs, ys = self.xs, self.rates
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return y0 + (y1 - y0) * (x - x0) / (x1 - x0)

    def scaled(self, factor: float) -> RateCurve:
        return RateCurve(self.xs, tuple(r * factor for r in self.rates), self.unit, self.source)

    @staticmethod
    def from_pairs(pairs: list, where: str, field: str, unit: str, source: str) -> RateCurve:
        """Build from [[x, rate], ...]; xs strictly increasing, rates positive."""
        if not isinstance(pairs, list) or not pairs:
            raise SpecError(where, field, "a non-empty list of [x, rate] pairs")
        xs, ys = [], []
        for p in pairs:
            ok = isinstance(p, list) and len(p) == 2
            ok = ok and all(isinstance(v, int | float) and not isinstance(v, bool) for v in p)
            if not ok:
                raise SpecError(where, field, f"[x, rate] pairs of numbers, got {p!r}")
            if p[1] <= 0 or p[0] <= 0:
                raise SpecError(where, field, f"positive x and rate, got {p!r}")
            xs.append(float(p[0]))
            ys.append(float(p[1]))
        if any(b <= a for a, b in zip(xs, xs[1:], strict=False)):
            raise SpecError(where, field, "x values strictly increasing")
        return RateCurve(tuple(xs), tuple(ys), unit, source)


def log_between(keys: list[float], x: float, value: Callable[[float], float]) -> float:
    """value(x) from its values at sorted `keys`: linear in log x between the two keys around x,
    clamped at the first and last key (the measured range)."""
    if x <= keys[0]:
        return value(keys[0])
    if x >= keys[-1]:
        return value(keys[-1])
    i = bisect.bisect_right(keys, x)
    k0, k1 = keys[i - 1], keys[i]
    w = (math.log(x) - math.log(k0)) / (math.log(k1) - math.log(k0))
    return (1 - w) * value(k0) + w * value(k1)
