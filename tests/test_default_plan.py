"""The default chooser (policy/chooser.py) and `slidedp train`'s plan without --plan
(commands/default_choice.py): the options given kept, different plans on different presets,
the user's cache of profiles and choices (hit, miss, invalidation, a corrupt entry), the CPU
default at once, and the first lines of the output."""

import json
import re
from dataclasses import replace

import pytest

import slidedp.policy.chooser as chooser_mod
from slidedp import cli
from slidedp.commands import default_choice, train
from slidedp.policy.chooser import Choice, choose
from slidedp.policy.routes import CHUNK_MIB, FIXABLE, candidates, window_candidates
from slidedp.profile import cache
from slidedp.profile.measure import _gpu_kind, base_preset
from slidedp.profile.sizes import CHOOSER
from slidedp.spec.hardware import load_hardware, preset_dir
from slidedp.spec.model import load_model
from slidedp.spec.plan import ParamRoute, Plan, default_plan
from slidedp.spec.workload import Workload

# a small model whose activations fill an A800's 80 GB but not an H200's 141 GB: ~1.3 s a choice
SMALL = Workload(load_model("qwen3-0.6b"), 4096, 16, 16, 1)
TRAIN = ["--steps", "1", "--global-batch", "8", "--micro-batch", "4", "--device", "cpu"]


@pytest.fixture(autouse=True)
def user_cache(tmp_path, monkeypatch):
    """Every test its own cache directory, simulated in this process."""
    monkeypatch.setenv(cache.ENV, str(tmp_path / "xdg"))
    monkeypatch.setenv("SLIDEDP_SIM_WORKERS", "1")
    monkeypatch.setattr(cache, "_warned", set())
    return tmp_path / "xdg" / "slidedp"


def _choose(hw_name, wl=SMALL, base=None, fixed=frozenset()):
    hw = load_hardware(hw_name)
    return choose(hw, wl, base or default_plan(hw.fabric.kind), fixed, hw.gpu.hbm_bytes,
                  sim_workers=1)


def test_different_presets_get_different_plans_for_one_workload():
    """No per-model constant: the same model and workload on two presets' rates and memory."""
    h200, a800 = _choose("h200x1"), _choose("a800x4")
    assert h200.plan != a800.plan
    for c in (h200, a800):
        assert c.default_s is not None and c.chosen_s <= c.default_s
        assert len(c.plan.layer_policies) == SMALL.model.n_layers
    # the A800's 80 GB keep fewer activations than the H200's 141 GB
    assert a800.plan.layer_policies.count("none") < h200.plan.layer_policies.count("none")


def test_candidates_keep_every_fixed_field():
    base = Plan(param_route=ParamRoute.REPLICATED, h2d_chunk_mib=32, d2h_chunk_mib=32,
                window_slots=5, offload_ratio=0.25)
    hw = load_hardware("h200x2")
    wl = Workload(load_model("qwen3-4b"), 4096, 8, 4, 2)
    free = candidates(base, 2, window_candidates(hw, wl, base))
    assert {p.h2d_chunk_mib for p in free} == set(CHUNK_MIB) and len(free) > 24
    for fixed in ({"param_route"}, {"chunk_mib", "window_slots"}, set(FIXABLE)):
        kept = candidates(base, 2, window_candidates(hw, wl, base, frozenset(fixed)),
                          frozenset(fixed))
        assert kept and all(getattr(p, f) == getattr(base, f) for p in kept
                            for f in fixed - {"chunk_mib"})
        if "chunk_mib" in fixed:
            assert {(p.h2d_chunk_mib, p.d2h_chunk_mib) for p in kept} == {(32, 32)}


def test_the_chooser_keeps_the_options_given_and_fills_in_the_rest():
    free = _choose("h200x1")
    base = replace(default_plan("nvswitch"), window_slots=4, h2d_chunk_mib=16, d2h_chunk_mib=16)
    kept = _choose("h200x1", base=base, fixed=frozenset({"window_slots", "chunk_mib"}))
    assert (kept.plan.window_slots, kept.plan.h2d_chunk_mib, kept.plan.d2h_chunk_mib) == (4, 16, 16)
    assert (free.plan.window_slots, free.plan.h2d_chunk_mib) != (4, 16)
    assert len(kept.plan.layer_policies) == SMALL.model.n_layers  # activations still chosen
    assert "kept as given: --chunk-mib, --window-slots" in "\n".join(kept.summary("x"))


def test_a_policy_the_executor_refuses_leaves_the_search():
    asked = []

    def runs(name):
        asked.append(name)
        return name != "none"

    hw = load_hardware("h200x1")
    c = choose(hw, SMALL, default_plan(hw.fabric.kind), frozenset(), hw.gpu.hbm_bytes,
               runs_policy=runs, sim_workers=1)
    assert "none" in asked and "none" not in c.plan.layer_policies
    assert len(asked) < 10  # asked about the policies choices named, not all of segments.py


def test_summary_names_the_plan_the_default_and_the_bottleneck():
    c = _choose("h200x1")
    lines = c.summary("h200x1")
    assert lines[0].startswith("plan: chosen by the simulator on h200x1: params replicated")
    assert f"window {c.plan.window_slots}" in lines[0]
    m = re.search(r"simulated ([\d.]+) s/step against ([\d.]+) s for the default plan", lines[1])
    assert m and float(m[1]) == pytest.approx(c.chosen_s, rel=1e-3)
    assert float(m[2]) == pytest.approx(c.default_s, rel=1e-3)
    assert "-bound, compute" in lines[2]
    assert Choice.from_json(json.loads(json.dumps(c.to_json())), "test") == c


def test_the_default_plan_is_kept_where_nothing_simulates_faster(monkeypatch):
    real = chooser_mod.auto_plan

    def slower(*a, **kw):
        plan, rep = real(*a, **kw)
        monkeypatch.setattr(rep, "default_route_s", rep.chosen.activations.final_s / 2)
        return plan, rep

    monkeypatch.setattr(chooser_mod, "auto_plan", slower)
    c = _choose("h200x1")
    assert c.kept_default and c.plan == c.default_plan and c.chosen_s == c.default_s
    assert c.summary("h200x1")[0].startswith("plan: the default plan, kept by the chooser")


# ---- predict and simulate --plan auto-sim --------------------------------------------------

@pytest.mark.parametrize("verb", ["predict", "simulate"])
def test_predict_and_simulate_take_the_choosers_plan(capsys, verb):
    args = [verb, "--hardware", "h200x1", "--model", "qwen3-0.6b", "--micro-batch", "16"]
    assert cli.main([*args, "--json"]) == 0
    fixed = json.loads(capsys.readouterr().out)
    assert "plan_choice" not in fixed  # the fixed default plan stays their default
    assert cli.main([*args, "--plan", "default", "--json"]) == 0
    same = json.loads(capsys.readouterr().out)
    wall = {"elapsed_s", "events_per_s", "sim_wall_s"}  # how long it took, not what it found
    assert {k: v for k, v in same.items() if k not in wall} == \
        {k: v for k, v in fixed.items() if k not in wall}
    assert cli.main([*args, "--plan", "auto-sim", "--window-slots", "5", "--json"]) == 0
    chosen = json.loads(capsys.readouterr().out)["plan_choice"]
    assert chosen["plan"]["window_slots"] == 5 and chosen["fixed"] == ["window_slots"]
    assert cli.main([*args, "--plan", "auto-sim", "--window-slots", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[1].startswith("plan: chosen by the simulator on h200x1") and "window 5" in out[0]


# ---- slidedp train: the plan without --plan ------------------------------------------------

def _forbid(monkeypatch, what):
    def boom(*a, **kw):
        raise AssertionError(f"{what} ran")
    return boom


def test_the_cpu_default_profiles_nothing_and_searches_nothing(tmp_path, monkeypatch, capsys,
                                                              user_cache):
    from slidedp.profile.run import Profiler

    monkeypatch.setattr(Profiler, "run", _forbid(monkeypatch, "the profiler"))
    monkeypatch.setattr(default_choice, "measure_profile", _forbid(monkeypatch, "the profile"))
    monkeypatch.setattr(chooser_mod, "auto_plan", _forbid(monkeypatch, "the search"))
    assert cli.main(["train", "--out", str(tmp_path / "run"), *TRAIN]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: the documented default plan (on a CPU")
    assert not (tmp_path / "run" / "plan.toml").exists() and not user_cache.exists()


def test_train_auto_sim_says_its_choice_first_and_caches_it(tmp_path, capsys, monkeypatch,
                                                           user_cache):
    """Cold: chosen, cached, the run takes it; warm: from the cache, nothing simulated;
    another workload or another machine fingerprint: chosen anew."""
    runs = {"n": 0}
    real = chooser_mod.choose

    def counted(*a, **kw):
        runs["n"] += 1
        return real(*a, **kw)

    monkeypatch.setattr(default_choice, "executor_runs", lambda device: lambda name: True)
    import slidedp.policy.chooser
    monkeypatch.setattr(slidedp.policy.chooser, "choose", counted)
    argv = ["train", *TRAIN, "--plan", "auto-sim", "--hardware", "h200x1"]

    assert cli.main([*argv, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: chosen by the simulator on h200x1:")
    assert "against" in out[1] and "for the default plan" in out[1]
    assert "plan simulated in" in out[3] and runs["n"] == 1
    chosen = (tmp_path / "a" / "plan.toml").read_text()
    assert f'plan = "{tmp_path / "a" / "plan.toml"}"' in "\n".join(out)  # the run took it
    assert len(list(user_cache.rglob("plans/*.json"))) == 1

    assert cli.main([*argv, "--out", str(tmp_path / "b")]) == 0  # warm
    out = capsys.readouterr().out.splitlines()
    assert "plan cached" in out[3] and runs["n"] == 1
    assert (tmp_path / "b" / "plan.toml").read_text() == chosen

    assert cli.main([*argv, "--out", str(tmp_path / "c"), "--micro-batch", "2"]) == 0
    assert runs["n"] == 2  # another workload
    real_print = cache.fingerprint
    monkeypatch.setattr(cache, "fingerprint", lambda m: real_print(m) | {"gpu": "another GPU"})
    assert cli.main([*argv, "--out", str(tmp_path / "d")]) == 0
    assert runs["n"] == 3  # another machine
    assert len(list(user_cache.glob("machines/*"))) == 2


def test_a_corrupt_choice_is_ignored_with_one_warning_and_written_anew(tmp_path, capsys,
                                                                      monkeypatch, user_cache):
    monkeypatch.setattr(default_choice, "executor_runs", lambda device: lambda name: True)
    argv = ["train", *TRAIN, "--plan", "auto-sim", "--hardware", "h200x1"]
    assert cli.main([*argv, "--out", str(tmp_path / "a")]) == 0
    (entry,) = user_cache.rglob("plans/*.json")
    good = entry.read_text()
    entry.write_text(good[: len(good) // 2])  # truncated
    capsys.readouterr()
    assert cli.main([*argv, "--out", str(tmp_path / "b")]) == 0
    err = capsys.readouterr().err
    assert err.count("warning") == 1 and f"corrupt cache entry {entry}" in err
    again, first = json.loads(entry.read_text()), json.loads(good)
    assert (again["plan"], again["chosen_s"]) == (first["plan"], first["chosen_s"])  # chosen anew
    capsys.readouterr()
    assert cli.main([*argv, "--out", str(tmp_path / "c")]) == 0
    assert "warning" not in capsys.readouterr().err


def _gpu_opts(tmp_path, *extra):
    """train's resolved options as on a GPU machine (device cuda), without --plan."""
    args = cli.build_parser().parse_args(["train", "--out", str(tmp_path / "run"), "--steps",
                                          "1", "--global-batch", "4", "--micro-batch", "4",
                                          *extra])
    return train.resolve_options(args) | {"device": "cuda"}


def test_the_gpu_default_profiles_once_per_machine_and_workload(tmp_path, monkeypatch, capsys,
                                                               user_cache):
    """The cold path on a GPU, with the profile's measurement replaced by the h200x1 preset's
    text (CPU CI has no GPU): profiled and chosen once, then both from the cache; a corrupt
    profile is measured again with one warning."""
    measured = []
    text = (preset_dir() / "h200x1.toml").read_text()

    def fake_measure(machine, model, seq, mb, where):
        measured.append((model.name, seq, mb))
        return text, load_hardware("h200x1"), 0.5

    monkeypatch.setattr(default_choice, "measure_profile", fake_measure)
    monkeypatch.setattr(default_choice, "executor_runs", lambda device: lambda name: True)
    opts = _gpu_opts(tmp_path)
    assert default_choice.chooses(opts) and default_choice.plan_line(opts) is None
    path = default_choice.select(opts)
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: profiling this machine") and measured == [("tiny-qwen3", 64, 4)]
    assert out[1].startswith("plan: chosen by the simulator on h200x1")
    assert "profile measured in 0.5 s" in out[-1] and "plan simulated" in out[-1]
    assert len(list(user_cache.glob("machines/*/profile-*.toml"))) == 1
    assert (user_cache.glob("machines/*/machine.json")).__next__().read_text()

    (tmp_path / "run" / "plan.toml").unlink()
    assert default_choice.select(opts) == path and len(measured) == 1  # warm
    assert "profile cached" in capsys.readouterr().out

    (profile,) = user_cache.glob("machines/*/profile-*.toml")
    profile.write_text("[hardware\nname =")
    (tmp_path / "run" / "plan.toml").unlink()
    default_choice.select(opts)
    assert len(measured) == 2 and capsys.readouterr().err.count("corrupt cache entry") == 1

    (tmp_path / "run" / "plan.toml").unlink()
    default_choice.select(_gpu_opts(tmp_path, "--seq", "32"))
    assert measured[-1] == ("tiny-qwen3", 32, 4)  # another layer shape: profiled again


def test_a_failed_profile_leaves_the_default_plan_with_one_warning(tmp_path, monkeypatch,
                                                                   capsys):
    def oom(*a):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(default_choice, "measure_profile", oom)
    assert default_choice.select(_gpu_opts(tmp_path)) is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "out of memory" in err[0] and "default plan" in err[0]


def test_an_out_with_an_earlier_plan_is_refused_without_resume(tmp_path, monkeypatch):
    monkeypatch.setattr(default_choice, "executor_runs", lambda device: lambda name: True)
    argv = ["train", *TRAIN, "--plan", "auto-sim", "--hardware", "h200x1",
            "--out", str(tmp_path / "a")]
    assert cli.main(argv) == 0
    assert cli.main(argv) == 2


def test_resume_runs_the_chosen_plan_without_choosing_again(tmp_path, capsys, monkeypatch):
    """config.toml names OUT/plan.toml; --resume reads it back and nothing is chosen."""
    monkeypatch.setattr(default_choice, "executor_runs", lambda device: lambda name: True)
    out = tmp_path / "a"
    argv = ["train", *TRAIN, "--plan", "auto-sim", "--hardware", "h200x1", "--out", str(out)]
    assert cli.main(argv) == 0
    plan = out / "plan.toml"
    assert f"plan = {json.dumps(str(plan))}" in (out / "config.toml").read_text()
    chosen = plan.read_text()
    monkeypatch.setattr(chooser_mod, "auto_plan", _forbid(monkeypatch, "the search"))
    monkeypatch.setattr(default_choice, "select", _forbid(monkeypatch, "the chooser"))
    capsys.readouterr()
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"plan: {plan}, chosen when the run started"
    assert plan.read_text() == chosen and "resuming after step 1" in "\n".join(lines)


def test_the_cpu_default_is_saved_so_resume_keeps_it(tmp_path, monkeypatch, capsys):
    out = tmp_path / "a"
    assert cli.main(["train", "--out", str(out), *TRAIN]) == 0
    assert 'plan = "default"' in (out / "config.toml").read_text()
    monkeypatch.setattr(default_choice, "select", _forbid(monkeypatch, "the chooser"))
    capsys.readouterr()
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 0
    assert capsys.readouterr().out.startswith("plan: the documented default plan (plan = default)")


def test_plan_default_is_the_documented_default_plan(tmp_path, capsys):
    assert cli.main(["train", "--out", str(tmp_path / "a"), *TRAIN, "--plan", "default"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: the documented default plan (plan = default)")
    assert "window 3 slots" in out  # Plan's default window


# ---- the cache and the chooser's profile ----------------------------------------------------

def test_cache_root_follows_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv(cache.ENV, str(tmp_path))
    assert cache.root() == tmp_path / "slidedp"
    monkeypatch.delenv(cache.ENV)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache.root() == tmp_path / "home" / ".cache" / "slidedp"


def test_an_unwritable_cache_warns_once_and_the_run_goes_on(tmp_path, capsys, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv(cache.ENV, str(blocker))  # a file where the directory would be
    assert not cache.write(cache.root() / "a" / "b.json", "{}")
    assert not cache.write(cache.root() / "a" / "c.json", "{}")
    assert capsys.readouterr().err.count("cannot be written") == 1


def test_the_choosers_profile_covers_the_choosers_chunks_and_team():
    assert tuple(float(c) for c in CHOOSER.chunk_mib) == CHUNK_MIB
    assert CHOOSER.threads(16) == [1, 12, 16]
    assert CHOOSER.host_rounds < 7  # fewer than --quick's


def test_base_preset_by_gpu_kind_and_count():
    from slidedp.profile.machine import Machine

    def machine(gpu, n):
        return Machine("h", "d", "cpu", 16, 32, 2**37, 2**25, gpu, n, 8e10)

    assert _gpu_kind("NVIDIA A800-SXM4-80GB") == "A800"
    assert base_preset(machine("NVIDIA H200", 1)) == "h200x1"
    assert base_preset(machine("NVIDIA H100 80GB HBM3", 2)) == "h100x4"
    assert base_preset(machine("NVIDIA A800-SXM4-80GB", 4)) == "a800x4"
    assert base_preset(machine("NVIDIA A100-SXM4-40GB", 2)) == "h200x2"  # no A100 preset
