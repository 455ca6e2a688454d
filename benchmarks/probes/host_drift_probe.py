"""Does the host's speed drift, or are its rate samples just noisy? A time series of the profile's
own host samples.

For `--seconds`, back to back: one AdamW sample and one cast sample at the default team size
(profile.host.HostBench, the quick profile's buffers and 0.1 s samples), then one teams-at-once
run (HostBench.teams_bps, 0.25 s). Every sample is kept with its time. The summary gives, per
kernel: the median, the spread (max / min - 1), the coefficient of variation, the lag-1
autocorrelation (near 0: independent noise, which more rounds average away; near 1: a slow drift,
which they do not) and the medians of the first and the second half of the series.

    python3 benchmarks/probes/host_drift_probe.py OUT.json [--seconds 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from slidedp.profile.host import quick_bench
from slidedp.profile.machine import probe_machine
from slidedp.profile.run import TEAMS_S_PER_ROUND
from slidedp.spec.plan import team_cores


def lag1_autocorrelation(xs: list[float]) -> float:
    mean = statistics.fmean(xs)
    var = sum((x - mean) ** 2 for x in xs)
    if len(xs) < 3 or var == 0:
        return 0.0
    return sum((a - mean) * (b - mean) for a, b in zip(xs, xs[1:], strict=False)) / var


def describe(xs: list[float]) -> dict:
    half = len(xs) // 2
    return {"n": len(xs), "median": statistics.median(xs), "spread": max(xs) / min(xs) - 1,
            "cv": statistics.pstdev(xs) / statistics.fmean(xs),
            "lag1_autocorrelation": lag1_autocorrelation(xs),
            "first_half_median": statistics.median(xs[:half] or xs),
            "second_half_median": statistics.median(xs[half:])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--seconds", type=float, default=60.0)
    args = ap.parse_args()
    m = probe_machine()
    team = team_cores(m.cores)
    bench = quick_bench(m, warm_threads=team)
    series: dict[str, list[tuple[float, float]]] = {"adam": [], "cast": [], "teams": []}
    t0 = time.perf_counter()
    while (now := time.perf_counter() - t0) < args.seconds:
        series["adam"].append((now, bench.adam_params_per_s(team)))
        series["cast"].append((time.perf_counter() - t0, bench.cast_elems_per_s(team)))
        series["teams"].append((time.perf_counter() - t0,
                                bench.teams_bps(team, team, TEAMS_S_PER_ROUND)[0]))
    stats = {k: describe([r for _, r in v]) for k, v in series.items()}
    doc = {"machine": m.line(),
           "threads": team,
           "units": "adam params/s, cast elements/s, teams bytes/s", "stats": stats,
           "series": {k: [[round(t, 3), r] for t, r in v] for k, v in series.items()}}
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    for k, s in stats.items():
        print(f"{k:5s} n {s['n']:3d}  median {s['median'] / 1e9:7.2f}e9  spread {s['spread']:4.0%}"
              f"  cv {s['cv']:4.1%}  lag-1 autocorr {s['lag1_autocorrelation']:+.2f}  halves "
              f"{s['first_half_median'] / 1e9:.2f} / {s['second_half_median'] / 1e9:.2f}e9")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
