"""Does a host rate depend on where its buffers landed? The profile's host samples on several
fresh allocations of the same buffers.

On 2026-12-01 17:57 the two runs of one validation case on nvidia-h200, each on a host state of
its own, ran steady within themselves but 2.26 and 1.88 s a step apart, while 9 rounds of the
profile's samples on one set of buffers agreed with another profile's 9 rounds within ~3%. If
the speed is set by the buffers' physical placement (a VM's memory spread over the host's
memory in a way the guest cannot see), samples on one allocation cannot average it away.

For each of `--sets` allocations (profile.host.HostBench with the quick profile's buffer size,
or each of `--mib` sizes; the master, m and v on /dev/shm as the executor's host state, or
`--memory anonymous`): a few AdamW and cast samples at the default team size and a teams-at-once
run; then the buffers are freed. The summary sets the spread between allocations (of each set's
median) beside the spread within one (of its samples), per buffer size: does a large
allocation, as the executor's host state (16 B a parameter), run slower than the profile's?

    python3 benchmarks/probes/host_placement_probe.py OUT.json [--sets 10] [--samples 5] [--mib 600 9600]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from slidedp.exec.host_state import private_shared
from slidedp.profile.host import quick_bench
from slidedp.profile.machine import probe_machine
from slidedp.profile.run import TEAMS_S_PER_ROUND
from slidedp.profile.sizes import QUICK
from slidedp.spec.plan import team_cores

MEMORY = {"shm": private_shared, "anonymous": lambda n, dtype: torch.empty(n, dtype=dtype)}


def spread(xs: list[float]) -> float:
    return max(xs) / min(xs) - 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--sets", type=int, default=10)
    ap.add_argument("--samples", type=int, default=5)
    ap.add_argument("--memory", choices=sorted(MEMORY), nargs="+", default=["shm", "anonymous"])
    ap.add_argument("--mib", type=int, nargs="+", help="buffer sizes, MiB each (default: the "
                    "quick profile's)")
    args = ap.parse_args()
    m = probe_machine()
    team = team_cores(m.cores)
    sizes = [n * 2**20 for n in args.mib] if args.mib else [QUICK.host_bytes(m.llc_bytes,
                                                                                m.ram_bytes)]
    doc = {"machine": m.line(),
           "threads": team, "units": "adam params/s, cast elements/s, teams bytes/s",
           "sets": {}}
    for kind, nbytes in ((k, n) for n in sizes for k in args.memory):
        sets = []
        for _ in range(args.sets):
            bench = quick_bench(m, nbytes, MEMORY[kind], warm_threads=team)
            sets.append({"adam": [bench.adam_params_per_s(team) for _ in range(args.samples)],
                         "cast": [bench.cast_elems_per_s(team) for _ in range(args.samples)],
                         "teams": [bench.teams_bps(team, team, TEAMS_S_PER_ROUND)[0]
                                   for _ in range(2)]})
            del bench
            gc.collect()
        label = f"{kind} {nbytes >> 20} MiB"
        doc["sets"][label] = sets
        for k in ("adam", "cast", "teams"):
            medians = [statistics.median(s[k]) for s in sets]
            within = statistics.median(spread(s[k]) for s in sets)
            print(f"{label:19s} {k:5s} set medians "
                  f"{min(medians) / 1e9:.2f}-{max(medians) / 1e9:.2f}e9"
                  f" (between sets {spread(medians):4.0%}; within a set, median {within:4.0%})"
                  f"  [{', '.join(f'{x / 1e9:.2f}' for x in medians)}]")
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
