"""Resource models: the max-min fair rule, the core pool, and the measured host microbenchmarks."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slidedp.graph.tasks import Kind
from slidedp.sim.microbench import adam_workers_gparam_per_s, cast_h2d_gbps, cpu_rate, dma_gbps
from slidedp.sim.resources import Flow, allocate_cores, fill_speeds
from slidedp.spec.hardware import load_hardware


def test_max_min_fair_progressive_filling():
    # resource 0 (cap 10) shared by a and b; b also alone on resource 1 (cap 2); c on 1 too
    a = Flow(0, 1.0, [(0, 10.0)])
    b = Flow(1, 1.0, [(0, 10.0), (1, 4.0)])
    c = Flow(2, 1.0, [(1, 4.0)])
    fill_speeds([a, b, c], [10.0, 2.0])
    # resource 1 saturates first: b and c at 0.25; a then takes what b leaves on 0
    assert b.speed == pytest.approx(0.25) and c.speed == pytest.approx(0.25)
    assert a.speed == pytest.approx(0.75)


def test_speeds_capped_at_full_rate_and_ceiling():
    a, b = Flow(0, 1.0, [(0, 1.0)]), Flow(1, 1.0, [(0, 1.0)], cap=0.2)
    fill_speeds([a, b], [10.0])
    assert (a.speed, b.speed) == (1.0, pytest.approx(0.2))


def test_weights_split_a_saturated_resource():
    # a (weight 0.25) and b (weight 1) each want all of resource 0: 0.25 L x 10 + L x 10 = 10
    a, b = Flow(0, 1.0, [(0, 10.0)], weight=0.25), Flow(1, 1.0, [(0, 10.0)])
    fill_speeds([a, b], [10.0])
    assert (a.speed, b.speed) == (pytest.approx(0.2), pytest.approx(0.8))
    # b capped at 0.5 (its cores): a rises on alone until the resource is full
    a, b = Flow(0, 1.0, [(0, 10.0)], weight=0.25), Flow(1, 1.0, [(0, 10.0)], cap=0.5)
    fill_speeds([a, b], [10.0])
    assert (a.speed, b.speed) == (pytest.approx(0.5), pytest.approx(0.5))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.floats(0.05, 4.0), st.floats(0.05, 1.0),
                          st.lists(st.tuples(st.integers(0, 2), st.floats(0.1, 20.0)),
                                   min_size=1, max_size=3, unique_by=lambda u: u[0])),
                min_size=1, max_size=6),
       st.lists(st.floats(1.0, 30.0), min_size=3, max_size=3))
def test_weighted_filling_is_feasible_and_each_flow_is_blocked(spec, capacity):
    """No resource over its capacity, no flow over its cap, and each flow is held by its cap or
    by a full resource on which no flow has a larger speed per weight (weighted max-min)."""
    flows = [Flow(i, 1.0, uses, cap=cap, weight=w) for i, (w, cap, uses) in enumerate(spec)]
    fill_speeds(flows, capacity)
    load = [0.0] * 3
    for f in flows:
        assert 0 < f.speed <= f.cap * (1 + 1e-9)
        for j, d in f.uses:
            load[j] += f.speed * d
    assert all(x <= c * (1 + 1e-9) for x, c in zip(load, capacity, strict=True))
    full = {j for j in range(3) if load[j] >= capacity[j] * (1 - 1e-9)}
    for f in flows:
        if f.speed >= f.cap * (1 - 1e-9):
            continue
        assert any(j in full and all(g.speed / g.weight <= f.speed / f.weight * (1 + 1e-9)
                                     for g in flows if any(k == j for k, _ in g.uses))
                   for j, _ in f.uses)


def test_cast_weight_reproduces_the_measured_split():
    """With the profile's teams-at-once split, a CAST and an ADAM at their full rates on a
    host-memory cap of the teams' total get what each team moved in that run."""
    import dataclasses

    host = load_hardware("h200x2").host
    team = 24
    cast_alone = host.cast_rate(team) * host.cast_dram_bytes_per_elem
    adam_alone = host.adam_rate(team) * host.adam_dram_bytes_per_param
    total, cast_part = 140e9, 30e9
    host = dataclasses.replace(host, dram_teams=(team, team, total), dram_teams_cast_bps=cast_part)
    cast = Flow(0, 1.0, [(0, cast_alone)], weight=host.cast_weight())
    adam = Flow(1, 1.0, [(0, adam_alone)])
    fill_speeds([cast, adam], [total])
    assert cast.speed * cast_alone == pytest.approx(cast_part)
    assert adam.speed * adam_alone == pytest.approx(total - cast_part)
    assert dataclasses.replace(host, dram_teams_cast_bps=None).cast_weight() == 1.0
    with pytest.raises(ValueError, match="outside"):
        dataclasses.replace(host, dram_teams_cast_bps=total).cast_weight()
    with pytest.raises(ValueError, match="weight must be > 0"):
        Flow(0, 1.0, [(0, 1.0)], weight=0.0)


def test_core_pool_water_filling_and_rate_curve():
    hw = load_hardware("h200x2")
    small = Flow(0, 1.0, [], threads=4, curve=hw.host.adam_rate, pool=9)
    big = Flow(1, 1.0, [], threads=32, curve=hw.host.adam_rate, pool=9)
    allocate_cores([small, big], {9: 32.0})
    assert small.cores == 4 and big.cores == 28
    assert big.cap == pytest.approx(hw.host.adam_rate(28) / hw.host.adam_rate(32))


def test_two_adams_share_cores_then_dram():
    # h200x2: 32 cores -> 16 each (3.77 / 5.4 of full rate); DRAM 146 GB/s at 28 B/param binds
    hw = load_hardware("h200x2")
    assert adam_workers_gparam_per_s(hw, 2, 32) == pytest.approx(146 / 28, rel=1e-9)


def test_a800_cast_h2d_one_and_two_gpus():
    hw = load_hardware("a800x4")  # method.md section 9: 15.6 GB/s alone, 8.7 each with two
    assert cast_h2d_gbps(hw, 1, threads=8) == pytest.approx(15.6, rel=0.01)
    assert cast_h2d_gbps(hw, 2, threads=8) == pytest.approx(8.7, rel=0.01)


def test_h100_adam_saturates_near_16_cores():
    hw = load_hardware("h100x8")  # 182-184 GB/s at 16 B/param = 11.4 Gparam/s; 32 cores +8.5-10%
    r8, r16, r32 = (cpu_rate(hw, Kind.ADAM, t) for t in (8, 16, 32))
    assert r16 == pytest.approx(183 / 16, rel=0.01)
    assert 1.085 <= r32 / r16 <= 1.10
    assert r16 / r8 > 1.8


@pytest.mark.parametrize(("gpus", "dirs", "streams", "total_gbps"), [
    (1, ("h2d",), 1, 55.3), (1, ("d2h",), 1, 55.2), (2, ("h2d",), 2, 2 * 54.1),
    (2, ("d2h",), 2, 2 * 53.6), (1, ("h2d", "d2h"), 2, 101.7), (2, ("h2d", "d2h"), 4, 109.5)])
def test_h200_dma_figures(gpus, dirs, streams, total_gbps):
    hw = load_hardware("h200x2")
    assert streams * dma_gbps(hw, gpus, dirs) == pytest.approx(total_gbps, rel=0.002)


def test_h200_cast_and_adam_against_threads():
    hw = load_hardware("h200x2")
    for t, want in ((1, 1.3), (8, 8.2), (16, 11.8), (32, 16.5)):
        assert cpu_rate(hw, Kind.CAST, t) == pytest.approx(want, rel=1e-6)
    for t, want in ((1, 0.59), (8, 3.05), (16, 3.77)):
        assert cpu_rate(hw, Kind.ADAM, t) == pytest.approx(want, rel=1e-6)
    assert 5.1 <= cpu_rate(hw, Kind.ADAM, 32) <= 5.8  # DRAM-bound: 146 GB/s / 28 B
