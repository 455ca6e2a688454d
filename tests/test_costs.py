"""CAST durations (graph/kinds.py, through costs.task_durations): the hardware's cast rate by
chunk size when it has host.cast_chunk_gelem_per_s (interpolated in log chunk size), else the
thread curve; the simulator's core-sharing curve follows the same chunk size. RECOMPUTE
durations with and without policy sac's measured recompute."""

from __future__ import annotations

import tomllib
from dataclasses import replace

import numpy as np
import pytest

from slidedp.graph import build_graph
from slidedp.graph.costs import resource_use, task_core_share, task_durations
from slidedp.graph.rates import dram_bps
from slidedp.graph.sizes import team_share
from slidedp.graph.tasks import Kind
from slidedp.model.predict import predict
from slidedp.sim.resources import task_flows_spec
from slidedp.sim.simulator import simulate
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import LayerTime, load_hardware, parse_hardware, preset_dir
from slidedp.spec.model import load_model
from slidedp.spec.plan import GradRoute, ParamRoute, Plan, default_plan
from slidedp.spec.workload import Workload

MIB = 2**20
# h200x2's thread curve is [[1, 1.3], [8, 8.2], [16, 11.8], [32, 16.5]] Gelem/s; the chunk table
# is slower at 16 MiB than at 256 MiB, and both differ from the thread curve
ROWS = "[[16, 1, 0.9], [16, 16, 6.0], [256, 1, 1.2], [256, 16, 12.0]]"


@pytest.fixture(scope="module")
def hw_chunks(tmp_path_factory):
    path = tmp_path_factory.mktemp("hw") / "chunks.toml"
    text = (preset_dir() / "h200x2.toml").read_text()
    path.write_text(text.replace("cast_dram_bytes_per_elem = 6\n",
                                 f"cast_dram_bytes_per_elem = 6\ncast_chunk_gelem_per_s = {ROWS}\n",
                                 1))
    return load_hardware(str(path))


def _graph(chunk_mib: float = 64.0):
    wl = Workload(load_model("qwen3-0.6b"), 512, 2, 1, 2)
    plan = Plan(**{**default_plan("nvswitch").__dict__, "h2d_chunk_mib": chunk_mib})
    return wl, build_graph(wl, plan, cores=32, iterations=1)


def _casts(g):
    idx = np.flatnonzero(g.kind == int(Kind.CAST))
    assert len(idx)
    return idx


def test_cast_rate_interpolates_in_log_chunk_size(hw_chunks):
    h, e16, e256 = hw_chunks.host, 16 * MIB / 2, 256 * MIB / 2
    assert h.cast_rate(1, e16) == 0.9e9 and h.cast_rate(16, e256) == 12e9
    assert h.cast_rate(1, 64 * MIB / 2) == pytest.approx((0.9e9 + 1.2e9) / 2)  # log midpoint
    assert h.cast_rate(1, 1024) == 0.9e9 and h.cast_rate(1, 1e12) == 1.2e9  # clamped
    assert h.cast_rate(64, e16) == 6e9  # saturates past the last measured thread count
    assert h.cast_rate(8.5, e16) == pytest.approx(0.9e9 + (6e9 - 0.9e9) * 7.5 / 15)
    assert h.cast_rate(8) == pytest.approx(8.2e9)  # no chunk: the thread curve


# By hand: _graph's casts run on 24 threads (Plan().threads(32), a whole team: share 1.0), past
# ROWS's last thread count (16), so a chunk's rate is the 16-thread column: 6.0 Gelem/s at 16 MiB,
# 12.0 at 256 MiB, linear in log chunk size between (64 MiB: log 4 / log 16 = 0.5 of the way).
@pytest.mark.parametrize("chunk_mib, full_s", [
    (16.0, 1.3981013e-3),  # 16 MiB / 2 B = 8,388,608 elements / 6.0e9 elements/s
    (64.0, 3.7282702e-3),  # 33,554,432 elements / ((6.0 + 12.0) / 2 = 9.0e9 elements/s)
])
def test_cast_durations_use_the_chunk_rate_when_present(hw_chunks, chunk_mib, full_s):
    wl, g = _graph(chunk_mib)
    d, idx = task_durations(g, hw_chunks, wl), _casts(g)
    assert (task_core_share(g)[idx] == 1.0).all() and (g.threads[idx] == 24).all()
    full = idx[np.argmax(g.work[idx])]  # a whole plan chunk (the unit's last may be shorter)
    assert g.work[full] == chunk_mib * MIB / 2
    assert d[full] == pytest.approx(full_s, rel=1e-6)
    norm = idx[g.work[idx] == 512]  # a 512-element unit: below 16 MiB, the 16 MiB row's rate
    assert len(norm) and d[norm] == pytest.approx(512 / 6.0e9, rel=1e-6)  # 8.533e-8 s


def test_cast_durations_use_the_thread_curve_without_the_table():
    """h200x2's thread curve at 24 threads, between [16, 11.8] and [32, 16.5] Gelem/s:
    11.8 + (16.5 - 11.8) x 8 / 16 = 14.15 Gelem/s, for every chunk size."""
    hw = load_hardware("h200x2")
    assert hw.host.cast_chunk == ()
    wl, g = _graph()
    d, idx = task_durations(g, hw, wl), _casts(g)
    full = idx[np.argmax(g.work[idx])]
    assert d[full] == pytest.approx(2.3713380e-3, rel=1e-6)  # 33,554,432 / 14.15e9
    assert d[idx] == pytest.approx(g.work[idx] / 14.15e9, rel=1e-6)


def test_simulated_core_sharing_follows_the_chunk_curve(hw_chunks):
    wl, g = _graph()
    d = task_durations(g, hw_chunks, wl)
    specs = task_flows_spec(g, d, resource_use(g, hw_chunks, d), hw_chunks, 0.0)
    for v in _casts(g):
        curve = specs[v][2]
        assert curve(3) == hw_chunks.host.cast_rate(3, g.work[v])
    adam = np.flatnonzero(g.kind == int(Kind.ADAM))[0]
    assert specs[adam][2](3) == hw_chunks.host.adam_rate(3)


def test_the_cast_weight_reaches_the_simulated_casts_only(hw_chunks):
    """With the profile's split, every CAST flow carries HostSpec.cast_weight, every other 1;
    the step changes with it (the cast yields the host-memory cap to Adam)."""
    host = replace(hw_chunks.host, dram_teams=(24, 24, 140e9), dram_teams_cast_bps=30e9)
    hw = replace(hw_chunks, host=host)
    wl, g = _graph()
    d = task_durations(g, hw, wl)
    specs = task_flows_spec(g, d, resource_use(g, hw, d), hw, 0.0)
    casts = set(_casts(g).tolist())
    assert 0 < host.cast_weight() < 1
    assert all(specs[v][3] == (host.cast_weight() if v in casts else 1.0) for v in range(len(g.kind)))
    plan = default_plan("nvswitch")
    equal = replace(hw, host=replace(host, dram_teams_cast_bps=None))
    assert simulate(hw, wl, plan).step_time_s != simulate(equal, wl, plan).step_time_s


def test_the_teams_by_chunk_size_set_the_graphs_cap_and_cast_weight(hw_chunks):
    """With the teams measured by chunk size, a graph whose CPU tasks are those measured there
    (its upload chunk, an FP32 gradient chunk as large) takes the host DRAM cap and the CASTs'
    weight at its upload chunk (HostSpec.teams_at), not the whole-buffer run's; another graph
    keeps the whole-buffer figures; the simulated step follows them."""
    mib = 2**20
    table = ((16 * mib, 80e9, 20e9), (64 * mib, 90e9, 25e9), (256 * mib, 100e9, 34e9))
    host = replace(hw_chunks.host, dram_teams=(24, 24, 140e9), dram_teams_cast_bps=30e9,
                   dram_teams_chunk=table)
    hw = replace(hw_chunks, host=host)
    wl = Workload(load_model("qwen3-0.6b"), 512, 2, 1, 2)
    base = default_plan("nvswitch")

    def graph(h2d_mib: float, d2h_mib: float):
        plan = Plan(**{**base.__dict__, "h2d_chunk_mib": h2d_mib, "d2h_chunk_mib": d2h_mib})
        return plan, build_graph(wl, plan, cores=32, iterations=1)

    # By hand: the weight is the cast's share of the teams' traffic over its traffic alone (its
    # rate at the chunk, ROWS at 24 threads, x 6 B an element), divided by the update's (the
    # rest, over h200x2's AdamW at 24 threads, 3.77 + (5.4 - 3.77) x 8 / 16 = 4.585 Gparam/s,
    # x 28 B a parameter = 128.38 GB/s). The whole-buffer run: 30 / (14.15 x 6) over
    # 110 / 128.38 = 0.353357 / 0.856831 = 0.412400 (the thread curve's cast rate, 14.15).
    assert host.cast_weight() == pytest.approx(0.412400, rel=1e-5)
    for chunk_mib, total, cast, weight in (
            (64, 90e9, 25e9, 0.914387),  # 25 / (9.0 x 6) over 65 / 128.38
            (256, 100e9, 34e9, 0.918544),  # 34 / (12.0 x 6) over 66 / 128.38
            # the teams' rows interpolated in log chunk size, halfway: (90 + 100) / 2 and
            # (25 + 34) / 2; the cast at 128 MiB, 3/4 of the way: 6.0 / 4 + 12.0 x 3 / 4 = 10.5
            (128, 95e9, 29.5e9, 0.917778),  # 29.5 / (10.5 x 6) over 65.5 / 128.38
    ):
        plan, g = graph(chunk_mib, chunk_mib)
        assert host.teams_at(chunk_mib * mib) == (pytest.approx(total), pytest.approx(cast))
        assert dram_bps(g, hw) == pytest.approx(min(total, host.dram_bps))
        d = task_durations(g, hw, wl)
        specs = task_flows_spec(g, d, resource_use(g, hw, d), hw, 0.0)
        assert host.cast_weight(chunk_mib * mib) == pytest.approx(weight, rel=1e-5)
        assert all(specs[v][3] == pytest.approx(weight) for v in _casts(g))
        whole = replace(hw, host=replace(host, dram_teams_chunk=()))
        assert simulate(hw, wl, plan).step_time_s != simulate(whole, wl, plan).step_time_s
    _, g = graph(256, 64)  # the update's chunks are not the ones measured at 256 MiB
    assert g.meta.teams_chunk_bytes is None and dram_bps(g, hw) == pytest.approx(
        min(140e9, host.dram_bps))


def test_predict_runs_with_the_chunk_table(hw_chunks):
    wl = Workload(load_model("qwen3-8b"), 4096, 2, 1, 2)
    base = predict(load_hardware("h200x2"), wl, default_plan("nvswitch"))
    slower = predict(hw_chunks, wl, default_plan("nvswitch"))  # its 64 MiB chunks cast slower
    assert slower.step_time_s >= base.step_time_s * (1 - 1e-9)


def test_team_share_reserves_a_quarter_of_the_cores():
    assert team_share(24, 32) == 1.0 and team_share(12, 16) == 1.0
    assert team_share(32, 32) == pytest.approx(24 / 32)
    assert team_share(0, 32) == 1.0
    assert Plan().threads(32) == (24, 24) and Plan().threads(16) == (12, 12)
    assert Plan(cast_threads=8).threads(32) == (8, 24) and Plan().threads(1) == (1, 1)


def test_oversized_teams_slow_only_their_own_tasks(hw_chunks):
    wl = Workload(load_model("qwen3-0.6b"), seq_len=512, micro_batch=1, global_batch=1, gpus=1)
    base = build_graph(wl, Plan(cast_threads=8, update_threads=12), 16, iterations=1)
    big = build_graph(wl, Plan(cast_threads=8, update_threads=24), 16, iterations=1)
    s_base, s_big = task_core_share(base), task_core_share(big)
    cast, adam = base.kind == int(Kind.CAST), base.kind == int(Kind.ADAM)
    assert (s_base == 1).all() and (s_big[cast] == 1).all()
    assert s_big[adam] == pytest.approx(12 / 24)
    d = task_durations(big, hw_chunks, wl)
    # by hand: a 64 MiB FP32 chunk of 16,777,216 parameters at h200x2's AdamW on 24 threads,
    # 4.585 Gparam/s (3.77 + (5.4 - 3.77) x 8 / 16), on half the cores it asks for:
    # 16777216 / (4.585e9 x 12 / 24) = 7.318306e-3 s
    full = np.flatnonzero(adam)[np.argmax(big.work[adam])]
    assert (big.work[full], big.threads[full]) == (16777216, 24)
    assert d[full] == pytest.approx(7.318306e-3, rel=1e-6)


def _with_memory_cap(tmp_path, gbps: float):
    text = (preset_dir() / "h200x2.toml").read_text()
    path = tmp_path / f"mem{gbps:g}.toml"
    path.write_text(text.replace("cast_dram_bytes_per_elem = 6\n",
                                 f"cast_dram_bytes_per_elem = 6\ndram_dma_gbps = [24, 24, 2, {gbps}]\n",
                                 1))
    return load_hardware(str(path))


def _draws(g, use, kind) -> dict[str, float]:
    """Resource -> amount drawn by the first task of `kind`."""
    v = int(np.flatnonzero(g.kind == int(kind))[0])
    sl = slice(use.ptr[v], use.ptr[v + 1])
    return {use.names[r]: a for r, a in zip(use.res[sl], use.amount[sl], strict=True)}


def test_dma_draws_on_all_host_memory_traffic_only_when_that_is_measured(tmp_path):
    """Without dram_dma the DMA counts against the teams' DRAM cap (host.dram); with it the DMA
    and the CPU kernels share host.mem (all traffic), and only the CPU kernels draw host.dram,
    each the same bytes on both."""
    wl = Workload(load_model("qwen3-0.6b"), 512, 2, 1, 2)
    plan = replace(default_plan("nvswitch"), grad_route=GradRoute.CPU)  # HOST_SUM too
    g = build_graph(wl, plan, cores=32, iterations=1)
    for hw, mem in ((load_hardware("h200x2"), False), (_with_memory_cap(tmp_path, 400.0), True)):
        hw = replace(hw, explicit_topology=None)  # the flat machine's resources (flat_host.py)
        use = resource_use(g, hw, task_durations(g, hw, wl))
        assert ("host.mem" in use.names) == mem
        dram = use.index("host.dram")

        for dma in (Kind.H2D, Kind.D2H):
            d = _draws(g, use, dma)
            assert ("host.dram" in d) != mem and ("host.mem" in d) == mem
        for cpu in (Kind.CAST, Kind.ADAM, Kind.HOST_SUM):
            d = _draws(g, use, cpu)
            assert d["host.dram"] > 0 and (d.get("host.mem") == d["host.dram"]) == mem
        if mem:
            assert use.capacity[use.index("host.mem")] == 400e9
        assert use.capacity[dram] == pytest.approx(hw.host.team_dram_bps(24))


def test_the_dma_weight_draws_the_copies_on_the_cpu_kernels_cap(tmp_path):
    """Beside host.mem, a measured DMA weight w without the slowdown rate (HostSpec.
    dma_slowdown_bps None: here w = 1, where the totals give no rate) makes each copy draw w of
    its bytes on host.dram too, and a host-bound step predicted with it is slower; without one
    the copies leave host.dram to the CPU kernels (the rate's case: test_sim_dma_slowdown.py)."""
    text = (preset_dir() / "h200x1.toml").read_text()
    wl = Workload(load_model("qwen3-0.6b"), 512, 1, 1, 1)
    plan = default_plan("pcie")
    g = build_graph(wl, plan, cores=16, iterations=1)
    hws = []
    for weight in (None, 1):
        extra = "dram_teams_gbps = [12, 12, 100.0]\ndram_dma_gbps = [12, 12, 1, 140.0]\n"
        if weight is not None:
            extra += f"dram_dma_weight = {weight}\n"
        path = tmp_path / f"w{weight}.toml"
        path.write_text(text.replace("[host]\n", "[host]\n" + extra, 1))
        hws.append(load_hardware(str(path)))
    assert hws[1].host.dram_dma_weight == 1 and hws[1].host.dma_slowdown_bps() is None
    for hw, w in zip(hws, (0.0, 1.0), strict=True):
        use = resource_use(g, hw, task_durations(g, hw, wl))
        for dma in (Kind.H2D, Kind.D2H):
            d = _draws(g, use, dma)
            assert d.get("host.dram", 0.0) == pytest.approx(w * d["host.mem"])
    for model in (predict, simulate):  # the copies now slow the update beside them
        steps = [model(hw, wl, plan).step_time_s for hw in hws]
        assert steps[1] > 1.01 * steps[0], model


def test_the_memory_cap_frees_the_dma_only_above_the_teams_cap(tmp_path):
    """A measured all-traffic rate at or below the teams' cap predicts as the unmeasured spec
    (host.mem is floored at host.dram's cap); a larger one lets the DMA run beside the CPU
    kernels: a host-bound step gets shorter."""
    wl = Workload(load_model("qwen3-0.6b"), 512, 2, 1, 2)
    plan = default_plan("nvswitch")
    steps = [predict(hw, wl, plan).step_time_s
             for hw in (load_hardware("h200x2"), _with_memory_cap(tmp_path, 100.0),
                        _with_memory_cap(tmp_path, 1000.0))]
    assert steps[1] == pytest.approx(steps[0], rel=1e-9)
    assert steps[2] < 0.97 * steps[0]


def _recompute_ms(hw, wl, policy: str) -> float:
    g = build_graph(wl, default_plan(hw.fabric.kind).with_overrides(
        layer_policies=(policy,) * wl.model.n_layers), hw.host.cores)
    d = task_durations(g, hw, wl)[g.kind == int(Kind.RECOMPUTE)]
    return float(np.median(d)) * 1e3


@pytest.mark.parametrize("accum", [1, 3])
def test_recompute_prices_elementwise_bytes_by_the_measured_sac(accum):
    """With sac's measured recompute fraction, `layer` recomputes one forward and `sac` that
    fraction of it (per micro-batch, times the micro-batches), and a segment policy its FLOP
    share of the forward's matmul time plus its elementwise bytes at sac's rate (Qwen3-4B seq
    16384 on nvidia-h200, 04:28: fwd 11.66 ms, sac 4.23 ms; seg:0b0100100 measured 5.39 ms,
    modelled 5.28; without sac's figure ~2.1)."""
    m = load_model("qwen3-4b")
    base = load_hardware("h200x1")
    lt = LayerTime(m.hidden, m.ffn, 16384, 1, 3 * 0.01166, "test")
    without = replace(base, gpu=replace(base.gpu, layer_times=(lt,)))
    hw = replace(base, gpu=replace(base.gpu, layer_times=(
        replace(lt, sac_recompute_fraction=4.23 / 11.66),)))
    wl = Workload(m, 16384, accum, 1, 1)
    assert _recompute_ms(hw, wl, "layer") == pytest.approx(11.66 * accum, rel=1e-6)
    assert _recompute_ms(hw, wl, "sac") == pytest.approx(4.23 * accum, rel=1e-6)
    assert _recompute_ms(hw, wl, "seg:0b0100100") == pytest.approx(5.28 * accum, abs=0.01 * accum)
    assert _recompute_ms(without, wl, "seg:0b0100100") < 2.2 * accum  # the preset's k: 2.11
    assert _recompute_ms(without, wl, "sac") < 0.5 * accum  # the HBM rate: a tenth of measured


def test_the_matmuls_never_run_above_the_gpus_peak():
    """A sac fraction that would leave the matmuls less time than the forward's FLOPs need at the
    GPU's peak (timings from two setups, noise) is held there: `layer` still recomputes one
    forward, `sac` less than its fraction of it."""
    m = load_model("qwen3-4b")
    base = load_hardware("h200x1")
    lt = LayerTime(m.hidden, m.ffn, 4096, 1, 3 * 0.0026, "test", sac_recompute_fraction=0.85)
    hw = replace(base, gpu=replace(base.gpu, layer_times=(lt,)))
    wl = Workload(m, 4096, 1, 1, 1)
    assert _recompute_ms(hw, wl, "layer") == pytest.approx(2.6, rel=1e-6)
    # By hand (Qwen3-4B: h 2560, q 32 x 128 = 4096, k 8 x 128 = 1024, w 9728, q/k norms):
    # forward matmul FLOPs a token 2h(q + 2k) + 2q.seq + 2qh + 4hw + 2wh = 31,457,280 +
    # 33,554,432 + 20,971,520 + 99,614,720 + 49,807,360 = 235,405,312; x 4096 tokens at the
    # H200's 989 TFLOP/s: 0.974945 ms, leaving 2.6 - 0.974945 = 1.625055 ms of elementwise work.
    # Elementwise HBM bytes a token: 4h + 8(q + k) + 6h + 4h + 6w + 6h = 150,528; sac recomputes
    # the norms (4h twice), q/k norm + RoPE (8(q + k)), the o_proj input copy (4q) and SiLU(g) u
    # (6w): 136,192, 0.904762 of them: 1.625055 x 0.904762 = 1.470288 ms, below 0.85 x 2.6.
    assert _recompute_ms(hw, wl, "sac") == pytest.approx(1.470288, rel=1e-6)


@pytest.mark.parametrize("bad", [-1.0, 0.0, 1.0, 2.5])
def test_sac_recompute_fraction_must_be_within_the_forward(bad):
    doc = tomllib.loads((preset_dir() / "h200x1.toml").read_text())
    doc["gpu"]["layer_time"] = [{"hidden": 2560, "ffn": 9728, "seq": 4096, "micro_batch": 1,
                                 "fwd_bwd_s": 0.009, "sac_recompute_fraction": bad, "source": "x"}]
    with pytest.raises(SpecError, match=r"bad.toml.*layer_time\[0\]\.sac_recompute_fraction"):
        parse_hardware(doc, "bad.toml")


def test_the_fraction_holds_at_the_measured_micro_batches_ends():
    base = load_hardware("h200x1")
    rows = tuple(LayerTime(2560, 9728, 4096, b, 0.01 * b, "t", sac_recompute_fraction=f)
                 for b, f in ((1, 0.4), (4, 0.3)))
    gpu = replace(base.gpu, layer_times=rows)
    at = [gpu.measured_sac_recompute_fraction(2560, 9728, 4096, b) for b in (1, 2, 4, 8)]
    assert at == pytest.approx([0.4, 0.4 - 0.1 / 3, 0.3, 0.3])


def test_the_policy_shortlist_prices_recompute_as_the_costs_do():
    """AutoPolicy's model-costed policies (policy/activations.profile_policies) take the same k:
    with sac's measured recompute, sac's recompute fraction is its measured share of the fwd."""
    from slidedp.policy.activations import profile_policies

    m = load_model("qwen3-4b")
    base = load_hardware("h200x1")
    lt = LayerTime(m.hidden, m.ffn, 16384, 1, 3 * 0.01166, "test",
                   sac_recompute_fraction=4.23 / 11.66)
    hw = replace(base, gpu=replace(base.gpu, layer_times=(lt,)))
    fractions = {p.name: p.recompute_fraction
                 for p in profile_policies(hw, Workload(m, 16384, 1, 1, 1))}
    assert fractions["layer"] == pytest.approx(1.0)
    assert fractions["sac"] == pytest.approx(4.23 / 11.66, rel=1e-6)


def _with_agent_gaps(tmp_path, line: str):
    text = (preset_dir() / "h200x2.toml").read_text()
    path = tmp_path / "gaps.toml"
    path.write_text(text.replace("cast_dram_bytes_per_elem = 6\n",
                                 f"cast_dram_bytes_per_elem = 6\n{line}\n", 1))
    return load_hardware(str(path))


def test_the_dispatch_cost_lengthens_each_cast_and_update_and_the_host_bound_step(tmp_path):
    """host.agent_gap_us adds its kind's dispatch seconds to every CAST and ADAM (nothing else),
    and the host-bound step grows by at most that much per such task, by more than the update
    chain's share of it."""
    base = load_hardware("h200x2")
    hw = _with_agent_gaps(tmp_path, "agent_gap_us = { cast = 80.0, adam = 120.0 }")
    assert dict(hw.host.task_gap_s) == pytest.approx({"cast": 80e-6, "adam": 120e-6})
    wl, g = _graph()
    d0, d1 = task_durations(g, base, wl), task_durations(g, hw, wl)
    gap = {int(Kind.CAST): 80e-6, int(Kind.ADAM): 120e-6}
    assert np.allclose(d1 - d0, [gap.get(int(k), 0.0) for k in g.kind])
    wl1 = Workload(load_model("qwen3-4b"), 4096, 1, 1, 1)  # host-bound: the update chain binds
    plan = Plan(**{**default_plan("nvswitch").__dict__, "param_route": ParamRoute.REPLICATED})
    s0, s1 = simulate(base, wl1, plan), simulate(hw, wl1, plan)
    g1 = build_graph(wl1, plan, cores=32, iterations=1)
    adams = int(np.sum(g1.kind == int(Kind.ADAM)))
    casts = int(np.sum(g1.kind == int(Kind.CAST)))
    grown = s1.step_time_s - s0.step_time_s
    assert 0.5 * adams * 120e-6 < grown <= adams * 120e-6 + casts * 80e-6


@pytest.mark.parametrize("line, why", [
    ("agent_gap_us = { h2d = 5.0 }", "one of cast, adam"),
    ("agent_gap_us = { adam = -1.0 }", r"microseconds in \[0, 10000\)"),
    ("agent_gap_us = 100.0", "a table"),
])
def test_bad_dispatch_costs_are_refused(tmp_path, line, why):
    with pytest.raises(SpecError, match=why):
        _with_agent_gaps(tmp_path, line)
