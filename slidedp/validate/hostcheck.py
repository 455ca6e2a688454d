"""The host check of a validation run: the profile's host kernels sampled again just before each
run of a case group, so that a host-bound case's error can be told apart from the machine's
own spread.

On nvidia-h200 a host rate depends on where its buffers land (AdamW at 12 threads 3.25-4.35
Gparam/s over ten fresh allocations, benchmarks/probes/host_placement_probe.py), and one lease's
executor ran its update 8-39% slower than simulated on a profile that read AdamW like another
lease's, where the same cases were predicted within 6%. A check on fresh buffers
(profile.host.HostBench, the quick profile's buffer size and samples: AdamW and the cast at the
executor's default team size, CHECK_SAMPLES samples each, then one teams-at-once run, ~2 s)
says whether the machine itself read slower at that moment. Fresh buffers cannot show where the
executor's own host state landed, so after a one-GPU run the state check (state_adam_rate) times
one AdamW pass over that state (the executor's update in isolation, on the memory it ran on),
its gradient chunks taken in turn from a ring several times the LLC: one reused gradient chunk
stays in the LLC and read 10-28% faster than a cold one (benchmarks/probes/adam_after_d2h_probe.py
`reused` against `cold`), where the executor's gradients, just written by the
D2H, read like cold ones (`after_d2h`).
Both are reported beside the case (measured.json `host_check`, each run's in `run_host_checks`;
predicted.json `host_check_vs_profile`, the rates over the hardware file's), never fed into the
prediction: the hardware numbers come from the profile only. To explain an error, predicted.json
also gives `simulated_at_state_adam`: the same simulation with the profile's AdamW curves scaled
by the state check's ratio (at_state_adam): what the step would have been predicted at had the
profile's buffers read as the state did.
"""

from __future__ import annotations

import time

from slidedp.spec.hardware import HardwareSpec

CHECK_SAMPLES = 3
KERNELS = ("adam", "cast", "teams", "state adam")  # against_profile's ratios
STATE_CHUNK_ELEMS = 16 * 2**20  # the state check's chunks: 64 MiB of FP32, the default chunk
GRAD_RING_LLCS = 8  # the state check's gradient ring: at least this many LLCs (and 1 GiB)
GRAD_RING_MIN_BYTES = 1 << 30


def host_check() -> dict:
    """The check's rates on this machine (module docstring): {"threads", "adam_gparam_per_s",
    "cast_gelem_per_s", "teams_gbps", "seconds", "what"}."""
    # the profile's benches load torch: here, not where a prediction reads a stored check
    from slidedp.profile.host import quick_bench
    from slidedp.profile.machine import probe_machine
    from slidedp.profile.run import TEAMS_S_PER_ROUND
    from slidedp.profile.sizes import QUICK
    from slidedp.profile.timing import Rounds
    from slidedp.spec.plan import team_cores

    t0 = time.perf_counter()
    m = probe_machine()
    team = team_cores(m.cores)
    bench = quick_bench(m)
    nbytes = bench.nbytes
    rounds = Rounds()
    for _ in range(CHECK_SAMPLES):
        rounds.add(("adam",), bench.adam_params_per_s(team))
        rounds.add(("cast",), bench.cast_elems_per_s(team))
        bench.warmup = 0
    teams_bps = bench.teams_bps(team, team, TEAMS_S_PER_ROUND)[0]
    return {"threads": team, "adam_gparam_per_s": rounds.rate(("adam",)) / 1e9,
            "cast_gelem_per_s": rounds.rate(("cast",)) / 1e9, "teams_gbps": teams_bps / 1e9,
            "seconds": time.perf_counter() - t0,
            "what": f"slidedp.validate.hostcheck on fresh {nbytes >> 20} MiB buffers: AdamW and "
                    f"the cast at {team} threads, {CHECK_SAMPLES} samples of "
                    f"{QUICK.host_sample_s:g} s each, then the teams at once for "
                    f"{TEAMS_S_PER_ROUND:g} s"}


def grad_ring_bytes(llc_bytes: int) -> int:
    """The state check's gradient ring on a machine of `llc_bytes` of last-level cache:
    GRAD_RING_LLCS LLCs, at least GRAD_RING_MIN_BYTES."""
    return max(GRAD_RING_LLCS * llc_bytes, GRAD_RING_MIN_BYTES)


def grad_ring_slots(unit_numels, ring_bytes: int) -> tuple[int, int]:
    """(slots, elements per slot) of the state check's gradient ring for a state of units of
    `unit_numels`: one slot per STATE_CHUNK_ELEMS chunk (or the largest unit, if smaller), as
    many as `ring_bytes` hold, at least two, never more than the state has chunks."""
    chunk = min(STATE_CHUNK_ELEMS, max(unit_numels))
    chunks = sum(-(-n // STATE_CHUNK_ELEMS) for n in unit_numels)
    return min(chunks, max(2, ring_bytes // (4 * chunk))), chunk


def state_adam_rate(hs, threads: int, ring_bytes: int) -> tuple[float, int]:
    """(parameters/s, the gradient ring's bytes) of one AdamW pass (exec.adamw.adamw_chunk,
    FP32 gradient) over every unit of the host state `hs` (exec.host_state.HostState) at
    `threads` threads, in chunks of STATE_CHUNK_ELEMS, each chunk's gradient the next slot of a
    ring (grad_ring_slots) of `ring_bytes` (grad_ring_bytes), at most a quarter of the free RAM,
    so that every gradient is read from DRAM as the executor's are (module docstring): the
    executor's update in isolation on the memory it ran on. It changes the state: run it on a
    finished run's."""
    import os

    import torch

    from slidedp.exec.adamw import AdamWConfig, adamw_chunk
    from slidedp.profile.host import torch_threads

    free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    slots, chunk = grad_ring_slots(hs.unit_numels, min(ring_bytes, free // 4))
    ring = torch.full((slots, chunk), 1e-3)
    cfg, params, k = AdamWConfig(), 0, 0
    with torch_threads(threads):
        t0 = time.perf_counter()
        for u in range(hs.n_units):
            p, m, v = hs.unit_master(u), hs.unit_m(u), hs.unit_v(u)
            for lo in range(0, len(p), STATE_CHUNK_ELEMS):
                hi = min(len(p), lo + STATE_CHUNK_ELEMS)
                adamw_chunk(p[lo:hi], ring[k % slots][:hi - lo], m[lo:hi], v[lo:hi], 1, cfg,
                            cfg.lr)
                params, k = params + hi - lo, k + 1
        return params / (time.perf_counter() - t0), ring.numel() * 4


def against_profile(check: dict, hw: HardwareSpec) -> dict[str, float]:
    """The check's rates over the hardware file's at the check's threads, by kernel (the teams
    where the file measured them at the same team sizes; the state's AdamW where it was timed,
    over the file's AdamW). The file's rates may come from larger
    buffers and longer samples (a full profile): the check's are the quick profile's."""
    host, n = hw.host, check["threads"]
    out = {"adam": check["adam_gparam_per_s"] * 1e9 / host.adam_rate(n),
           "cast": check["cast_gelem_per_s"] * 1e9 / host.cast_rate(n)}
    if host.dram_teams is not None and host.dram_teams[:2] == (n, n):
        out["teams"] = check["teams_gbps"] * 1e9 / host.dram_teams[2]
    if "state_adam_gparam_per_s" in check:
        out["state adam"] = check["state_adam_gparam_per_s"] * 1e9 / host.adam_rate(n)
    return out


def at_state_adam(hw: HardwareSpec, ratio: float) -> HardwareSpec:
    """`hw` with its AdamW curves (FP32 and BF16 gradient) scaled by `ratio`, the state check's
    AdamW over the file's (module docstring); the rest as HostSpec.with_rates leaves it."""
    return hw.with_host_rates(f"at the state's AdamW x{ratio:.3f}", adam=ratio)
