"""Real probes (policy/probe.py) on the CPU with tiny models, `slidedp plan --probe`, and
`slidedp train --plan auto` run as the real CLI."""

import gc
import json
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from slidedp.commands.choose import choose_plan
from slidedp.exec import measure as measure_mod
from slidedp.exec.host_state import HostState, checked_storage_of
from slidedp.exec.measure import layers_sharing_memory, random_host_state
from slidedp.policy import probe as probe_mod
from slidedp.policy.probe import (
    DISTINCT_LAYERS,
    REDUCED_LAYERS,
    ExecutorProbe,
    bounded,
    reduced_model,
    runs_policy,
)
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import load_hardware
from slidedp.spec.model import load_model
from slidedp.spec.plan import Moments, ParamRoute, Plan, load_plan
from slidedp.spec.workload import Workload

GIB = 2**30
ROUTE = Plan(param_route=ParamRoute.REPLICATED)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "slidedp.cli", *args], capture_output=True,
                          text=True)


def _deep_tiny(tmp_path, layers=6):
    """tiny-qwen3 with more decoder layers than the reduced pipeline keeps."""
    cfg = dict(load_model("tiny-qwen3").config) | {"num_hidden_layers": layers}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return load_model(str(tmp_path))


def test_probe_measures_plans_on_one_host_state_and_reports_refusals():
    wl = Workload(load_model("tiny-qwen3"), 32, 4, 2, 1)
    with ExecutorProbe(wl, "cpu") as pr:
        a = pr(ROUTE)
        hs = pr.full.hs
        b = pr(Plan(param_route=ParamRoute.REPLICATED, window_slots=2, h2d_chunk_mib=16))
        assert a > 0 and b > 0 and pr.full.hs is hs  # built once, reused by every candidate
        assert pr(Plan(param_route=ParamRoute.REPLICATED, step_join=False)) is None
        assert len(pr.refusals) == 1 and "step_join" in pr.refusals[0]
    assert pr.full.hs is None  # closed


def test_probe_state_keeps_a_few_layers_of_memory_and_trains_on_it(tmp_path):
    """The whole model's probe state: decoder layer i in layer i mod DISTINCT_LAYERS's memory, the
    embedding and head their own; the executor steps on it (finite losses)."""
    wl = Workload(_deep_tiny(tmp_path, layers=DISTINCT_LAYERS + 3), 32, 4, 2, 1)
    with ExecutorProbe(wl, "cpu") as pr:
        assert pr(ROUTE) > 0
        hs = pr.full.hs
        L = wl.model.n_layers
        assert hs.storage_of == [0, *[1 + i % DISTINCT_LAYERS for i in range(L)], L + 1]
        assert hs.master.numel() == sum(hs.unit_numels[:DISTINCT_LAYERS + 1]) + hs.unit_numels[-1]
        assert torch.isfinite(hs.master).all() and torch.isfinite(hs.exp_avg_sq).all()


def test_probe_state_keeps_the_plans_moments_format(tmp_path):
    """Probes of int8-moment plans step on an int8 host state, shared and cut as the FP32 one."""
    wl = Workload(_deep_tiny(tmp_path, layers=DISTINCT_LAYERS + 3), 32, 4, 2, 1)
    with ExecutorProbe(wl, "cpu", moments="int8") as pr:
        assert pr(replace(ROUTE, moments=Moments.INT8)) > 0
        assert pr.full.hs.moments == "int8" and pr.full.hs.exp_avg.dtype == torch.uint8


@given(st.lists(st.sampled_from([4, 6]), min_size=3, max_size=12), st.integers(1, 5))
def test_layers_sharing_memory_is_a_valid_sharing(numels, k):
    """Every decoder layer shares only with an earlier layer of its size that owns its memory
    (HostState accepts it); the embedding and the head keep their own."""
    storage_of = layers_sharing_memory(numels, k)
    assert checked_storage_of(numels, storage_of) == storage_of
    assert storage_of[0] == 0 and storage_of[-1] == len(numels) - 1
    for u in range(1, len(numels) - 1):
        s = 1 + (u - 1) % k
        assert storage_of[u] == (s if numels[s] == numels[u] else u)


def test_random_fill_writes_each_memory_once(monkeypatch):
    """fill_random skips the units that share an earlier unit's memory."""
    written = []
    real = HostState.unit_master
    monkeypatch.setattr(HostState, "unit_master",
                        lambda self, u: written.append(u) or real(self, u))
    cfg = dict(load_model("tiny-qwen3").config) | {"num_hidden_layers": 5}
    hs = random_host_state(cfg, None, None, distinct_layers=2)
    try:
        assert hs.storage_of == [0, 1, 2, 1, 2, 1, 6] and written == [0, 1, 2, 6]
    finally:
        hs.close()


def test_prepare_builds_the_full_host_state_in_the_background(monkeypatch):
    """prepare() starts building the whole model's host state in a thread of its own; the first
    measurement waits for it (the wait is setup, not the probe's cost), and a failed build comes
    out of the first measurement. On a clock of the test's own: the build is held until the
    measurement starts timing its wait, then takes 5 s of that clock."""
    wl = Workload(load_model("tiny-qwen3"), 32, 4, 2, 1)
    real, gate, builders, now = probe_mod.random_host_state, threading.Event(), [], [0.0]

    def gated(*args, **kwargs):
        builders.append(threading.current_thread().name)
        assert gate.wait(30)
        now[0] += 5.0
        return real(*args, **kwargs)

    def perf_counter():  # the probe reads its clock first where it starts waiting for the build
        gate.set()
        return now[0]

    monkeypatch.setattr(probe_mod, "random_host_state", gated)
    monkeypatch.setattr(probe_mod, "time", SimpleNamespace(perf_counter=perf_counter))
    with ExecutorProbe(wl, "cpu") as pr:
        pr.prepare()
        deadline = time.monotonic() + 10
        while not builders and time.monotonic() < deadline:
            time.sleep(0.01)
        assert builders == ["probe-host-state"] and pr.full.hs is None
        assert pr(ROUTE) > 0 and pr.full.hs is not None and builders == ["probe-host-state"]
        assert pr.setup_s == 5.0  # the wait for the build
    assert pr.full.hs is None  # closed

    def broken(*args, **kwargs):
        raise OSError("no space left on device: /dev/shm")

    monkeypatch.setattr(probe_mod, "random_host_state", broken)
    with ExecutorProbe(wl, "cpu") as pr, pytest.raises(OSError, match="/dev/shm"):
        pr.prepare()
        pr(ROUTE)


class _OomThen:
    """A pipeline whose first `ooms` probes run out of memory, then measure 1.5 s."""

    def __init__(self, ooms: int):
        self.ooms, self.calls = ooms, 0

    def step_s(self, plan):
        self.calls += 1
        if self.calls <= self.ooms:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 456.00 MiB")
        return 1.5


def test_an_out_of_memory_probe_runs_once_more_then_is_refused():
    wl = Workload(load_model("tiny-qwen3"), 32, 4, 2, 1)
    with ExecutorProbe(wl, "cpu") as pr:
        assert pr._measured(_OomThen(1), ROUTE) == 1.5 and pr.refusals == []
        twice = _OomThen(2)
        assert pr._measured(twice, ROUTE) is None and twice.calls == 2
        assert len(pr.refusals) == 1 and "out of memory" in pr.refusals[0]


def test_probe_refuses_several_ranks():
    wl = Workload(load_model("tiny-qwen3"), 32, 4, 2, 2)
    with pytest.raises(SpecError, match="gpus.*rank processes"):
        ExecutorProbe(wl, "cpu")


def test_reduced_pipeline_keeps_the_layer_shape(tmp_path):
    deep = _deep_tiny(tmp_path)
    cut = reduced_model(deep, REDUCED_LAYERS)
    assert cut.n_layers == REDUCED_LAYERS and cut.layer_params() == deep.layer_params()
    assert cut.unit_params()[0] == deep.unit_params()[0]
    q = reduced_model(load_model("qwen3-8b"), 4)
    assert q.n_layers == 4 and q.layer_params() == load_model("qwen3-8b").layer_params()


def test_marginal_cost_runs_the_reduced_pipeline_only_for_policies_the_executor_runs(
        tmp_path, monkeypatch):
    wl = Workload(_deep_tiny(tmp_path), 32, 4, 2, 1)
    with ExecutorProbe(wl, "cpu") as pr:
        monkeypatch.setattr(probe_mod, "runs_policy", lambda name, device: False)
        assert pr.marginal_s(ROUTE, "sac") is None
        assert pr.reduced.hs is None and pr.full.hs is None  # nothing built for a refusal
        # `layer` against itself: the machinery end to end (the reduced pipeline built from the
        # whole state, both steps measured); the cost is 0 by construction, the pipeline's
        # difference bounded by the layer's own compute difference, which is 0 (bounded())
        monkeypatch.setattr(probe_mod, "runs_policy", lambda name, device: True)
        d = pr.marginal_s(ROUTE, "layer")
        assert d == 0.0 and pr.reduced.wl.model.n_layers == REDUCED_LAYERS and len(pr._t0) == 1
        # the cut model's state is the whole probe state's embedding, first layers and head
        sub, whole = pr.reduced.hs, pr.full.hs
        units = [*range(REDUCED_LAYERS + 1), whole.n_units - 1]
        assert [sub.unit_master(i).data_ptr() for i in range(len(units))] == \
            [whole.unit_master(u).data_ptr() for u in units]
        assert 0 < next(iter(pr._t0.values())) < 60  # the reduced step itself was measured


@given(st.floats(-1.0, 1.0), st.floats(-1.0, 1.0))
def test_bounded_keeps_the_pipeline_between_zero_and_the_layer(pipeline_s, layer_s):
    b = bounded(pipeline_s, layer_s)
    assert min(0.0, layer_s) <= b <= max(0.0, layer_s)
    if min(0.0, layer_s) <= pipeline_s <= max(0.0, layer_s):
        assert b == pipeline_s


def test_marginal_cost_is_bounded_by_the_layer_profile(tmp_path, monkeypatch):
    """A reduced step 0.2 s faster with every one of its 4 layers on `none` says 50 ms a layer;
    one layer's compute saves 10 ms a micro-batch, 20 ms a step of 2 micro-batches: 20 ms."""
    wl = Workload(_deep_tiny(tmp_path), 32, 4, 2, 1)  # global 4 / micro 2: 2 micro-batches
    monkeypatch.setattr(probe_mod, "runs_policy", lambda name, device: True)
    compute_s = {"layer": 0.050, "none": 0.040, "sac": 0.049}
    seen = []

    def fake_profile(config, policy, micro_batch, seq_len, **kw):
        seen.append((policy, micro_batch, seq_len))
        return type("P", (), {"compute_s": compute_s[policy]})()

    monkeypatch.setattr(probe_mod, "profile_layer_policy", fake_profile)
    with ExecutorProbe(wl, "cpu") as pr:
        steps = iter([1.0, 0.8, 0.996])  # T_0, T_none, T_sac
        monkeypatch.setattr(pr, "_measured", lambda pipe, plan: next(steps))
        assert pr.marginal_s(ROUTE, "none") == pytest.approx(-0.020)
        assert pr.marginal_s(ROUTE, "sac") == pytest.approx(-0.001)  # within the bound: kept
        assert pr.layer_delta_s("none") == pytest.approx(-0.020)
    assert ("layer", 2, 32) in seen and seen.count(("layer", 2, 32)) == 1  # profiled once
    with ExecutorProbe(wl, "cpu") as pr:  # with offload, policies differ in traffic: unbounded
        steps = iter([1.0, 0.8])
        monkeypatch.setattr(pr, "_measured", lambda pipe, plan: next(steps))
        assert pr.marginal_s(Plan(param_route=ParamRoute.REPLICATED, offload_ratio=0.5),
                             "none") == pytest.approx(-0.05)


def test_a_failing_layer_profile_leaves_the_cost_simulated(tmp_path, monkeypatch):
    wl = Workload(_deep_tiny(tmp_path), 32, 4, 2, 1)
    monkeypatch.setattr(probe_mod, "runs_policy", lambda name, device: True)

    def oom(*a, **k):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(probe_mod, "profile_layer_policy", oom)
    with ExecutorProbe(wl, "cpu") as pr:
        steps = iter([1.0, 0.8])
        monkeypatch.setattr(pr, "_measured", lambda pipe, plan: next(steps))
        assert pr.marginal_s(ROUTE, "none") is None
        assert pr.refusals and "one layer on layer: CUDA out of memory" in pr.refusals[0]


def test_runs_policy_matches_the_executor():
    assert runs_policy("layer", "cpu")
    # whatever the executor runs today, the answer is the Engine's: construct it directly
    from slidedp.exec.engine import Engine
    from slidedp.exec.measure import OPTIMIZER

    tiny = load_model("tiny-qwen3")
    for name in ("none", "sac"):
        try:
            with Engine(dict(tiny.config), Workload(tiny, 16, 1, 1, 1),
                        Plan(layer_policies=(name,) * 2), optimizer=OPTIMIZER):
                accepted = True
        except SpecError:
            accepted = False
        assert runs_policy(name, "cpu") == accepted


def test_several_ranks_are_not_probed_and_the_report_says_so():
    hw = load_hardware("h200x2")
    wl = Workload(load_model("tiny-qwen3"), 64, 4, 2, 2)
    _, rep = choose_plan(hw, wl, 40 * GIB, probe_device="cpu")
    text = "\n".join(rep.lines())
    assert "no real probes: they run one rank only" in text and "probes on" not in text


def test_cli_plan_probe_confirms_on_the_cpu(tmp_path):
    out = tmp_path / "plan.toml"
    r = _cli("plan", "--hardware", "h200x1", "--model", "tiny-qwen3", "--seq", "32",
             "--micro-batch", "2", "--probe", "--device", "cpu", "--out", str(out))
    assert r.returncode == 0, r.stderr
    assert "probes on cpu:" in r.stdout and "measured" in r.stdout
    assert "selection took" in r.stdout
    assert len(load_plan(out).layer_policies) == 2


def test_cli_train_plan_auto(tmp_path):
    out = tmp_path / "run"
    base = ["train", "--plan", "auto", "--out", str(out), "--device", "cpu",
            "--global-batch", "4", "--micro-batch", "2"]
    r = _cli(*base, "--steps", "3", "--gpu-memory-cap-gib", "8")
    assert r.returncode == 0, r.stderr
    assert "plan chosen in" in r.stdout and "probes on cpu:" in r.stdout
    report = (out / "plan-report.txt").read_text()
    assert "GPU memory cap 8.0 GiB" in report and "selection took" in report
    plan = load_plan(out / "plan.toml")
    assert all(runs_policy(name, "cpu") for name in plan.layer_policies)  # trainable only
    assert f"window {plan.window_slots} slots" in r.stdout  # the trainer ran the chosen plan
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert len(rows) == 3

    again = _cli(*base, "--steps", "4")  # an earlier run's plan.toml: refused without --resume
    assert again.returncode == 2 and "plan.toml" in again.stderr
    resumed = _cli(*base, "--steps", "4", "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert "chosen when the run started" in resumed.stdout
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4

    fixed = _cli(*base, "--chunk-mib", "64")
    assert fixed.returncode == 2 and "--chunk-mib" in fixed.stderr
    assert fixed.stderr.count("\n") == 1


def test_cli_train_plan_auto_checks_the_data_before_choosing(tmp_path):
    out = tmp_path / "run"
    base = ["train", "--plan", "auto", "--out", str(out), "--device", "cpu",
            "--global-batch", "4", "--micro-batch", "2"]
    missing = _cli(*base, "--data", str(tmp_path / "nope.npy"))
    assert missing.returncode == 2 and "nope.npy" in missing.stderr
    short = _cli(*base, "--seq", "32")  # the bundled tiny-markov set has 64 tokens per sequence
    assert short.returncode == 2 and "seq_len" in short.stderr
    for r in (missing, short):
        assert "choosing the plan" not in r.stdout and r.stderr.count("\n") == 1
    assert not (out / "plan.toml").exists()


@pytest.mark.gpu
def test_cuda_probes_run_on_the_shared_and_subset_states(tmp_path):
    """On a GPU: a probe and a marginal cost of a model deeper than DISTINCT_LAYERS (BF16), on the
    shared-layer probe state and the reduced pipeline's subset of it."""
    wl = Workload(_deep_tiny(tmp_path, layers=DISTINCT_LAYERS + 3), 64, 4, 2, 1)
    with ExecutorProbe(wl, "cuda") as pr:
        pr.prepare()
        assert pr(ROUTE) > 0 and pr.full.hs.shares_storage
        assert pr.marginal_s(ROUTE, "none") is not None, pr.refusals
        assert pr.reduced.hs.unit_master(1).data_ptr() == pr.full.hs.unit_master(1).data_ptr()


def test_measure_frees_its_engine_before_returning(monkeypatch):
    """A sweep or AutoPolicy's probes measure many plans in one process: measure() must not leave
    its Engine holding its buffers while the next one allocates (on nvidia-h200 one plan's GPU
    peak read 28.5 GiB first in a process and 50.6 GiB after four other plans, while the engine's
    task table of bound methods made it a cycle for the collector); with the collector off, the
    engine is gone on return."""
    made = []

    class Tracked(measure_mod.Engine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(weakref.ref(self))

    monkeypatch.setattr(measure_mod, "Engine", Tracked)
    wl = Workload(load_model("tiny-qwen3"), 32, 2, 2, 1)
    cfg = dict(load_model("tiny-qwen3").config)
    hs = random_host_state(cfg, None, None)
    try:
        gc.disable()  # no automatic collection may do measure()'s work for it
        try:
            m = measure_mod.measure(cfg, wl, ROUTE, hs, device="cpu", iters=2, discard=1)
        finally:
            gc.enable()
    finally:
        hs.close()
    assert m.step_time_s > 0 and len(made) == 1 and made[0]() is None
