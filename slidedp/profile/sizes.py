"""How much each measurement moves and how often it repeats: FULL (a few minutes), QUICK, and
CHOOSER, the default chooser's cold start (slidedp/commands/default_choice.py): the host rates in
3 rounds at 1 thread, the team size and all cores only, shorter samples and a shorter sustained
layer run; it keeps every PCIe chunk size the chooser picks from (policy/routes.py CHUNK_MIB).

Host buffers are at least `host_floor_bytes` and at least `llc_multiple` times the last-level
cache, so that copies stream from DRAM; they are capped at 1/16 of RAM each (the Adam run holds
four of them). Thread counts are 1, step, step^2, ... below the core count, the core count, and
the default team size of the plan (Plan.threads: three quarters of the cores), so that the rates
the default plan runs at are measured, not interpolated.
The cast by chunk size uses the PCIe chunk sizes (`chunk_mib`, BF16 bytes on the wire). The
sustained layer run keeps GPU 0 busy for about `sustained_s` seconds per (model, seq,
micro-batch) point, half per activation policy, and at least `sustained_min_iters` iterations of
each. A host rate's timed sample repeats its kernel for at least `host_sample_s` (the quick
profile's buffers take ~40 ms an Adam pass: single passes read up to 31% apart between profiles
of one machine kind), and the host rates are sampled in `host_rounds` rounds over the
thread counts, each on freshly allocated buffers (timing.Rounds: on nvidia-h200 a rate depended
on where its buffers landed, up to 34% apart between allocations, in two groups; two 9-round
profiles on one allocation each read AdamW at 12 threads 3.70 and 4.34 Gparam/s);
`slidedp profile --host-rounds N` takes more.
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.spec.plan import Plan
from slidedp.spec.units import GIB, MIB


@dataclass(frozen=True)
class Sizes:
    host_floor_bytes: int  # one host buffer, at least
    llc_multiple: float  # ... and at least this many LLCs
    thread_step: int  # thread counts: 1, step, step^2, ..., cores
    chunk_mib: tuple[int, ...]  # H2D / D2H copy sizes, one GPU alone
    stream_copies: int  # back-to-back copies of the largest chunk per timed duplex / all-GPU run
    collective_mib: tuple[int, ...]  # NCCL message sizes (the full, unsharded buffer)
    micro_batches: tuple[int, ...]  # default --micro-batch list of the layer timing
    warmup: int  # untimed runs before the timed ones
    repeats: int  # timed runs, the median kept
    sustained_s: float = 1.5  # back-to-back layer fwd + bwd per (model, seq, micro-batch) point
    sustained_min_iters: int = 6  # ... and at least this many iterations per policy
    host_sample_s: float = 0.0  # a timed host-rate sample repeats its kernel for at least this
    host_rounds: int = 7  # rounds of the host rates over the thread counts, fresh buffers each

    def host_bytes(self, llc_bytes: int, ram_bytes: float) -> int:
        want = max(self.host_floor_bytes, int(self.llc_multiple * llc_bytes))
        return max(MIB, min(want, int(ram_bytes / 16)) // MIB * MIB)

    def chunk_bytes(self) -> list[int]:
        """The PCIe chunk sizes in bytes (BF16 bytes on the wire): the copies', the cast's and
        the teams' by chunk size."""
        return [c * MIB for c in self.chunk_mib]

    def threads(self, cores: int) -> list[int]:
        out, n = {cores, *Plan().threads(cores)}, 1
        while n < cores:
            out.add(n)
            n *= self.thread_step
        return sorted(out)


FULL = Sizes(host_floor_bytes=GIB, llc_multiple=4, thread_step=2, chunk_mib=(4, 16, 64, 256),
             stream_copies=8, collective_mib=(16, 64, 256), micro_batches=(1, 4, 16),
             warmup=2, repeats=7, sustained_s=3.0, sustained_min_iters=8, host_sample_s=0.25,
             host_rounds=9)
QUICK = Sizes(host_floor_bytes=256 * MIB, llc_multiple=2, thread_step=4, chunk_mib=(16, 64, 256),
              stream_copies=4, collective_mib=(64, 256), micro_batches=(1, 4), warmup=1,
              repeats=3, sustained_s=1.5, sustained_min_iters=6, host_sample_s=0.1)
# thread_step above any core count: the thread counts are 1, the team size and all cores
CHOOSER = Sizes(host_floor_bytes=256 * MIB, llc_multiple=2, thread_step=1 << 16,
                chunk_mib=(16, 64, 256), stream_copies=4, collective_mib=(64, 256),
                micro_batches=(4,), warmup=1, repeats=3, sustained_s=1.0, sustained_min_iters=4,
                host_sample_s=0.05, host_rounds=3)
