"""The copies' slowdown of the CPU kernels in the simulator's FluidShare (resources.py stage 3):
beside copies of D bytes/s every CPU flow runs at S / (S + D) of its speed, whatever its own
traffic, the copies unslowed by it; at the teams' cap that is the profile's paired measurement;
the fast path (no recomputation) agrees with a full recomputation."""

import numpy as np
import pytest
import simpy
from hypothesis import given, settings
from hypothesis import strategies as st

from slidedp.graph import build_graph
from slidedp.graph.costs import resource_use, task_durations
from slidedp.graph.tasks import Kind
from slidedp.model.predict import predict
from slidedp.sim.engine import FluidShare
from slidedp.sim.resources import Flow, task_flows_spec
from slidedp.sim.simulator import simulate
from slidedp.spec.hardware import load_hardware, preset_dir
from slidedp.spec.model import load_model
from slidedp.spec.plan import default_plan
from slidedp.spec.workload import Workload

DRAM, CORES, MEM = 0, 1, 2  # resource indices: the kernels' cap, the core pool, all traffic
CAPACITY = [100.0, 16.0, 400.0]


def _share(slowdown: float) -> tuple[simpy.Environment, FluidShare]:
    env = simpy.Environment()
    return env, FluidShare(env, list(CAPACITY), {CORES: 16.0}, ((slowdown, MEM, DRAM),))


def _cpu(task: int, gbps: float, threads: float = 8.0, seconds: float = 1.0) -> Flow:
    return Flow(task, seconds, [(DRAM, gbps), (MEM, gbps)], threads=threads, pool=CORES)


def _copy(task: int, gbps: float, seconds: float = 1.0) -> Flow:
    return Flow(task, seconds, [(MEM, gbps)])


def _start(env, share, *flows):
    for f in flows:
        f.done = env.event()
        share.start(f)


@pytest.mark.parametrize("slowdown", [0.0, 140.0])
def test_a_copy_slows_a_lone_update_far_below_the_cap(slowdown):
    env, share = _share(slowdown)
    update, copy = _cpu(0, 60.0), _copy(1, 50.0, seconds=5.0)
    _start(env, share, update)
    assert update.speed == 1.0
    _start(env, share, copy)
    expected = 140.0 / 190.0 if slowdown else 1.0
    assert update.speed == pytest.approx(expected) and copy.speed == pytest.approx(1.0)
    env.run(until=update.done)  # the update ends after 1 / expected s: the copy runs on alone
    assert env.now == pytest.approx(1.0 / expected)
    assert share.flows == [copy] and copy.speed == 1.0


def test_a_small_kernel_loses_the_same_fraction_and_the_copy_nothing():
    """A kernel of almost no traffic of its own (a small cast, mostly dispatch) is slowed as
    much as a large one, never to a standstill (a cap that followed its demand would)."""
    env, share = _share(140.0)
    small, copy = _cpu(0, 0.3), _copy(1, 50.0)
    _start(env, share, small, copy)
    assert small.speed == pytest.approx(140.0 / 190.0) and copy.speed == 1.0


def test_at_the_teams_cap_it_is_the_profiles_paired_measurement():
    """Teams that reach the cap T alone (here 100 of their 150 at full rate) beside copies of D':
    the teams move T' = T x S / (S + D'); with S = T' / w that is T - w D', the paired run's."""
    env, share = _share(140.0)
    cast, update, copy = _cpu(0, 50.0), _cpu(1, 100.0), _copy(2, 60.0)
    _start(env, share, cast, update, copy)
    teams = 50.0 * cast.speed + 100.0 * update.speed
    assert teams == pytest.approx(100.0 * 140.0 / 200.0)
    w = teams / 140.0
    assert teams == pytest.approx(100.0 - w * 60.0) and copy.speed == 1.0


def test_the_copies_rate_settles_where_the_kernels_free_host_memory():
    """Copies held by all host-memory traffic speed up as the kernels slow: the factor is the
    one the copies' settled rate gives, also where a plain iteration crawls (host.mem at the
    kernels' cap: the root of 136.8 k^2 - 261.8 k + 125 = 0 below 1, copy speed 0.808)."""
    for capacity, cpu_gbps, copy_gbps, slowdown in (([100.0, 16.0, 120.0], 80.0, 100.0, 100.0),
                                                   ([136.8, 16.0, 136.8], 300.0, 14.6, 125.0)):
        env = simpy.Environment()
        share = FluidShare(env, capacity, {CORES: 16.0}, ((slowdown, MEM, DRAM),))
        update, copy = _cpu(0, cpu_gbps), _copy(1, copy_gbps)
        _start(env, share, update, copy)
        k = slowdown / (slowdown + copy_gbps * copy.speed)
        assert share.load[MEM] == pytest.approx(capacity[MEM])  # host.mem full
        assert cpu_gbps * update.speed <= capacity[DRAM] * k * (1 + 1e-9)
        assert update.speed <= k * (1 + 1e-9)
        assert update.speed == pytest.approx(min(k, capacity[DRAM] * k / cpu_gbps), rel=1e-6)
    assert copy.speed == pytest.approx((1 - 0.913827) * 136.8 / 14.6, rel=1e-3)


flows_st = st.lists(st.tuples(st.booleans(), st.floats(0.1, 120.0), st.floats(1.0, 16.0),
                              st.floats(0.1, 3.0), st.floats(0.0, 2.0)), min_size=1, max_size=7)


@settings(max_examples=60, deadline=None)
@given(flows_st, st.sampled_from([0.0, 50.0, 140.0]))
def test_fast_path_matches_a_full_recomputation_at_every_event(spec, slowdown):
    """Flows start at random times and end by themselves; at each start and each end the speeds
    equal what a full recomputation gives, and no resource runs above its capacity."""
    env, share = _share(slowdown)
    mismatches = []

    def check(_event=None):
        speeds = [f.speed for f in share.flows]
        # the fast path's bookkeeping is what the running flows draw (before recomputing it)
        drawn = [0.0] * len(CAPACITY)
        for f in share.flows:
            for j, d in f.uses:
                drawn[j] += f.speed * d
        assert share.load == pytest.approx(drawn, rel=1e-9, abs=1e-9)
        assert share.running == {"cpu": sum(f.pool >= 0 for f in share.flows),
                                 "copy": sum(f.pool < 0 for f in share.flows)}
        assert share.pool_threads[CORES] == pytest.approx(
            sum(f.threads for f in share.flows if f.pool >= 0), abs=1e-9)
        share._recompute()
        if [f.speed for f in share.flows] != pytest.approx(speeds, rel=1e-9, abs=1e-12):
            mismatches.append((env.now, speeds, [f.speed for f in share.flows]))
        for j, load in enumerate(share.load):
            assert load <= CAPACITY[j] * (1 + 1e-9)

    def launch(i, is_cpu, gbps, threads, seconds, at):
        yield env.timeout(at)
        f = _cpu(i, gbps, threads, seconds) if is_cpu else _copy(i, gbps, seconds)
        _start(env, share, f)
        check()
        f.done.callbacks.append(check)

    for i, args in enumerate(spec):
        env.process(launch(i, *args))
    env.run()
    assert not mismatches and not share.flows


def _dma_profile(tmp_path, extra: str):
    text = (preset_dir() / "h200x1.toml").read_text()
    f = tmp_path / "dma.toml"
    f.write_text(text.replace("[host]\n", "[host]\n" + extra, 1))
    return load_hardware(str(f))


def test_the_slowdown_rate_comes_from_the_profiles_paired_run(tmp_path):
    base = "dram_teams_gbps = [12, 12, 100.0]\ndram_dma_gbps = [12, 12, 1, 140.0]\n"
    # the teams beside the copies recorded: S = T' / w
    hw = _dma_profile(tmp_path, base + "dram_dma_weight = 0.5\ndram_dma_teams_gbps = 70.0\n")
    assert hw.host.dma_slowdown_bps() == pytest.approx(140e9)
    # before it was recorded: D' = (140 - 100) / (1 - w) = 80, T' = 60, S = 120
    hw = _dma_profile(tmp_path, base + "dram_dma_weight = 0.5\n")
    assert hw.host.dma_slowdown_bps() == pytest.approx(120e9)
    assert _dma_profile(tmp_path, base).host.dma_slowdown_bps() is None
    # no derivation where it gives no copies' traffic (w = 1, a total at the teams' alone)
    assert _dma_profile(tmp_path, base + "dram_dma_weight = 1\n").host.dma_slowdown_bps() is None
    flat = base.replace("[12, 12, 1, 140.0]", "[12, 12, 1, 95.0]") + "dram_dma_weight = 0.5\n"
    assert _dma_profile(tmp_path, flat).host.dma_slowdown_bps() is None
    recorded = base + "dram_dma_weight = 1\ndram_dma_teams_gbps = 70.0\n"
    assert _dma_profile(tmp_path, recorded).host.dma_slowdown_bps() == pytest.approx(70e9)
    assert load_hardware("h200x1").host.dma_slowdown_bps() is None
    with pytest.raises(Exception, match=r"host\.dram_dma_teams_gbps.*between 0"):
        _dma_profile(tmp_path, base + "dram_dma_weight = 0.5\ndram_dma_teams_gbps = 150.0\n")
    with pytest.raises(Exception, match=r"host\.dram_dma_teams_gbps.*beside host\.dram_dma_w"):
        _dma_profile(tmp_path, base + "dram_dma_teams_gbps = 70.0\n")


def test_the_bound_takes_the_slowdowns_linear_part_and_the_simulator_the_slowdown(tmp_path):
    """With S, resource_use names the slowdown and its resources, and each copy draws on
    host.dram the slowdown's linear bound, cap / (S + D_max) of its bytes, which the simulator's
    flows leave out; with the weight alone (w = 1: no S) each copy draws w of its bytes there,
    in both. The slowed step is longer than without the weight and never below the bound."""
    dma = "dram_teams_gbps = [12, 12, 100.0]\ndram_dma_gbps = [12, 12, 1, 140.0]\n"
    hws = [_dma_profile(tmp_path, dma + extra) for extra in
           ("", "dram_dma_weight = 0.5\n", "dram_dma_weight = 1\n")]
    wl = Workload(load_model("qwen3-0.6b"), 512, 1, 1, 1)
    plan = default_plan("nvswitch")
    g = build_graph(wl, plan, hws[0].host.cores)
    copies = np.flatnonzero(np.isin(g.kind, [int(Kind.H2D), int(Kind.D2H)]))
    for hw, slowdown in zip(hws, (0.0, 120e9, 0.0), strict=True):
        durations = task_durations(g, hw, wl)
        use = resource_use(g, hw, durations)
        dram, mem = use.index("host.dram"), use.index("host.mem")
        assert use.slowdowns == (((pytest.approx(slowdown), mem, dram),) if slowdown else ())
        d_max = min(use.capacity[mem], use.capacity[use.index("host.pcie")])
        weight = (use.capacity[dram] / (slowdown + d_max) if slowdown
                  else hw.host.dram_dma_weight)
        specs = task_flows_spec(g, durations, use, hw, 0.1)
        for v in copies:
            draws = dict(zip(use.res[use.ptr[v]:use.ptr[v + 1]].tolist(),
                             use.amount[use.ptr[v]:use.ptr[v + 1]].tolist(), strict=True))
            assert draws.get(dram, 0.0) == pytest.approx(weight * draws[mem])
            assert (dram in [j for j, _ in specs[v][0]]) == (weight > 0 and not slowdown)
    plain, slowed = (simulate(hw, wl, plan) for hw in hws[:2])
    assert slowed.step_time_s > plain.step_time_s
    assert slowed.step_time_s >= predict(hws[1], wl, plan).lower_bound_s * (1 - 1e-9)
