"""`slidedp profile` on the CPU: the host measurements with tiny sizes, the written TOML against
the hardware schema, what comes from --base, and the pure parts (topology, TOML writer, sizes).

The GPU paths are covered twice: here through hand-made results for a fake 2-GPU machine (the
assembly and its sources), and on the device by tests/test_profile_gpu.py (the measurements).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from slidedp.commands import profile as profile_cmd
from slidedp.exec.host_state import SHM_DIR
from slidedp.graph.timeline import Record
from slidedp.profile import agents
from slidedp.profile import host as host_mod
from slidedp.profile import machine as machine_mod
from slidedp.profile import sizes as sizes_mod
from slidedp.profile.assemble import Assembler, unmeasured
from slidedp.profile.compute import LayerTiming, build_layer, forward, one_layer_config, rope
from slidedp.profile.fabric import LATENCY_BYTES, fabric_kind, gpu_link_matrix
from slidedp.profile.machine import Machine, probe_machine
from slidedp.profile.run import Profiler, Request, Results, dma_weight_sample
from slidedp.profile.sizes import MIB, Sizes
from slidedp.profile.summary import round_spreads, unsteady
from slidedp.profile.timing import Rounds, run_together
from slidedp.profile.tomlw import dumps
from slidedp.spec import cores as cores_mod
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import COLLECTIVES, load_hardware, parse_hardware, preset_dir
from slidedp.spec.model import load_model
from slidedp.spec.plan import team_cores

TINY = Sizes(host_floor_bytes=4 * MIB, llc_multiple=0, thread_step=2, chunk_mib=(1, 4),
             stream_copies=2, collective_mib=(1, 4), micro_batches=(1, 2), warmup=1, repeats=2)
TODAY = datetime.date.today().isoformat()


def _run_dates() -> set[str]:
    """The dates a profile run by these tests can carry: it ran after this module's import and
    before now (a run across midnight carries either)."""
    return {TODAY, datetime.date.today().isoformat()}


def _profile(tmp_path, monkeypatch, *argv: str):
    monkeypatch.setattr(sizes_mod, "QUICK", TINY)
    parser = argparse.ArgumentParser()
    profile_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["profile", "--quick", *argv])
    return args.func(args)


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """One tiny CPU run with --base h200x2 (CUDA absent: GPU, PCIe, fabric come from it)."""
    if torch.cuda.is_available():
        pytest.skip("the CPU-only path: this machine has CUDA (see test_profile_gpu.py)")
    out = tmp_path_factory.mktemp("profile") / "here.toml"
    with pytest.MonkeyPatch.context() as mp:
        assert _profile(out.parent, mp, "--out", str(out), "--base", "h200x2") == 0
    return out


def test_written_toml_loads_and_names_itself(profiled):
    hw = load_hardware(str(profiled))
    assert hw.name == "here"
    assert "slidedp profile" in hw.description
    assert any(d in hw.description for d in _run_dates())


def test_host_sources_name_the_command_the_date_and_the_machine(profiled):
    hw, m = load_hardware(str(profiled)), probe_machine()
    for key, text in hw.host.sources.items():
        if key.endswith(("_bytes_per_param", "_bytes_per_elem")):
            assert text.startswith("derived:")
        else:
            assert text.startswith(tuple(f"slidedp profile {d} on {m.hostname} ({m.cpu_model}"
                                         for d in _run_dates()))


def test_adam_is_timed_on_both_gradients(profiled):
    """The profile times Adam on an FP32 gradient and on a BF16 one widened in cache
    (plan.grad_widen = host), each at every thread count; the model takes the one a plan runs,
    the FP32 curve where a hardware file lacks the other (earlier profiles, presets)."""
    h = load_hardware(str(profiled)).host
    curve = h.adam_bf16_grad_params_per_s
    assert curve is not None and h.adam_rate(1, 2) == curve.at(1) != h.adam_rate(1, 4)
    assert h.adam_rate(2, 4) == h.adam_params_per_s.at(2)
    preset = load_hardware("h200x1").host
    assert preset.adam_bf16_grad_params_per_s is None and preset.adam_rate(4, 2) == preset.adam_rate(4)
    for fmt in ("bf16", "int8"):  # compact moments: their own curves, measured at every count
        assert list(h.adam_moments_params_per_s[fmt].xs) == list(h.adam_params_per_s.xs)
        assert h.adam_rate(2, 4, fmt) == h.adam_moments_params_per_s[fmt].at(2) > 0
    assert "int8" not in preset.adam_moments_params_per_s
    assert preset.adam_rate(4, 4, "int8") == preset.adam_rate(4)


def test_host_curves_follow_the_thread_counts(profiled):
    host, m = load_hardware(str(profiled)).host, probe_machine()
    threads = TINY.threads(m.cores)
    assert threads[0] == 1 and threads[-1] == m.cores
    for curve in (host.cast_elems_per_s, host.adam_params_per_s):
        assert list(curve.xs) == threads  # strictly increasing (RateCurve checks it too)
        assert all(r > 0 for r in curve.rates)
    assert host.cores == m.cores and host.dram_bps > 0


def test_the_two_teams_at_once_are_measured_at_the_default_team_size(profiled):
    """dram_teams_gbps: the cast and update teams of the executor's default size (Plan.threads)
    run at once; the model caps host DRAM with it for teams at least that large."""
    host, m = load_hardware(str(profiled)).host, probe_machine()
    team = team_cores(m.cores)
    cast_t, update_t, bps = host.dram_teams
    assert (cast_t, update_t) == (team, team) and bps > 0
    assert 0 < host.dram_teams_cast_bps < bps  # the cast's part, whence the CAST's weight
    assert host.cast_weight() > 0
    assert host.team_dram_bps(team) == min(host.dram_bps, bps)
    if team > 1:  # smaller teams: the kernels' traffic at their size
        assert host.team_dram_bps(1) == pytest.approx(min(host.dram_bps, max(
            host.adam_rate(1) * 28, host.cast_rate(1) * 6)))


def _mapping_of(t: torch.Tensor) -> str:
    """The /proc/self/maps line holding t's first byte."""
    addr = t.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            return line
    raise AssertionError(f"no mapping holds {addr:#x}")


def test_the_host_benches_time_the_state_on_the_host_states_kind_of_memory():
    """The FP32 master (cast source, Adam's parameter) and Adam's m and v are /dev/shm mappings as
    in the executor's HostState (already unlinked: nothing left behind); the gradient and the
    BF16 destination are the process's own memory, as the executor's staging is."""
    bench = host_mod.HostBench(8 * 2**20, 0, 1)
    chunks = host_mod.CastChunkBench([2**20], 8 * 2**20, 2, False, 0, 1)
    for t in (bench.src, bench.m, bench.v, chunks.src):
        line = _mapping_of(t)
        assert str(SHM_DIR) in line and ".bench (deleted)" in line, line
    for t in (bench.dst, bench.bf16, chunks.ring):
        assert ".bench" not in _mapping_of(t)
    assert not list(SHM_DIR.glob(f"slidedp-{os.getpid()}-*.bench"))


def test_huge_page_modes_are_read_from_sysfs(tmp_path, monkeypatch):
    """The profile's source line names the transparent-huge-page mode of anonymous memory and of
    /dev/shm (the bracketed choice of each sysfs file); unknown where sysfs has none."""
    (tmp_path / "enabled").write_text("always [madvise] never\n")
    (tmp_path / "shmem_enabled").write_text("always within_size advise [never] deny force\n")
    monkeypatch.setattr(machine_mod, "_THP_SYSFS", tmp_path)
    assert machine_mod.huge_pages() == "THP enabled=madvise shmem_enabled=never"
    monkeypatch.setattr(machine_mod, "_THP_SYSFS", tmp_path / "missing")
    assert machine_mod.huge_pages() == "THP enabled=unknown shmem_enabled=unknown"


def test_physical_cores_count_smt_siblings_once(tmp_path, monkeypatch):
    """host_cores' rule: logical CPUs 0-3 on two packages, CPUs 0 and 1 SMT siblings of one
    core, 2 and 3 one core each: 3 physical cores; the logical count where sysfs is missing."""
    for cpu, (package, core) in enumerate([(0, 0), (0, 0), (0, 1), (1, 0)]):
        topo = tmp_path / f"cpu{cpu}" / "topology"
        topo.mkdir(parents=True)
        (topo / "physical_package_id").write_text(f"{package}\n")
        (topo / "core_id").write_text(f"{core}\n")
    monkeypatch.setattr(cores_mod, "CPU_SYSFS", tmp_path)
    assert cores_mod.physical_cores({0, 1, 2, 3}) == 3
    assert cores_mod.physical_cores({0, 1}) == 1
    assert cores_mod.physical_cores({1, 2, 3}) == 3
    assert cores_mod.physical_cores({0, 7}) == 2  # cpu7 has no topology: count the CPUs


def test_the_machine_probe_counts_host_cores():
    assert probe_machine().cores == cores_mod.host_cores() <= len(os.sched_getaffinity(0))


def test_the_profile_source_line_names_the_huge_page_modes(profiled):
    host = tomllib.loads(profiled.read_text())["host"]
    assert machine_mod.huge_pages() in host["source"]


def test_teams_run_counts_the_dma_loads_beside_them():
    """teams_bps with extra loads (on GPUs: every GPU's copies) runs each from the common start
    and adds its bytes; a failing load fails the run instead of reading low."""
    bench = host_mod.HostBench(8 * 2**20, 0, 1)
    calls = []
    src, dst = torch.ones(2**20), torch.empty(2**20)

    def load():
        dst.copy_(src)
        calls.append(1)

    alone, cast_alone, teams_alone = bench.teams_bps(1, 1, 0.05)
    both, cast_both, teams_both = bench.teams_bps(1, 1, 0.05, [(load, 1e12)])  # 1 TB a call
    assert len(calls) >= 2 and alone > 0  # a warm-up call, then timed ones
    assert both > 100 * alone  # its bytes are counted
    assert 0 < cast_alone < alone and 0 < cast_both < 0.01 * both  # the cast's own part
    assert teams_alone == pytest.approx(alone)  # the teams' part: all of it without the copies
    assert cast_both < teams_both < 0.01 * both  # the teams' part without the copies' bytes

    def broken():
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError, match="teams-at-once"):
        bench.teams_bps(1, 1, 0.05, [(broken, 1.0)])


def test_teams_by_chunk_run_one_task_a_call_on_successive_slices(monkeypatch):
    """teams_bps(chunk_bytes=c): each cast call stages c / 2 BF16 elements and each AdamW call
    updates c / 4 parameters, on the next slice of the buffers in turn, and the bytes counted
    are those calls' (6 B an element, 28 B a parameter); a team whose buffers hold fewer than
    MIN_CHUNK_SLICES of its tasks gets buffers of its own that do."""
    elems = 2**20
    bench = host_mod.HostBench(elems * 4, 0, 1)
    adam_sizes, adam_starts = [], []

    def fake_adam(p, g, m, v, step, opt, lr):
        assert p.numel() == g.numel() == m.numel() == v.numel()
        adam_sizes.append(p.numel())
        adam_starts.append((p.untyped_storage().data_ptr(), p.storage_offset()))

    monkeypatch.setattr(host_mod, "adamw_chunk", fake_adam)
    bench.cast_src = torch.arange(elems, dtype=torch.float32)
    casts = []
    cast_slice = bench._cast_slice

    def counted_cast(bufs, s: slice) -> None:
        casts.append((bufs[0].untyped_storage().data_ptr(), s.start, s.stop - s.start))
        cast_slice(bufs, s)

    monkeypatch.setattr(bench, "_cast_slice", counted_cast)
    chunk = elems  # BF16 bytes: elems / 2 cast elements, elems / 4 Adam parameters
    total, cast, teams = bench.teams_bps(1, 1, 0.05, chunk_bytes=chunk)
    assert set(adam_sizes) == {elems // 4} and {n for *_, n in casts} == {elems // 2}
    assert len(adam_sizes) >= 3 and len(casts) >= 3  # a warm-up call each, then timed ones
    own = bench.src.untyped_storage().data_ptr()
    assert set(adam_starts) == {(own, k * elems // 4) for k in range(4)}  # the bench's, in turn
    assert {(ptr, lo) for ptr, lo, _ in casts} == {
        (bench.cast_src.untyped_storage().data_ptr(), lo) for lo in (0, elems // 2)}
    assert torch.equal(bench.bf16.float(), bench.cast_src.bfloat16().float())  # both halves cast
    assert 0 < cast < total == pytest.approx(teams)
    timed_bytes = ((len(adam_sizes) - 1) * 28 * elems // 4, (len(casts) - 1) * 6 * elems // 2)
    assert (total - cast) / cast == pytest.approx(timed_bytes[0] / timed_bytes[1])
    adam_sizes.clear()
    adam_starts.clear()
    casts.clear()
    bench.teams_bps(1, 1, 0.05, chunk_bytes=4 * elems)  # the cast's tasks: 2 elems each
    assert set(adam_sizes) == {elems} and {n for *_, n in casts} == {2 * elems}
    assert len({s for s in adam_starts}) == len({lo for _, lo, _ in casts}) == 2  # two slices
    assert own not in {ptr for ptr, _ in adam_starts}  # buffers of their own, large enough
    assert bench.cast_src.untyped_storage().data_ptr() not in {ptr for ptr, *_ in casts}


def _within(fn, seconds: float = 20.0):
    """fn() in a daemon thread: its exception, or a failure if it has not returned in time."""
    out: list = []

    def call():
        try:
            fn()
            out.append(None)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(seconds)
    assert out, f"still running after {seconds} s (a hang)"
    return out[0]


def test_run_together_starts_bodies_together_and_never_hangs_on_a_failure():
    """profile.timing.run_together (the all-GPU PCIe run, the teams-at-once run): measured parts
    start after every setup; a body failing before or after the start, or returning without
    starting, fails the run, and the others leave the barrier instead of waiting for it."""
    events = []

    def body(name, setup_s):
        def run(start):
            time.sleep(setup_s)
            events.append(("ready", name))
            start()
            events.append(("go", name))
        return run

    assert _within(lambda: run_together([body("a", 0.0), body("b", 0.05)], "two bodies")) is None
    assert [e for e, _ in events] == ["ready", "ready", "go", "go"]

    def fails_in_setup(start):
        raise ValueError("no device")

    def fails_after_start(start):
        start()
        raise ValueError("copy failed")

    def never_starts(start):
        return None

    for bad, cause in ((fails_in_setup, ValueError), (fails_after_start, ValueError),
                       (never_starts, RuntimeError)):
        err = _within(lambda bad=bad: run_together([body("a", 0.0), bad, body("c", 0.01)],
                                                   "the test run"))
        assert isinstance(err, RuntimeError) and "the test run failed" in str(err), bad
        assert isinstance(err.__cause__, cause), bad


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(0.1, 100.0), min_size=1, max_size=9), st.floats(0.1, 10.0))
def test_rounds_rate_and_spread(rates, scale):
    """A rate lies among its rounds, the time per unit of work averaged (the harmonic mean, at
    most the arithmetic one), without the two extremes from 5 rounds on; it and the spread (max
    / min - 1 of the worst key) do not move with the unit; keys never sampled count for nothing."""
    rounds = Rounds()
    for x in rates:
        rounds.add(("adam", 4), x * scale)
    rounds.add(("copy", 4), 1.0)
    kept = sorted(rates)[1:-1] if len(rates) >= Rounds.TRIM_FROM else rates
    rate = rounds.rate(("adam", 4))
    assert min(kept) * scale * (1 - 1e-9) <= rate <= max(kept) * scale * (1 + 1e-9)
    assert rate == pytest.approx(scale * len(kept) / sum(1 / x for x in kept))
    assert rate <= statistics.fmean(kept) * scale * (1 + 1e-9)
    want = max(rates) / min(rates) - 1
    assert rounds.spread("adam") == pytest.approx(want)
    assert rounds.spread("copy") == 0.0 and rounds.spread("cast") == 0.0
    slow, fast = rounds.range(("adam", 4))  # the kept rounds around the rate, unit-free
    assert slow <= 1 + 1e-9 and fast >= 1 - 1e-9
    assert (slow, fast) == (pytest.approx(min(kept) * scale / rate),
                            pytest.approx(max(kept) * scale / rate))


class _ScriptedBench:
    """host.HostBench / CastChunkBench stand-in, one per allocation (a round): every rate reads
    10 (x 1e9) except on the second allocation of its kind, which reads 2 (a burst of load
    elsewhere); the teams run reads totals 100, 80, 120, 100, 100 GB/s, cast parts 30, 20, 40,
    30, 30 on allocations 1-5; records each call's warm-up."""

    TEAMS = {1: (100e9, 30e9), 2: (80e9, 20e9), 3: (120e9, 40e9), 4: (100e9, 30e9),
             5: (100e9, 30e9)}

    def __init__(self, allocation: int):
        self.allocation, self.warmup, self.calls = allocation, None, []
        self.slots, self.pinned, self.src_elems = 2, False, 1

    def _rate(self, *args, **kwargs) -> float:
        self.calls.append(self.warmup)
        return 2e9 if self.allocation == 2 else 10e9

    dram_bps = cast_elems_per_s = adam_params_per_s = adam_moments_params_per_s = _rate
    elems_per_s = _rate

    def teams_bps(self, *args, chunk_bytes=None) -> tuple[float, float, float]:
        total, cast = self.TEAMS[self.allocation]
        if chunk_bytes is not None:  # by chunk size: the cast's part grows with the chunk
            total, cast = total * 1.1, cast * (1 + chunk_bytes / MIB / 100)
        return total, cast, total

    def repeats_for(self, n: int) -> int:
        return 3

    def close(self) -> None:
        pass


def test_host_rates_are_sampled_in_rounds_over_the_thread_counts(monkeypatch):
    """Each round allocates fresh buffers and samples every kernel at every thread count, then
    runs the teams at once; a rate is the trimmed harmonic mean of its rounds (a burst of load
    costs one round, not the rate); only the first round warms up; the source lines and the
    summary say how far the rounds differed."""
    sizes = dataclasses.replace(TINY, repeats=3, host_rounds=5, warmup=2)
    machine = dataclasses.replace(FAKE, gpu_count=0)
    benches: dict[str, list[_ScriptedBench]] = {"host": [], "cast": []}

    def bench(kind: str):
        def make(*args, **kwargs):
            benches[kind].append(_ScriptedBench(len(benches[kind]) + 1))
            return benches[kind][-1]
        return make

    monkeypatch.setattr(host_mod, "HostBench", bench("host"))
    monkeypatch.setattr(host_mod, "CastChunkBench", bench("cast"))
    req = Request(sizes, (), (), (), "", None)
    prof = Profiler(machine, req)
    steps = prof.steps()
    threads = sizes.threads(machine.cores)
    round_1 = [s.name for s in steps[:len(threads) + 2]]
    assert round_1 == ["allocate host buffers (4 MiB each), round 1 of 5",
                       *(f"host copy, cast, adam at {n} threads, round 1 of 5" for n in threads),
                       f"cast and update teams of {team_cores(machine.cores)} threads at once "
                       "(whole buffers and by chunk size), round 1 of 5"]
    for step in steps:
        step.run()
    res = prof.res
    assert [len(v) for v in benches.values()] == [5, 5]  # fresh buffers each round
    for rates in (res.dram_bps, res.cast_elems_per_s, res.adam_params_per_s,
                  res.adam_bf16_grad_params_per_s, res.adam_bf16_moments_params_per_s,
                  res.adam_int8_moments_params_per_s):
        assert rates == {n: pytest.approx(10e9) for n in threads}
    assert res.cast_chunk_elems_per_s == {k: pytest.approx(10e9)
                                          for k in res.cast_chunk_elems_per_s}
    for kind in benches.values():
        assert {w for b in kind[1:] for w in b.calls} == {0} and set(kind[0].calls) == {2}
    assert res.dram_teams[2:] == (pytest.approx(100e9), pytest.approx(30e9))
    assert res.dram_teams_chunk == {c * MIB: (pytest.approx(110e9),
                                              pytest.approx(30e9 * (1 + c / 100)))
                                    for c in sizes.chunk_mib}
    doc = Assembler(machine, req, res, load_hardware("h200x1")).document("rounds")
    assert doc["host"]["dram_teams_chunk_gbps"] == [[c, 110, pytest.approx(30 * (1 + c / 100))]
                                                    for c in sizes.chunk_mib]
    by_chunk = parse_hardware(tomllib.loads(dumps(doc)), "rounds.toml").host
    small, large = (c * MIB for c in (sizes.chunk_mib[0], sizes.chunk_mib[-1]))
    assert by_chunk.teams_at(large) == (pytest.approx(110e9),
                                        pytest.approx(30e9 * (1 + large / MIB / 100)))
    assert by_chunk.teams_at() == (pytest.approx(100e9), pytest.approx(30e9))  # the whole buffers
    assert by_chunk.cast_weight(small) < by_chunk.cast_weight(large)
    # as a GPU's teams_and_dma sets them
    res.dram_dma, res.dma_weight, res.dma_teams_bps = (2, 2, 1, 150e9), 0.25, 75e9
    doc = Assembler(machine, req, res, load_hardware("h200x1")).document("rounds")
    hw = parse_hardware(tomllib.loads(dumps(doc)), "rounds.toml")
    assert hw.host.dram_dma_weight == 0.25 and doc["host"]["dram_dma_teams_gbps"] == 75
    assert hw.host.dma_slowdown_bps() == pytest.approx(75e9 / 0.25)  # 300 GB/s
    # the host's spread at the team size: the kept rounds all read 10, so no spread
    assert doc["host"]["rate_range"] == {"adam": [1.0, 1.0], "cast": [1.0, 1.0]}
    # how far the rounds differed: the kernels 10 against 2 (10 / 2 - 1 = 4.0), the teams'
    # totals 120 against 80 (0.5), whole buffers and by chunk (x 1.1 each: the same ratio)
    spreads = round_spreads(res)
    assert spreads == {"copy": pytest.approx(4.0), "cast": pytest.approx(4.0),
                       "adam": pytest.approx(4.0), "adam bf16 grad": pytest.approx(4.0),
                       "adam bf16 moments": pytest.approx(4.0),
                       "adam int8 moments": pytest.approx(4.0),
                       "cast chunk": pytest.approx(4.0), "teams": pytest.approx(0.5)}
    assert unsteady(spreads) and not unsteady({k: 0.1 for k in spreads})  # UNSTEADY: 10%
    assert round_spreads(Results(threads=threads)) == {}


def test_memory_cap_with_dma_is_parsed(tmp_path):
    text = (preset_dir() / "h200x1.toml").read_text().replace(
        "[host]\n", "[host]\ndram_teams_gbps = [12, 12, 110.0]\ndram_dma_gbps = [12, 12, 1, 150.0]\n", 1)
    f = tmp_path / "dma.toml"
    f.write_text(text)
    host = load_hardware(str(f)).host
    assert host.dram_dma == (12, 12, 1, 150e9) and host.memory_bps() == 150e9
    f.write_text(text.replace("[12, 12, 1, 150.0]", "[12, 12, 150.0]"))
    with pytest.raises(SpecError, match="host.dram_dma_gbps"):
        load_hardware(str(f))
    assert load_hardware("h200x1").host.memory_bps() is None


def test_the_dma_weight_is_paired_clamped_and_loads_only_beside_its_run(tmp_path):
    """A run's weight is the teams' traffic lost beside the copies over the copies' traffic,
    within [0, 1]; host.dram_dma_weight loads only beside host.dram_dma_gbps, in [0, 1] (the
    assembler's is checked in test_host_rates_are_sampled_in_rounds_over_the_thread_counts)."""
    assert dma_weight_sample(100e9, 80e9, 140e9) == pytest.approx(20 / 60)
    assert dma_weight_sample(100e9, 105e9, 160e9) == 0.0  # the teams gained: noise, no cost
    assert dma_weight_sample(100e9, 10e9, 20e9) == 1.0 and dma_weight_sample(1, 2, 2) == 0.0
    base = (preset_dir() / "h200x1.toml").read_text()

    def host(extra: str):
        f = tmp_path / "dma.toml"
        f.write_text(base.replace("[host]\n", "[host]\n" + extra, 1))
        return load_hardware(str(f)).host

    dma = "dram_dma_gbps = [12, 12, 1, 150.0]\n"
    assert host(dma + "dram_dma_weight = 0.25\n").dram_dma_weight == 0.25
    assert host(dma).dram_dma_weight == 0.0 and load_hardware("h200x1").host.dram_dma_weight == 0
    with pytest.raises(SpecError, match=r"host\.dram_dma_weight.*in \[0, 1\]"):
        host(dma + "dram_dma_weight = 1.5\n")
    with pytest.raises(SpecError, match=r"host\.dram_dma_weight.*beside host\.dram_dma_gbps"):
        host("dram_dma_weight = 0.25\n")


def test_rate_range_loads_and_brackets_the_host_rates(tmp_path):
    """host.rate_range: [slow, fast] factors around 1 for adam and cast, named in the error
    where wrong; host_corners scales AdamW (both gradients) and the cast (by threads and by
    chunk) by them and nothing else."""
    base = (preset_dir() / "h200x1.toml").read_text()
    f = tmp_path / "range.toml"

    def load(table: str):
        f.write_text(base.replace("[host]\n", f"[host]\nrate_range = {table}\n", 1))
        return load_hardware(str(f))

    hw = load("{ adam = [0.9, 1.2], cast = [0.8, 1.1] }")
    slow, fast = hw.host_corners()
    for corner, i in ((slow, 0), (fast, 1)):
        a, c = (0.9, 1.2)[i], (0.8, 1.1)[i]
        assert corner.host.adam_rate(12) == pytest.approx(a * hw.host.adam_rate(12))
        assert corner.host.adam_rate(12, 2) == pytest.approx(a * hw.host.adam_rate(12, 2))
        assert corner.host.cast_rate(12, 2**25) == pytest.approx(c * hw.host.cast_rate(12, 2**25))
        assert (corner.host.dram_bps, corner.pcie, corner.gpu) == (hw.host.dram_bps, hw.pcie,
                                                                   hw.gpu)
    assert load_hardware("h200x1").host_corners() is None
    for table, field in (("{ adam = [1.1, 1.2] }", "host.rate_range.adam"),
                         ("{ cast = [0.9] }", "host.rate_range.cast"),
                         ("{ copy = [0.9, 1.1] }", "host.rate_range.copy"),
                         ("[0.9, 1.1]", "host.rate_range")):
        with pytest.raises(SpecError, match=field.replace(".", r"\.")):
            load(table)


def test_cast_share_of_the_teams_run_is_checked(tmp_path):
    base = (preset_dir() / "h200x1.toml").read_text()
    f = tmp_path / "share.toml"
    for extra, ok in (("dram_teams_gbps = [12, 12, 110.0]\ndram_teams_cast_gbps = 30.0\n", True),
                      ("dram_teams_cast_gbps = 30.0\n", False),  # no run to split
                      ("dram_teams_gbps = [12, 12, 110.0]\ndram_teams_cast_gbps = 110.0\n", False)):
        f.write_text(base.replace("[host]\n", "[host]\n" + extra, 1))
        if ok:
            assert load_hardware(str(f)).host.dram_teams_cast_bps == 30e9
        else:
            with pytest.raises(SpecError, match="host.dram_teams_cast_gbps.*(beside|got 110)"):
                load_hardware(str(f))


def test_teams_by_chunk_table_is_checked(tmp_path):
    """dram_teams_chunk_gbps: rows [chunk_mib, GB/s, cast GB/s] by chunk strictly increasing,
    the cast's part below the total, only beside the whole-buffer run's split."""
    base = (preset_dir() / "h200x1.toml").read_text()
    whole = "dram_teams_gbps = [12, 12, 110.0]\ndram_teams_cast_gbps = 30.0\n"
    f = tmp_path / "chunks.toml"
    for extra, ok in ((whole + "dram_teams_chunk_gbps = [[64, 100.0, 30.0], [256, 110, 40]]\n",
                       True),
                      ("dram_teams_chunk_gbps = [[64, 100.0, 30.0]]\n", False),  # no whole run
                      (whole + "dram_teams_chunk_gbps = [[256, 100.0, 30.0], [64, 110, 40]]\n",
                       False),  # not by chunk
                      (whole + "dram_teams_chunk_gbps = [[64, 100.0, 100.0]]\n", False),
                      (whole + "dram_teams_chunk_gbps = [[64, 100.0]]\n", False)):
        f.write_text(base.replace("[host]\n", "[host]\n" + extra, 1))
        if ok:
            h = load_hardware(str(f)).host
            assert h.dram_teams_chunk == ((64 * MIB, 100e9, 30e9), (256 * MIB, 110e9, 40e9))
            assert h.teams_at(128 * MIB) == (pytest.approx(105e9), pytest.approx(35e9))
            assert h.teams_at(16 * MIB) == (pytest.approx(100e9), pytest.approx(30e9))  # clamped
            assert h.dram_bps > 100e9 and h.team_dram_bps(12, 64 * MIB) == pytest.approx(100e9)
        else:
            with pytest.raises(SpecError, match="host.dram_teams_chunk_gbps"):
                load_hardware(str(f))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.floats(20, 200), st.floats(0.05, 0.95)), min_size=1, max_size=4,
                unique_by=lambda r: r[0]),
       st.floats(1, 2048))
def test_teams_at_reads_between_its_rows(rows, chunk_mib):
    """HostSpec.teams_at: at a measured chunk size its row, between two of them a value between
    theirs, outside the measured range the nearest row's (clamped), for the total and the cast."""
    sizes = sorted({2 ** k for k in range(4, 4 + len(rows))})  # 16, 32, ... MiB
    table = tuple((c * MIB, t * 1e9, t * f * 1e9) for c, (t, f) in zip(sizes, rows, strict=False))
    host = dataclasses.replace(load_hardware("h200x1").host, dram_teams=(12, 12, 100e9),
                               dram_teams_cast_bps=30e9, dram_teams_chunk=table)
    for c, total, cast in table:
        assert host.teams_at(c) == (pytest.approx(total), pytest.approx(cast))
    total, cast = host.teams_at(chunk_mib * MIB)
    below = [r for r in table if r[0] <= chunk_mib * MIB] or table[:1]
    above = [r for r in table if r[0] >= chunk_mib * MIB] or table[-1:]
    for i, got in ((1, total), (2, cast)):
        lo, hi = sorted((below[-1][i], above[0][i]))
        assert lo * (1 - 1e-12) <= got <= hi * (1 + 1e-12)


def test_bad_teams_row_is_rejected_naming_the_field(tmp_path):
    text = (preset_dir() / "h200x1.toml").read_text().replace(
        "[host]\n", "[host]\ndram_teams_gbps = [12, 0, 100.0]\n", 1)
    assert "dram_teams_gbps" in text
    f = tmp_path / "bad.toml"
    f.write_text(text)
    with pytest.raises(SpecError, match="host.dram_teams_gbps"):
        load_hardware(str(f))


def test_base_fills_what_cpu_cannot_measure(profiled):
    hw, base = load_hardware(str(profiled)), load_hardware("h200x2")
    assert hw.gpu.peak_bf16_flops == base.gpu.peak_bf16_flops
    assert hw.gpu.achieved == base.gpu.achieved and hw.gpu.count == base.gpu.count
    assert len(hw.gpu.layer_times) == len(base.gpu.layer_times)
    assert hw.pcie.h2d_bps == base.pcie.h2d_bps
    f, bf = hw.fabric, base.fabric
    assert (f.kind, f.link_bps, f.latency_s, dict(f.efficiency)) == (
        bf.kind, bf.link_bps, bf.latency_s, dict(bf.efficiency))
    for sec in ("gpu", "pcie", "fabric"):
        for key, text in getattr(hw, sec).sources.items():
            assert text.startswith("from preset h200x2: not measured here (no CUDA device)"), (
                sec, key)
    assert all("not measured here" in lt.source for lt in hw.gpu.layer_times)


def test_without_base_fails_before_measuring(tmp_path):
    """No CUDA: GPU, PCIe, fabric; with CUDA: the datasheet figures. Either way --base is needed."""
    out = tmp_path / "x.toml"
    r = subprocess.run([sys.executable, "-m", "slidedp.cli", "profile", "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("slidedp profile: error:") and "--base" in line
    assert ("gpu (no CUDA device)" in line) or ("gpu.peak_bf16_tflops" in line)
    assert not out.exists()


def test_host_rounds_option_sets_the_rounds(tmp_path, monkeypatch):
    """--host-rounds N: N rounds, and every round's samples in OUT's .rounds.json, from which
    the TOML's rates come."""
    out = tmp_path / "rounds.toml"
    assert _profile(tmp_path, monkeypatch, "--out", str(out), "--base", "h200x1",
                    "--host-rounds", "4") == 0
    host = tomllib.loads(out.read_text())["host"]
    assert ("), the harmonic mean of 4 rounds over the thread counts"  # too few to trim
            in host["sources"]["adam_gparam_per_s"])
    kept = json.loads((tmp_path / "rounds.rounds.json").read_text())
    assert kept["hardware"] == "rounds" and "--host-rounds 4" in kept["command"]
    by_key = {(r["kernel"], *r["where"]): r["rates"] for r in kept["samples"]}
    assert {k[0] for k in by_key} >= {"copy", "cast", "adam", "adam bf16 grad", "cast chunk",
                                      "teams", "teams cast"}
    assert all(len(v) == 4 for v in by_key.values())
    for n, gparam in host["adam_gparam_per_s"]:
        assert gparam == pytest.approx(statistics.harmonic_mean(by_key[("adam", n)]) / 1e9,
                                       rel=1e-3)


def test_bad_options_are_spec_errors(tmp_path, monkeypatch):
    with pytest.raises(SpecError, match="--host-rounds"):
        _profile(tmp_path, monkeypatch, "--out", str(tmp_path / "x.toml"), "--host-rounds", "0")
    with pytest.raises(SpecError, match="--micro-batch"):
        _profile(tmp_path, monkeypatch, "--out", str(tmp_path / "x.toml"), "--micro-batch", "0")
    with pytest.raises(SpecError, match="--hardware|preset"):
        _profile(tmp_path, monkeypatch, "--out", str(tmp_path / "x.toml"), "--base", "nope")


# ---- the assembly of GPU measurements, on hand-made results ---------------------------------

FAKE = Machine("gpubox", TODAY, "Fake Xeon", 4, 8, 64 * 2**30, 32 * MIB, "NVIDIA H200", 2,
               140 * 2**30)
TOPO_2 = "\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tNV18\t0-31\nGPU1\tNV18\t X \t0-31\n"


def _fake_results(fwd_s: float = 0.004) -> Results:
    r = Results(host_bytes=4 * MIB, threads=[1, 2, 4])
    for n in r.threads:
        r.dram_bps[n], r.cast_elems_per_s[n], r.adam_params_per_s[n] = 20e9 * n, 1e9 * n, 0.5e9 * n
        r.adam_bf16_grad_params_per_s[n] = 0.4e9 * n
    for g in range(2):
        for d in ("h2d", "d2h"):
            for c in (1, 4):
                r.pcie_alone_bps[(g, d, c * MIB)] = (50e9 if c == 4 else 30e9) - g * 1e9
        r.pcie_duplex_bps[g] = 100e9
    r.pcie_all_bps.update(h2d=108e9, d2h=107e9, both=110e9)
    spec = load_model("qwen3-8b")
    for mb in (1, 2):
        f = spec.layer_flops_per_token(4096)
        for pol, scale, kinds in (("none", 1.0, ("fwd", "bwd")), ("layer", 1.3, ("fwd", "recompute", "bwd"))):
            r.layers.append(LayerTiming("qwen3-8b", spec.hidden, spec.ffn, 4096, mb, pol,
                                        fwd_s * mb, 2 * fwd_s * mb * scale,
                                        sum(f[k] for k in kinds) * 4096 * mb))
    r.matmul_flops_per_s = 800e12
    r.link_bps = 380e9
    for op in COLLECTIVES:
        for c in (1, 4):
            r.collective_s[(op, c * MIB)] = c * MIB / (500e9 if op == "reduce" else 250e9)
    r.collective_s[("latency", LATENCY_BYTES)] = 25e-6
    return r


def _request() -> Request:
    return Request(TINY, (load_model("qwen3-8b"),), (4096,), (1, 2), TOPO_2, "nvswitch")


def test_layer_rows_carry_the_kernels_the_layer_ran():
    def assembled(results):
        doc = Assembler(FAKE, _request(), results, load_hardware("h200x1")).document("fake")
        return doc, parse_hardware(tomllib.loads(dumps(doc)), "fake.toml")

    doc, hw = assembled(_fake_results())
    assert [r["kernels"] for r in doc["gpu"]["layer_time"]] == ["eager", "eager"]
    r = _fake_results()
    r.layers[:] = [dataclasses.replace(t, kernels="liger") for t in r.layers]
    doc, hw = assembled(r)
    assert [lt.kernels for lt in hw.gpu.layer_times] == ["liger", "liger"]
    assert "liger kernels" in hw.gpu.layer_times[0].source
    spec = load_model("qwen3-8b")
    assert hw.gpu.measured_layer_s(spec.hidden, spec.ffn, 4096, 1, "auto") == 0.012


def test_gpu_measurements_assemble_into_a_valid_spec():
    doc = Assembler(FAKE, _request(), _fake_results(), load_hardware("h200x1")).document("fake")
    hw = parse_hardware(tomllib.loads(dumps(doc)), "fake.toml")
    assert hw.gpu.model == "NVIDIA H200" and hw.gpu.count == 2
    assert hw.gpu.peak_bf16_flops == load_hardware("h200x1").gpu.peak_bf16_flops
    # policy none rows only (the layer policy's rows are not layer times)
    assert [lt.fwd_bwd_s for lt in hw.gpu.layer_times] == [0.012, 0.024]
    assert hw.pcie.h2d_bps == 49e9  # the slowest GPU at the largest chunk
    assert hw.pcie.chunk_bps == ((MIB, 29e9, 29e9), (4 * MIB, 49e9, 49e9))
    assert hw.pcie.all_total_bps == 110e9
    assert hw.fabric.kind == "nvswitch" and hw.fabric.link_bps == 380e9
    # all_reduce moves 2 (R-1)/R B = B at R = 2: busbw 250 GB/s, efficiency 250 / 380
    assert hw.fabric.efficiency["all_reduce"] == pytest.approx(250 / 380, rel=1e-3)
    assert hw.fabric.efficiency["reduce"] == 1.0  # reduce moves B: 500 GB/s, capped at the link
    assert hw.fabric.latency_s == pytest.approx(25e-6)
    for sec in ("gpu", "pcie", "host", "fabric"):
        for key, text in getattr(hw, sec).sources.items():
            assert text.startswith((f"slidedp profile {TODAY} on gpubox (Fake Xeon, 2x NVIDIA H200)",
                                    "from preset h200x1", "derived:")), (sec, key)


def test_one_gpu_uses_single_gpu_caps_and_base_fabric():
    one = dataclasses.replace(FAKE, gpu_count=1)
    res = _fake_results()
    res.pcie_all_bps.clear()
    for k in [k for k in res.pcie_alone_bps if k[0] == 1]:
        del res.pcie_alone_bps[k]
    del res.pcie_duplex_bps[1]
    req = Request(TINY, _request().models, (4096,), (1, 2), "", None)
    hw = parse_hardware(tomllib.loads(dumps(
        Assembler(one, req, res, load_hardware("h200x2")).document("one"))), "one.toml")
    assert hw.pcie.all_h2d_bps == hw.pcie.h2d_bps == 50e9
    assert hw.pcie.all_total_bps == hw.pcie.duplex_bps
    assert hw.fabric.kind == "nvswitch"
    assert hw.fabric.sources["kind"].startswith("from preset h200x2: not measured here (one GPU")


def test_measured_above_the_base_peak_is_an_error():
    with pytest.raises(SpecError, match="peak_bf16_tflops above the measured"):
        Assembler(FAKE, _request(), _fake_results(fwd_s=1e-6), load_hardware("h200x1")).document("x")


def test_what_each_machine_cannot_measure():
    cpu_only = dataclasses.replace(FAKE, gpu_model="", gpu_count=0, hbm_bytes=0.0)
    assert set(unmeasured(cpu_only, None)) == {"gpu", "pcie", "fabric"}
    assert set(unmeasured(FAKE, "nvswitch")) == {"gpu.hbm_gbps", "gpu.peak_bf16_tflops"}
    assert "fabric" in unmeasured(FAKE, None)


# ---- pure parts -----------------------------------------------------------------------------

TOPO_PAIRS = ("\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tCPU Affinity\x1b[0m\n"
              "GPU0\t X \tNV8\tSYS\tSYS\t0-63\nGPU1\tNV8\t X \tSYS\tSYS\t0-63\n"
              "GPU2\tSYS\tSYS\t X \tNV8\t0-63\nGPU3\tSYS\tSYS\tNV8\t X \t0-63\n\nLegend:\n  X = Self\n")
TOPO_PCIE = "\tGPU0\tGPU1\tNIC0\nGPU0\t X \tPIX\tSYS\nGPU1\tPIX\t X \tSYS\nNIC0\tSYS\tSYS\t X \n"
TOPO_MIXED = ("\tGPU0\tGPU1\tGPU2\nGPU0\t X \tNV4\tNV4\nGPU1\tNV4\t X \tPIX\n"
              "GPU2\tNV4\tPIX\t X \n")


@pytest.mark.parametrize("topo,kind", [(TOPO_2, "nvswitch"), (TOPO_PAIRS, "nvlink-pairs"),
                                       (TOPO_PCIE, "pcie"), (TOPO_MIXED, None), ("", None)])
def test_fabric_kind_from_topology(topo, kind):
    assert fabric_kind(gpu_link_matrix(topo)) == kind


def test_topology_matrix_reads_gpu_cells_only():
    assert gpu_link_matrix(TOPO_PCIE) == [["X", "PIX"], ["PIX", "X"]]


def test_toml_writer_round_trips():
    doc = {"a": {"s": 'q"\\ é', "i": 3, "f": 1e-7, "l": [[1, 2.5]], "e": {"x": 0.5},
                 "sources": {"i": "there"}, "rows": [{"k": 1}, {"k": 2}]},
           "b": {"n": 1}}
    text = dumps(doc, "two\nlines")
    assert text.startswith("# two\n# lines\n")
    assert tomllib.loads(text) == doc


@pytest.mark.parametrize("cores,step,want", [(1, 2, [1]), (2, 2, [1, 2]),
                                             (32, 2, [1, 2, 4, 8, 16, 24, 32]),
                                             (12, 4, [1, 4, 9, 12])])  # + the default team
def test_thread_counts(cores, step, want):
    assert Sizes(1, 0, step, (1,), 1, (1,), (1,), 0, 1).threads(cores) == want


def test_host_buffers_exceed_the_llc_within_ram():
    assert sizes_mod.FULL.host_bytes(480 * MIB, 256 * 2**30) == 1920 * MIB
    assert sizes_mod.FULL.host_bytes(8 * MIB, 256 * 2**30) == 1024 * MIB
    assert sizes_mod.FULL.host_bytes(480 * MIB, 16 * 2**30) == 1024 * MIB


def test_layer_builds_from_the_config_and_runs_fwd_bwd_on_cpu():
    """The layer the GPU timing builds (transformers' own class), run once in BF16 on the CPU."""
    spec = load_model("tiny-qwen3")
    layer, rotary, kernels = build_layer(spec, torch.device("cpu"))
    assert kernels == "eager"  # auto off CUDA
    assert sum(p.numel() for p in layer.parameters()) == spec.layer_params()
    x = torch.randn(2, 32, spec.hidden, dtype=torch.bfloat16, requires_grad=True)
    y = forward(layer, x, rope(rotary, 32, torch.device("cpu")))
    y.backward(torch.ones_like(y))
    assert y.shape == x.shape and x.grad is not None and torch.isfinite(y.float()).all()


def test_moe_layers_are_refused_early():
    with pytest.raises(SpecError, match="model_type"):
        one_layer_config(load_model("qwen3-30b-a3b"))


# ---- the optional per-chunk PCIe curve of the schema ----------------------------------------


def _with_chunks(tmp_path, rows: str):
    path = tmp_path / "c.toml"
    text = (preset_dir() / "h200x1.toml").read_text()
    path.write_text(text.replace("all_total_gbps = 101.7\n",
                                 f"all_total_gbps = 101.7\nchunk_gbps = {rows}\n", 1))
    return path


def test_chunk_curve_loads(tmp_path):
    hw = load_hardware(str(_with_chunks(tmp_path, "[[4, 30, 31], [256, 55, 55.2]]")))
    assert hw.pcie.chunk_bps == ((4 * MIB, 30e9, 31e9), (256 * MIB, 55e9, 55.2e9))
    assert hw.pcie.sources["chunk_gbps"] == hw.pcie.sources["h2d_gbps"]
    assert load_hardware("h200x1").pcie.chunk_bps == ()


@pytest.mark.parametrize("rows", ["[[256, 55, 55], [4, 30, 31]]", "[[4, 30]]", "[[4, -1, 3]]", "55"])
def test_bad_chunk_curve_is_rejected(tmp_path, rows):
    with pytest.raises(SpecError, match="pcie.chunk_gbps"):
        load_hardware(str(_with_chunks(tmp_path, rows)))


# ---- the cast by chunk size (host) and its optional table in the schema ----------------------


def test_cast_by_chunk_is_measured_at_the_pcie_chunk_sizes_and_named(profiled):
    hw, m = load_hardware(str(profiled)), probe_machine()
    chunks = hw.host.cast_chunk
    assert [c for c, _ in chunks] == [c * MIB / 2 for c in TINY.chunk_mib]  # BF16 elements
    for _, curve in chunks:
        assert list(curve.xs) == TINY.threads(m.cores) and all(r > 0 for r in curve.rates)
    text = hw.host.sources["cast_chunk_gelem_per_s"]
    assert text.startswith(tuple(f"slidedp profile {d} on {m.hostname} ({m.cpu_model}"
                                 for d in _run_dates()))
    # the chunk-size rate is what a chunk's cast takes; other sizes interpolate
    small = chunks[0][0]
    assert hw.host.cast_rate(1, small) == chunks[0][1].at(1)
    assert hw.host.cast_rate(1) == hw.host.cast_elems_per_s.at(1)


def test_cast_by_chunk_assembles_with_dram_and_sources():
    res = _fake_results()
    res.cast_chunk_src_bytes, res.cast_chunk_slots, res.cast_chunk_pinned = 8 * MIB, 4, True
    res.cast_chunk_repeats = {MIB: 4, 4 * MIB: 2}
    for c in (1, 4):
        for n in res.threads:
            res.cast_chunk_elems_per_s[(c * MIB, n)] = 2e9 * n * c  # beats the big-buffer cast
    hw = parse_hardware(tomllib.loads(dumps(Assembler(FAKE, _request(), res, load_hardware(
        "h200x1")).document("fake"))), "fake.toml")
    assert [(c, list(r.xs), list(r.rates)) for c, r in hw.host.cast_chunk] == [
        (MIB / 2, [1, 2, 4], [2e9, 4e9, 8e9]), (2 * MIB, [1, 2, 4], [8e9, 16e9, 32e9])]
    # the DRAM capacity covers the chunked cast's traffic too (32 Gelem/s x 6 B), above the
    # whole-buffer kernels' (_fake_results)
    assert hw.host.dram_bps == pytest.approx(32e9 * 6, rel=1e-3)


def test_sac_recompute_is_written_with_its_layer_time():
    res = _fake_results()
    res.sac_recompute_fraction[("qwen3-8b", 4096, 2)] = 0.31
    hw = parse_hardware(tomllib.loads(dumps(Assembler(FAKE, _request(), res, load_hardware(
        "h200x1")).document("fake"))), "fake.toml")
    assert [lt.sac_recompute_fraction for lt in hw.gpu.layer_times] == [None, 0.31]


def test_sustained_layer_time_is_the_written_layer_time():
    res = _fake_results()
    res.sustained = [dataclasses.replace(t, fwd_s=t.fwd_s * 1.05, bwd_s=t.bwd_s * 1.05,
                                         iterations=12, span_s=1.5, busy=0.99)
                     for t in res.layers]
    hw = parse_hardware(tomllib.loads(dumps(Assembler(FAKE, _request(), res, load_hardware(
        "h200x1")).document("fake"))), "fake.toml")
    # the short runs' 12 and 24 ms (_fake_results), 5% slower back to back
    assert [lt.fwd_bwd_s for lt in hw.gpu.layer_times] == [pytest.approx(0.0126),
                                                           pytest.approx(0.0252)]
    # achieved follows the sustained time: 5 % slower than the short runs
    short = Assembler(FAKE, _request(), _fake_results(), load_hardware("h200x1")).document("s")
    assert hw.gpu.achieved[0][2] == pytest.approx(short["gpu"]["achieved"][0][2] * 1e12 / 1.05,
                                                  rel=1e-3)


@pytest.mark.parametrize("short_s,want", [(0.010, 75), (0.2, 6), (1e-7, 5000)])
def test_sustained_iterations(short_s, want):
    from slidedp.profile.run import sustained_iters

    assert sustained_iters(sizes_mod.QUICK, short_s) == want


def _with_cast_chunks(tmp_path, rows: str):
    path = tmp_path / "cc.toml"
    text = (preset_dir() / "h200x1.toml").read_text()
    path.write_text(text.replace("cast_dram_bytes_per_elem = 6\n",
                                 f"cast_dram_bytes_per_elem = 6\ncast_chunk_gelem_per_s = {rows}\n",
                                 1))
    return path


def test_cast_chunk_table_loads(tmp_path):
    hw = load_hardware(str(_with_cast_chunks(
        tmp_path, "[[16, 1, 1.0], [16, 8, 6.0], [256, 1, 1.2], [256, 4, 4.0], [256, 8, 7.0]]")))
    (c0, r0), (c1, r1) = hw.host.cast_chunk
    assert (c0, c1) == (8 * MIB, 128 * MIB)
    assert (r0.xs, r0.rates) == ((1.0, 8.0), (1e9, 6e9))
    assert r1.at(4) == 4e9 and r1.unit == "elem/s"
    assert hw.host.sources["cast_chunk_gelem_per_s"] == hw.host.sources["cores"]
    assert load_hardware("h200x1").host.cast_chunk == ()


@pytest.mark.parametrize("rows", ["[[256, 1, 1.0], [16, 1, 1.0]]", "[[16, 1]]",
                                  "[[16, 1, -1.0]]", "[[16, 0, 1.0]]", "[[16, true, 1.0]]",
                                  "[[16, 4, 1.0], [16, 1, 1.0]]", "[[16, 1, 1.0], [16, 1, 2.0]]",
                                  "[[16, 1, 1.0], [64, 1, 1.0], [16, 2, 1.0]]", "3", '"x"'])
def test_bad_cast_chunk_table_is_rejected_naming_the_field(tmp_path, rows):
    with pytest.raises(SpecError, match="host.cast_chunk_gelem_per_s"):
        load_hardware(str(_with_cast_chunks(tmp_path, rows)))


def test_a_timed_sample_repeats_short_kernels_for_its_minimum_duration(monkeypatch):
    from slidedp.profile import timing
    clock = [0.0]  # a fake clock each kernel call advances by 4 ms: no sleeping, no load noise
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock[0])
    calls = []

    def kernel():
        clock[0] += 0.004
        calls.append(1)

    per_call = timing.wall_median_s(kernel, 0, 3, min_s=0.03)
    assert len(calls) == 3 * 8  # each sample runs until 30 ms have passed: 8 calls of 4 ms
    assert per_call == pytest.approx(0.004)  # the time per call, not per sample
    calls.clear()
    assert timing.wall_median_s(kernel, 0, 3) == pytest.approx(0.004) and len(calls) == 3


def test_ready_gaps_pairs_every_task_of_an_agent_and_keeps_ready_casts_and_updates():
    """Hand-made step: on cpu.update0 a HOST_SUM sits between two ADAMs (the pair after it counts:
    the gap is from the HOST_SUM's end), one ADAM waited on its D2H (not ready: left out), one on
    another process (left out); on cpu.cast the second CAST was ready."""
    def rec(kind, agent, s, e):
        return Record(0, kind, 1, 0, 0, agent, s, e)

    records = [rec("D2H", "gpu0.d2h", 0.0, 1.0),           # 0
               rec("ADAM", "cpu.update0", 1.0, 2.0),      # 1 (first on its agent)
               rec("HOST_SUM", "cpu.update0", 2.1, 3.0),  # 2
               rec("ADAM", "cpu.update0", 3.2, 4.0),      # 3 ready: gap 0.2
               rec("D2H", "gpu0.d2h", 1.0, 4.5),          # 4
               rec("ADAM", "cpu.update0", 4.6, 5.0),      # 5 waited on 4: not ready
               rec("ADAM", "cpu.update0", 5.4, 6.0),      # 6 waits on another process
               rec("CAST", "cpu.cast", 0.0, 1.0),         # 7
               rec("CAST", "cpu.cast", 1.05, 2.0)]        # 8 ready: gap 0.05
    tpl = SimpleNamespace(n=9, local=[True] * 9,
                          preds=[[], [0], [], [0], [], [4], [], [], []],
                          remote=[[], [], [], [], [], [], [99], [], []])
    samples = agents.ready_gaps(tpl, records)
    assert {k: pytest.approx(v) for k, v in samples.items()} == {"adam": [0.2], "cast": [0.05]}
    gaps = agents.AgentGaps.of({**samples, "adam": [0.2, 0.4, -0.1]}, 2)
    assert gaps.gap_s == pytest.approx({"adam": 0.2, "cast": 0.05})
    assert (gaps.pairs, gaps.steps) == ({"adam": 3, "cast": 1}, 2)
    assert agents.AgentGaps.of({"cast": [-0.01], "adam": []}, 1).gap_s == {"cast": 0.0}
    with pytest.raises(ValueError, match="8 records for 9 local tasks"):
        agents.ready_gaps(tpl, records[:-1])


def test_the_executor_dispatch_cost_is_measured_and_written():
    """profile/agents.py on the CPU: a real executor run gives a median dispatch gap per CPU
    agent kind over ready pairs; the assembler writes it as host.agent_gap_us, which the model
    reads back as HostSpec.task_gap_s."""
    gaps = agents.measure(dict(load_model("tiny-qwen3").config), 32, "cpu", chunk_mib=1 / 64)
    assert set(gaps.gap_s) == {"cast", "adam"} and 1 <= gaps.steps <= agents.MAX_STEPS
    assert gaps.steps == agents.MAX_STEPS or min(gaps.pairs.values()) >= agents.MIN_PAIRS
    assert all(0 <= s < 0.05 for s in gaps.gap_s.values()), gaps
    res = _fake_results()
    res.agent_gaps = ("tiny-qwen3", 32, agents.AgentGaps({"cast": 70e-6, "adam": 0.12e-3},
                                                        {"cast": 40, "adam": 90}, 3))
    hw = parse_hardware(tomllib.loads(dumps(Assembler(FAKE, _request(), res, load_hardware(
        "h200x1")).document("fake"))), "fake.toml")
    assert dict(hw.host.task_gap_s) == pytest.approx({"cast": 70e-6, "adam": 120e-6})
    assert tomllib.loads(dumps(Assembler(FAKE, _request(), res, load_hardware("h200x1")).document(
        "fake")))["host"]["agent_gap_us"] == pytest.approx({"cast": 70.0, "adam": 120.0})
