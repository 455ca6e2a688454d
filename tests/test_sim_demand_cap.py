"""The demand-capped host.dram of the simulator's FluidShare: a copy's weighted draw
(HostSpec.dram_dma_weight) slows the CPU kernels beside it even far below the static cap, and the
fast path (no recomputation) agrees with a full recomputation."""

import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from slidedp.sim.engine import FluidShare
from slidedp.sim.resources import REL_EPS, Flow

DRAM, CORES, MEM = 0, 1, 2  # resource indices: the kernels' cap, the core pool, all traffic
CAPACITY = [100.0, 16.0, 200.0]


def _share(capped: bool) -> tuple[simpy.Environment, FluidShare]:
    env = simpy.Environment()
    return env, FluidShare(env, list(CAPACITY), {CORES: 16.0}, (DRAM,) if capped else ())


def _cpu(task: int, gbps: float, threads: float = 8.0) -> Flow:
    return Flow(task, 1.0, [(DRAM, gbps), (MEM, gbps)], threads=threads, pool=CORES)


def _dma(task: int, gbps: float, weight: float, seconds: float = 1.0) -> Flow:
    return Flow(task, seconds, [(DRAM, weight * gbps), (MEM, gbps)])


def _start(env, share, *flows):
    for f in flows:
        f.done = env.event()
        share.start(f)


@pytest.mark.parametrize("capped", [False, True])
def test_a_copy_slows_a_lone_update_only_where_the_cap_follows_the_kernels(capped):
    env, share = _share(capped)
    update, copy = _cpu(0, 60.0), _dma(1, 50.0, 0.5, seconds=5.0)
    _start(env, share, update)
    assert update.speed == 1.0
    _start(env, share, copy)
    # capped: the resource holds what the update alone would draw, 60; the two draw 60 + 25
    expected = 60.0 / 85.0 if capped else 1.0
    assert update.speed == pytest.approx(expected) and copy.speed == pytest.approx(expected)
    env.run(until=update.done)  # the update ends: the copy alone runs at full speed again
    assert share.flows == [copy] and copy.speed == pytest.approx(1.0)


def test_a_lone_copy_is_never_held_by_a_cap_without_kernels():
    env, share = _share(True)
    copy = _dma(0, 150.0, 1.0)  # draws 150 on a static cap of 100, the kernels' cap; none run
    _start(env, share, copy)
    assert copy.speed == pytest.approx(1.0)


def test_at_the_static_cap_the_copy_takes_its_weighted_share():
    """Two teams that saturate the static cap alone: the copy's draw comes out of that cap
    (the profile's paired teams-with-DMA run)."""
    env, share = _share(True)
    cast, update, copy = _cpu(0, 40.0), _cpu(1, 80.0), _dma(2, 60.0, 0.5)
    _start(env, share, cast, update, copy)
    s = 100.0 / (40.0 + 80.0 + 30.0)
    assert [f.speed for f in (cast, update, copy)] == pytest.approx([s, s, s])


flows_st = st.lists(st.tuples(st.booleans(), st.floats(1.0, 120.0), st.floats(0.0, 1.0),
                              st.floats(1.0, 16.0)), min_size=1, max_size=6)


@settings(max_examples=60, deadline=None)
@given(flows_st)
def test_fast_path_matches_a_full_recomputation_and_stays_feasible(spec):
    env, share = _share(True)
    flows = [(_cpu(i, gbps, threads) if is_cpu else _dma(i, gbps, weight))
             for i, (is_cpu, gbps, weight, threads) in enumerate(spec)]
    for f in flows:
        _start(env, share, f)
        speeds = [g.speed for g in share.flows]
        share._recompute()
        assert [g.speed for g in share.flows] == pytest.approx(speeds, rel=1e-9)
        for j, load in enumerate(share.load):
            assert load <= share._capacity(j) * (1 + 1e3 * REL_EPS)
