"""Element ranges and byte sizes the graph builder, the executor and the memory model share.

Bytes per element: PARAM_BYTES on the wire up (BF16, q in method.md section 3), GRAD_BYTES of a
gradient on the GPU (BF16, what REDUCE moves), FP32_BYTES of the master, the moments and a
widened gradient. Ranges are half-open [lo, hi) element ranges of a unit.
"""

from __future__ import annotations

from slidedp.spec.elements import FP32_BYTES
from slidedp.spec.plan import Plan, UpdateSharding, team_cores
from slidedp.spec.units import MIB


def host_sum_bytes_per_elem(ranks: int) -> int:
    """Host-memory bytes a HOST_SUM of `ranks` FP32 chunks moves per element: R - 1 additions,
    each reading two chunks and writing one (staging.add_chunks), then the sum's squares for the
    gradient norm (one more read: engine._run_host_sum)."""
    return FP32_BYTES * (3 * (ranks - 1) + 1)


def team_share(team_threads: float, cores: float) -> float:
    """Fraction of its threads' speed an OpenMP team of `team_threads` keeps on a host of `cores`:
    min(1, plan.team_cores(cores) / team_threads), team_cores = cores - cores // 4.

    The executor gives every CPU agent its own OpenMP team for the whole run (the cast agent
    cast_threads, each update worker update_threads / workers; engine._cpu_threads). An OpenMP op
    splits its work statically into one part per thread, so a team that needs more cores than the
    ones left after the agents' own threads (the GPU agents' Python threads, the notifier, the
    communicator: a quarter of the cores is reserved for them) waits on its preempted threads and
    runs at this fraction of its own rate curve. Teams of different agents that run at the same
    time share the cores in the simulator (host.cores), not here. Measured on nvidia-h200-x2 (32
    cores, Qwen3-8B mb 4, window 36, validation cases h200x2-1621-*): cast 24 + update 24 threads
    2.67 s, 16 + 16 2.92 s, 8 + 24 3.11 s (teams within 24 cores: share 1; the 8-thread cast is
    slow on its own curve); two 32-thread teams took the update x1.40 and the cast x1.53 longer
    than their 32-thread rates, this rule says x1.33. Teams beyond the cores do not slow each
    other while only one of them runs (with window = L the cast runs in the forward and the
    update in the backward).
    """
    return min(1.0, team_cores(int(cores)) / team_threads) if team_threads > 0 else 1.0


def chunk_ranges(lo: int, hi: int, chunk_elems: int) -> list[tuple[int, int]]:
    """Split [lo, hi) into consecutive chunks of at most chunk_elems elements."""
    out = []
    while lo < hi:
        out.append((lo, min(hi, lo + chunk_elems)))
        lo += chunk_elems
    return out


def shard_ranges(n: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, n) into `parts` contiguous shards as equal as possible."""
    return [(n * p // parts, n * (p + 1) // parts) for p in range(parts)]


def update_shards(n: int, R: int, align: int = 1) -> list[tuple[int, int]]:
    """The R update shares of n elements (sharded update): shard_ranges in units of `align`."""
    return [(a * align, z * align) for a, z in shard_ranges(n // align, R)]


def grad_chunks(n: int, R: int, plan: Plan, wire: int, align: int = 1) -> list[tuple[int, int, int]]:
    """The gradient chunks (update worker, lo, hi) of n elements: D2H-chunk sized at `wire`
    bytes per element, each update process (R of them when the update is sharded) taking a
    contiguous share; every boundary a multiple of `align` (n must be one)."""
    scatter = plan.update_sharding == UpdateSharding.SHARDED and R > 1
    d2h_chunk = max(align, int(plan.d2h_chunk_mib * MIB) // wire // align * align)
    chunks = []
    for p, (lo, hi) in enumerate(update_shards(n, R, align) if scatter else [(0, n)]):
        for k, (a, z) in enumerate(chunk_ranges(lo, hi, d2h_chunk)):
            chunks.append((p * plan.update_workers + k % plan.update_workers, a, z))
    return chunks
