"""`slidedp profile`'s CUDA measurements on the device (pytest -m gpu): plausible rates, the layer
policies, NCCL with two GPUs or more, and a whole command run whose TOML loads.

Bounds are wide (they hold on any recent NVIDIA GPU): they catch a wrong unit or a timing that
misses its work, not a slow machine.
"""

from __future__ import annotations

import argparse

import pytest
import torch

from slidedp.commands import profile as profile_cmd
from slidedp.profile import sizes as sizes_mod
from slidedp.profile.compute import LayerBench, matmul_flops_per_s
from slidedp.profile.fabric import LATENCY_BYTES, collective_times_s
from slidedp.profile.host import CastChunkBench
from slidedp.profile.pcie import PcieBench
from slidedp.profile.sizes import MIB, Sizes
from slidedp.spec.hardware import COLLECTIVES, load_hardware
from slidedp.spec.model import load_model

pytestmark = pytest.mark.gpu
GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
SMALL = Sizes(host_floor_bytes=64 * MIB, llc_multiple=0, thread_step=4, chunk_mib=(4, 64),
              stream_copies=2, collective_mib=(4, 64), micro_batches=(1, 2), warmup=1, repeats=3,
              sustained_s=0.4, sustained_min_iters=4)


def test_pcie_rates_by_chunk_and_duplex():
    bench = PcieBench(1, 64 * MIB, 4, 1, 5)
    try:
        rates = {(d, c): bench.alone_bps(0, d, c * MIB) for d in ("h2d", "d2h") for c in (4, 64)}
        duplex = bench.duplex_bps(0)
    finally:
        bench.close()
    for (d, c), r in rates.items():
        assert 1e9 < r < 300e9, (d, c, r)
    assert rates[("h2d", 64)] > 0.8 * rates[("h2d", 4)]  # larger copies are not slower
    assert 0.8 * rates[("h2d", 64)] < duplex < 2.2 * max(rates.values())


def test_layer_policies_and_flops():
    bench = LayerBench(load_model("qwen3-0.6b"), 1, 3)
    none, layer = bench.time(1024, 2, "none"), bench.time(1024, 2, "layer")
    assert none.fwd_s > 0 and none.bwd_s > none.fwd_s  # bwd is about 2 fwd
    assert layer.fwd_s < none.fwd_s * 1.5  # no-grad forward
    assert layer.total_s > none.total_s  # the recompute costs
    assert 1e12 < none.flops_per_s < 2500e12


def test_sustained_layer_runs_both_policies_back_to_back():
    bench = LayerBench(load_model("qwen3-0.6b"), 1, 3)
    short = bench.time(1024, 2, "none")
    out = bench.sustained(1024, 2, {"layer": 8, "none": 10})
    assert [(t.policy, t.iterations) for t in out] == [("layer", 8), ("none", 10)]
    layer, none = out
    assert none.span_s == layer.span_s > 0 and 0 < none.busy <= 1.0 + 1e-6
    # the span's busy time is the 18 iterations' (span x busy = their summed times)
    assert 0.7 < none.span_s * none.busy / (8 * layer.total_s + 10 * none.total_s) < 1.5
    assert 0.5 * short.total_s < none.total_s < 2 * short.total_s
    assert layer.total_s > none.total_s


def test_cast_by_chunk_into_a_pinned_ring():
    bench = CastChunkBench([2 * MIB, 32 * MIB], 64 * MIB, 4, True, 1, 3)
    try:
        assert bench.pinned and bench.src_elems == 64 * MIB
        rates = {n: bench.elems_per_s(n, 4) for n in (2 * MIB, 32 * MIB)}
        assert bench.repeats_for(2 * MIB) == 16
    finally:
        bench.close()
    assert not bench.pinned
    for n, r in rates.items():
        assert 0.05e9 < r < 200e9, (n, r)


def test_matmul_rate():
    assert 20e12 < matmul_flops_per_s(2, 10) < 2500e12


@pytest.mark.gpu(2)
def test_collectives_on_all_gpus():
    t = collective_times_s(GPUS, [4 * MIB, 64 * MIB], 1, 3, 300)
    for op in COLLECTIVES:
        assert 0 < t[(op, 4 * MIB)] < t[(op, 64 * MIB)] < 1.0, op
    assert 0 < t[("latency", LATENCY_BYTES)] < 0.01


def test_profile_command_writes_a_measured_spec(tmp_path, monkeypatch):
    monkeypatch.setattr(sizes_mod, "QUICK", SMALL)
    out = tmp_path / "gpu.toml"
    parser = argparse.ArgumentParser()
    profile_cmd.register(parser.add_subparsers())
    args = parser.parse_args(["profile", "--quick", "--out", str(out), "--model", "qwen3-0.6b",
                              "--seq", "1024", "--base", "h200x2"])
    assert args.func(args) == 0
    hw = load_hardware(str(out))
    assert hw.gpu.model == torch.cuda.get_device_name(0) and hw.gpu.count == GPUS
    assert [lt.micro_batch for lt in hw.gpu.layer_times] == [1, 2]
    assert all("policy layer" in lt.source for lt in hw.gpu.layer_times)
    assert all("sustained: " in lt.source and "short runs" in lt.source
               for lt in hw.gpu.layer_times)
    # policy sac's recompute: memory-bound, a fraction of the layer's forward
    assert all(0 < lt.sac_recompute_fraction < 1 and "sac_recompute_fraction" in lt.source
               for lt in hw.gpu.layer_times)
    assert [c for c, _ in hw.host.cast_chunk] == [2 * MIB, 32 * MIB]  # BF16 elements
    # the executor's dispatch cost per CPU task, from a short run of the model cut to 2 layers
    assert set(hw.host.task_gap_s) == {"cast", "adam"}
    assert all(0 <= s < 0.01 for s in hw.host.task_gap_s.values())
    assert "qwen3-0.6b cut to 2 decoder layers" in hw.host.sources["agent_gap_us"]
    assert "pinned with cudaHostRegister" in hw.host.sources["cast_chunk_gelem_per_s"]
    assert "slidedp profile" in hw.pcie.sources["h2d_gbps"]
    assert [c for c, _, _ in hw.pcie.chunk_bps] == [4 * MIB, 64 * MIB]
    assert "not measured here (a datasheet figure)" in hw.gpu.sources["peak_bf16_tflops"]
    measured_fabric = GPUS >= 2
    assert ("slidedp profile" in hw.fabric.sources["efficiency"]) == measured_fabric
    cast_t, update_t, gpus, bps = hw.host.dram_dma  # the teams with every GPU's copies
    assert (cast_t, update_t, gpus) == (*hw.host.dram_teams[:2], GPUS) and 1e9 < bps < 2e12
    assert hw.host.memory_bps() == bps and "GPU(s) copying" in hw.host.sources["dram_dma_gbps"]
    assert 0 <= hw.host.dram_dma_weight <= 1 and "copies' traffic" in hw.host.sources[
        "dram_dma_weight"]
    assert 0 < hw.host.dram_dma_teams_bps < bps and "own part" in hw.host.sources[
        "dram_dma_teams_gbps"]
