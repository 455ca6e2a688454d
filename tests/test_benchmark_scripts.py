"""Smoke runs of the benchmark scripts on the CPU (tiny model): they must not rot between GPU
sessions, since device time is too short to debug them there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MIB = 2**20


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)


def test_loss_vs_resident_matches_in_float32(tmp_path):
    out = tmp_path / "lvr.json"
    p = _run("benchmarks/loss_vs_resident.py", str(out), "--model", "tiny-qwen3", "--steps", "4",
             "--seq", "32", "--device", "cpu", "--lr", "1e-3", "--batches", "2")
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert len(d["ours"]) == len(d["reference"]) == 4
    assert d["ours"][-1] < d["ours"][0]  # it trains
    assert d["max_abs_diff"] < 1e-5  # float32: the same math up to summation order


def test_multi_gpu_benchmark_runs_cases_with_plan_overrides(tmp_path):
    out = tmp_path / "mg.jsonl"
    p = _run("benchmarks/multi_gpu.py", str(out), "tiny-qwen3",
             "2:1:sharded:gpu:rank0:window_slots=2", "--seq", "32", "--iters", "2",
             "--discard", "1", "--device", "cpu")
    assert p.returncode == 0, p.stderr
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["plan"]["window_slots"] == 2 and row["accum"] == 2 and row["step_s"] > 0
    (idle,) = row["compute_idle_s"]  # one GPU (here the CPU device): its exposed seconds
    assert 0 <= idle < row["all_steps_s"][-1]


def test_multi_gpu_benchmark_on_two_ranks_and_a_failing_case(tmp_path):
    """Under torchrun, two CPU ranks: a good case writes one row for both ranks; a bad case
    string ends both ranks with its error (the session's exit path: the script leaves its
    session through a context, so a rank's failure reaches the session's failure protocol,
    tests/test_dist_faults.py, which prints the rank's failure)."""
    out = tmp_path / "mg2.jsonl"
    torchrun = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")
    p = _run(*torchrun, "benchmarks/multi_gpu.py", str(out), "tiny-qwen3",
             "2:1:sharded:gpu:rank0:window_slots=2", "--seq", "32", "--iters", "2",
             "--discard", "1", "--device", "cpu")
    assert p.returncode == 0, p.stderr[-3000:]
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert row["ranks"] == 2 and row["step_s"] > 0
    p = _run(*torchrun, "benchmarks/multi_gpu.py", str(tmp_path / "bad.jsonl"), "tiny-qwen3",
             "2:1:sharded:gpu:rank0:layer_policies=[nope]", "--seq", "32", "--iters", "2",
             "--discard", "1", "--device", "cpu")
    assert p.returncode != 0 and "nope" in p.stderr, p.stderr[-3000:]
    # through DistSession's failure protocol: "slidedp rank R: failed: SpecError ..." from the
    # rank that marked the failure, "... stopping: rank R failed: SpecError ..." from one that
    # stopped for it (an uncaught error would print only its traceback)
    assert "failed: SpecError" in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "bad.jsonl").exists()


def test_probe_state_check_times_both_states_interleaved(tmp_path):
    out = tmp_path / "ps.json"
    p = _run("benchmarks/probes/probe_state_check.py", str(out), "--model", "tiny-qwen3",
             "--seq", "32", "--device", "cpu", "--iters", "2", "--discard", "1", "--runs", "2",
             "--distinct-layers", "1")
    assert p.returncode == 0, p.stderr
    d = json.loads(out.read_text())
    assert set(d["build_s"]) == {"whole", "shared"} and d["distinct_layers"] == 1
    assert d["state_bytes"]["shared"] < d["state_bytes"]["whole"]  # tiny-qwen3's 2 layers share
    assert all(len(v) == 2 and min(v) > 0 for v in d["runs_s"].values())
    assert all(len(v) == 2 for kinds in d["host_passes_s"].values() for v in kinds.values())
    assert d["shared_over_whole"] > 0 and p.stdout.index("run 1 whole") < p.stdout.index("run 1 shared")


def test_project_hardware_changes_only_what_the_larger_kind_differs_in(tmp_path):
    """The h200x8 preset is what project_hardware.py makes of the measured x4 profile (with the
    preset's assumed NIC); a run with the profile's own GPU count and cores only renames it."""
    from slidedp.spec.hardware import load_hardware

    src = "benchmarks/results/2026-11-30-h200x4-profile-2135.toml"
    out = tmp_path / "x8.toml"
    nic = tomllib.loads((ROOT / "slidedp/presets/hardware/h200x8.toml").read_text())["network"]
    p = _run("benchmarks/project_hardware.py", src, str(out), "--name", "h200x8", "--gpus", "8",
             "--cores", "128", "--ram-gib", "560", "--kind", "nvidia-h200-x8",
             "--nic-gbps", str(nic["nic_gbps"]), "--nic-latency-us", str(nic["nic_latency_us"]),
             "--nic-source", nic["source"])
    assert p.returncode == 0, p.stderr
    assert out.read_text() == (ROOT / "slidedp/presets/hardware/h200x8.toml").read_text()
    x4, x8 = load_hardware(src), load_hardware(str(out))
    assert (x8.gpu.count, x8.host.cores) == (8, 128) and x8.pcie == x4.pcie.__class__(
        **{**vars(x4.pcie), "sources": x8.pcie.sources})  # the rates carried over as measured
    assert x8.fabric.sources["link_gbps"].startswith("projected: the fabric of 4 GPUs")
    assert x8.host.sources["adam_gparam_per_s"].startswith("projected: as in h200x4-profile-2135")
    # thread curves cut at the x4's team size (48 of 64 cores): its 64-thread points ran teams on
    # every core (the cast by chunk at a third of its 48-thread rate), which the simulator's
    # team share models on its own
    assert max(x8.host.cast_elems_per_s.xs) == 48 < max(x4.host.cast_elems_per_s.xs)
    assert x8.host.cast_rate(96, 2**25) == x4.host.cast_rate(48, 2**25) > x4.host.cast_rate(64, 2**25)
    same = tmp_path / "x4.toml"
    p = _run("benchmarks/project_hardware.py", src, str(same), "--name", "h200x4", "--gpus", "4",
             "--cores", "64", "--ram-gib", "503.8", "--kind", "nvidia-h200-x4")
    assert p.returncode == 0, p.stderr
    assert load_hardware(str(same)).host == x4.host and "projected" not in same.read_text()


def test_confirm_sweep_reruns_the_deciding_rows_interleaved(tmp_path):
    """confirm_sweep.py picks the chosen plan (a new choice, given by its path), the default (the
    grid's first row) and the fastest other row of a sweep (not the grid's copy of the new choice,
    which names its one policy once where the new plan names it per layer; not a row over the cap),
    runs them interleaved --runs times and prints the ratios from the means."""
    from slidedp.spec.plan import Plan, plan_dict
    plan = tmp_path / "plan.toml"
    plan.write_text('[plan]\nparam_route = "replicated"\nwindow_slots = 2\n'
                    'layer_policies = ["sac", "sac"]\n')

    def row(case, step_s, peak_gib, **fields):
        return {"case": case, "step_s": step_s, "gpu_peak_gib": peak_gib,
                "plan": plan_dict(Plan(**fields)), "model": "tiny-qwen3", "seq": 32, "ranks": 1}
    grid = [row("2:2:sharded:gpu:rank0:window_slots=3", 3.0, 1.0, window_slots=3),  # the default
            row("2:2:sharded:gpu:rank0:window_slots=2:activation_policy=\"sac\"", 0.9, 1.0,
                window_slots=2, activation_policy="sac"),  # the new choice itself
            row("2:2:sharded:gpu:rank0:window_slots=2", 1.1, 1.0, window_slots=2),  # the old one
            row("2:2:replicated:gpu:rank0:window_slots=4", 1.2, 9.0, window_slots=4),  # over the cap
            row("2:2:sharded:gpu:rank0:window_slots=5", 1.5, 1.0, window_slots=5)]
    old_choice = row("2:2:plan=/gone/plan.toml", 1.0, 1.0, window_slots=2)
    sweep = tmp_path / "sweep.jsonl"
    sweep.write_text("".join(json.dumps(r) + "\n" for r in [old_choice, *grid]))
    out = tmp_path / "confirm.jsonl"
    p = _run("benchmarks/confirm_sweep.py", str(sweep), str(out), "--plan", str(plan),
             "--top", "2", "--iters", "2", "--discard", "1", "--runs", "2", "--device", "cpu",
             "--cap-gib", "5")
    assert p.returncode == 0, p.stderr
    cases = [json.loads(line)["case"] for line in out.read_text().splitlines()]
    chosen = f"2:2:plan={plan}"
    assert cases == [chosen, grid[0]["case"], grid[2]["case"], grid[4]["case"]] * 2
    assert f"grid row {grid[1]['case']} is the chosen plan itself" in p.stdout
    assert "chosen against the fastest other row:" in p.stdout and "(default)" in p.stdout


def test_recompute_model_check_on_the_stored_layer_timings():
    """The stored nvidia-h200 per-policy layer timings (04:28, seq 16384): with sac's measured
    recompute the model's recompute times are closer to the measured ones than with the HBM rate."""
    p = _run("benchmarks/probes/recompute_model_check.py",
             "benchmarks/results/2026-12-01-h200-profile-0205.toml",
             "benchmarks/results/2026-12-01-h200-autopolicy-4b-seq16384-0428/policy_layers.json")
    assert p.returncode == 0, p.stderr
    line = next(x for x in p.stdout.splitlines() if x.startswith("other policies"))
    old, new = (float(v) for v in line.split("mean abs error ")[1].split(" ms")[0].split(" -> "))
    assert new < 0.5 * old


def test_adam_after_d2h_probe_times_every_condition_on_the_cpu(tmp_path):
    """A smoke run (the CPU's copies stand in for the DMA): every condition of each chunk size,
    twice, with the counted traffic of each kernel."""
    out = tmp_path / "adam.json"
    p = _run("benchmarks/probes/adam_after_d2h_probe.py", str(out), "--device", "cpu",
             "--chunk-mib", "1", "--chunks", "2", "--update-threads", "1", "--sum-ranks", "2", "3",
             "--state-gib", "0.01", "--cold-ring-gib", "0.02")
    assert p.returncode == 0, p.stderr
    rows = json.loads(out.read_text())["rows"]
    conds = [(r["condition"], r["ranks"]) for r in rows]
    adam = [(c, 1) for c in ("reused", "cold", "after_d2h", "cold_gil", "cold_dma",
                             "cold_dma_paced")]
    expected = adam + [
        (c, r) for r in (2, 3) for c in ("sum_cold", "sum_after_d2h", "adam_after_sum")]
    assert conds == expected * 2
    for r in rows:
        per_elem = 4 * (3 * (r["ranks"] - 1) + 1) if r["condition"].startswith("sum") else 28
        assert r["chunks"] == 2 and r["mean_ms"] > 0
        assert r["counted_gbps"] == pytest.approx(per_elem * (MIB // 4) / r["mean_ms"] / 1e6)
    p = _run("benchmarks/probes/adam_after_d2h_probe.py", str(out), "--device", "cpu",
             "--chunk-mib", "1", "--chunks", "2", "--update-threads", "1", "--state-gib", "0.01",
             "--cold-ring-gib", "0.02", "--adam-only", "--state-memory", "shm", "--repeats", "3")
    assert p.returncode == 0, p.stderr
    got = json.loads(out.read_text())
    assert got["state_memory"] == "shm"
    assert [(r["condition"], r["ranks"]) for r in got["rows"]] == adam * 3


def test_memory_kind_probe_alternates_the_kinds_on_the_profiles_kernels(tmp_path):
    """A smoke run: each round times both memory kinds (shm first, then anon) at every thread
    count with the profile's kernels, and records the huge-page modes and counters."""
    out = tmp_path / "kind.json"
    p = _run("benchmarks/probes/memory_kind_probe.py", str(out), "--mib", "8",
             "--threads", "1", "2", "--rounds", "2", "--sample-s", "0")
    assert p.returncode == 0, p.stderr
    doc = json.loads(out.read_text())
    assert doc["huge_pages"].startswith("THP enabled=")
    assert [(r["round"], r["memory"], r["threads"]) for r in doc["rows"]] == [
        (k, m, n) for k in (0, 1) for m in ("shm", "anon") for n in (1, 2)]
    for r in doc["rows"]:
        assert r["adam_gparam_per_s"] > 0 and r["cast_gelem_per_s"] > 0 and r["copy_gbps"] > 0
        assert r["adam_state_gbps"] == pytest.approx(28 * r["adam_gparam_per_s"])
        assert "AnonHugePages" in r and "ShmemPmdMapped" in r


def test_moments_rate_times_every_format(tmp_path):
    out = tmp_path / "rates.json"
    p = _run("benchmarks/moments_rate.py", "--params", "70000", "--threads", "1", "--chunk-mib",
             "0.1", "--repeats", "1", "--formats", "fp32,bf16,int8", "--json", str(out))
    assert p.returncode == 0, p.stderr
    rates = json.loads(out.read_text())["rates"]["1"]
    assert set(rates) == {"fp32", "bf16", "int8"} and all(r > 0 for r in rates.values())
