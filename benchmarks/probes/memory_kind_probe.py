"""Do CPU AdamW and the cast run at the same rate on the host state's kind of memory (/dev/shm
mappings) as on the process's own (anonymous) memory? (issue 6: on nvidia-h200, 2026-12-01, the
profile of the 13:09 lease measured AdamW at 12 threads 44% faster than that of the 08:29 lease,
5.02 against 3.49 Gparam/s, while the executor's update channel ran Qwen3-8B at ~102 GB/s of state
traffic on both; the profile then timed its kernels on anonymous memory, which the kernel may back
with transparent huge pages, and the executor on /dev/shm, which it backs with 4 KiB pages unless
`shmem_enabled` says otherwise: in a VM every TLB miss walks two page tables.)

    python3 benchmarks/probes/memory_kind_probe.py OUT.json [--mib 600] [--threads 12 16] [--rounds 2]

Runs slidedp.profile.host.HostBench (the profile's own kernels and timing) once per memory kind
and round, the kinds alternating (shm, anon, shm, anon, ...), each at every --threads: AdamW
parameters/s, the cast's elements/s, the copy's DRAM bytes/s. Writes the rows with the machine's
transparent-huge-page modes and, per run, how much of the process's memory the kernel backed
with huge pages (/proc/self/smaps_rollup: AnonHugePages, ShmemPmdMapped).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
from slidedp.exec.host_state import private_shared  # noqa: E402
from slidedp.profile.host import ADAM_DRAM_BYTES_PER_PARAM, HostBench  # noqa: E402
from slidedp.profile.machine import huge_pages  # noqa: E402
from slidedp.spec.plan import team_cores  # noqa: E402

MIB = 1 << 20
KINDS = {"shm": private_shared, "anon": lambda n, dtype: torch.empty(n, dtype=dtype)}


def huge_kib() -> dict[str, int]:
    """AnonHugePages and ShmemPmdMapped of this process, KiB."""
    out = {}
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("AnonHugePages", "ShmemPmdMapped"):
                out[key] = int(rest.split()[0])
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--mib", type=int, default=600, help="each buffer (the profile's: 600)")
    ap.add_argument("--threads", type=int, nargs="+",
                    default=sorted({team_cores(os.cpu_count() or 1), os.cpu_count() or 1}))
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--sample-s", type=float, default=0.1)
    a = ap.parse_args()
    rows = []
    for rnd in range(a.rounds):
        for kind, alloc in KINDS.items():
            bench = HostBench(a.mib * MIB, 1, 3, a.sample_s, state_memory=alloc)
            pages = huge_kib()
            for n in a.threads:
                adam = bench.adam_params_per_s(n)
                row = {"round": rnd, "memory": kind, "threads": n,
                       "adam_gparam_per_s": adam / 1e9,
                       "adam_state_gbps": adam * ADAM_DRAM_BYTES_PER_PARAM / 1e9,
                       "cast_gelem_per_s": bench.cast_elems_per_s(n) / 1e9,
                       "copy_gbps": bench.dram_bps(n) / 1e9, **pages}
                rows.append(row)
                print(json.dumps(row), flush=True)
            del bench
            gc.collect()
    doc = {"huge_pages": huge_pages(), "mib": a.mib, "cpus": os.cpu_count(), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
