"""`slidedp validate`: the cases file, the stored set (import, --predict-only, summary) and a tiny
measured run on the CPU (one in-process rank and two torchrun ranks over gloo). On the CPU the
predictions of an H200 are meaningless: the run checks files and keys, not errors."""

import csv
import dataclasses
import gzip
import json
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from slidedp.cli import main
from slidedp.spec.errors import SpecError
from slidedp.spec.hardware import load_hardware, preset_dir
from slidedp.spec.plan import GradRoute, ParamRoute, plan_dict
from slidedp.validate import store
from slidedp.validate.cases import case_toml, load_cases, parse_case_spec, parse_cases
from slidedp.validate.hostcheck import against_profile
from slidedp.validate.importer import NO_TRACE, import_results, trace_file_name
from slidedp.validate.summary import runs_spread, task_kind_rows
from slidedp.validate.traces import GZIP_MAGIC, load_trace, read_trace_doc

ROOT = Path(__file__).parents[1]
VALIDATION = ROOT / "validation"
TINY = """
[defaults]
model = "tiny-qwen3"
seq = 32
plan = { h2d_chunk_mib = 0.01, d2h_chunk_mib = 0.01 }

[[case]]
name = "tiny-r1"
gpus = 1
global_batch = 2
micro_batch = 1

[[case]]
name = "tiny-r2"
gpus = 2
global_batch = 4
micro_batch = 1
plan = { param_route = "replicated" }
"""


def _cases(**case) -> dict:
    base = {"name": "a", "model": "qwen3-8b", "seq": 4096, "gpus": 2, "global_batch": 8,
            "micro_batch": 4}
    return {"case": [base | case]}


def test_cases_merge_defaults_and_round_trip(tmp_path):
    f = tmp_path / "cases.toml"
    f.write_text(TINY)
    r1, r2 = load_cases(f)
    assert (r1.model, r1.seq, r1.plan.h2d_chunk_mib, r1.plan.param_route) == (
        "tiny-qwen3", 32, 0.01, ParamRoute.SHARDED)
    assert (r2.plan.param_route, r2.plan.grad_route, r2.plan.d2h_chunk_mib) == (
        ParamRoute.REPLICATED, GradRoute.GPU, 0.01)
    back = tmp_path / "case.toml"
    back.write_text(case_toml(r2, "a comment"))
    assert load_cases(back) == [r2]


@pytest.mark.parametrize("data, field", [
    (_cases(gpu=2), "case[0].gpu"),  # unknown key
    (_cases(global_batch=6), "case[0].global_batch"),  # not a multiple of micro_batch x gpus
    (_cases(seq="long"), "case[0].seq"),
    (_cases(model="no-such-model"), "case[0].model"),
    (_cases(plan={"param_route": "diagonal"}), "case[0].plan.param_route"),
    (_cases(plan={"chunk": 64}), "case[0].plan.chunk"),
    (_cases(name="a b"), "case[0].name"),
    ({"case": [_cases()["case"][0]] * 2}, "case[1].name"),  # duplicate
    ({"cases": []}, "case"),  # the array is missing
    (_cases() | {"default": {}}, "default"),  # unknown top-level table
])
def test_bad_cases_name_file_and_field(data, field):
    with pytest.raises(SpecError) as e:
        parse_cases(data, "cases.toml")
    assert (e.value.where, e.value.field) == ("cases.toml", field)
    assert "\n" not in str(e.value)


def test_cli_bad_cases_is_one_line_exit_2(tmp_path, capsys):
    f = tmp_path / "cases.toml"
    f.write_text('[[case]]\nname = "x"\nmodel = "qwen3-8b"\nseq = 4096\ngpus = 3\n'
                 'global_batch = 3\nmicro_batch = 1\n')
    assert main(["validate", "--hardware", "h200x2", "--cases", str(f), "--out", str(tmp_path),
                 "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and str(f) in err and "case[0].gpus" in err


def _fake_runs(monkeypatch, stop, n_cases: int = 1):
    """The first `n_cases` TINY cases of one GPU, and measure._measure_group replaced by runs that
    write each case's folder as the worker does (case.toml and a trace naming the run,
    measured.json with step time = the run's number); `stop(run)` says how run `run` ends: True
    (completed), False (its ranks failed) or an exception raised (the process stopped)."""
    from slidedp.validate import measure as measure_mod

    base = parse_cases(tomllib.loads(TINY), "t")[0]
    cases = [dataclasses.replace(base, name=f"{base.name}-{i}") for i in range(n_cases)]
    calls = []

    def fake(group, root, *args):
        calls.append(root)
        for case in group:
            folder = root / case.name
            store.write_case(folder, case, f"run {len(calls)}")
            (folder / store.MEASURED_TRACE).write_text(f"run {len(calls)}")
            store.write_json(folder / store.MEASURED, {
                "step_time_s": 1.0 * len(calls), "all_steps_s": [len(calls)],
                "tokens_per_s": 100.0, "notes": []})
        end = stop(len(calls))
        if isinstance(end, BaseException):
            raise end
        return end

    monkeypatch.setattr(measure_mod, "_measure_group", fake)
    return cases, calls


def _measure(root, cases, runs):
    """measure_cases on CPU; (the failed cases, the cases it said were stored, in order)."""
    from slidedp.validate import measure as measure_mod

    stored = []
    failed = measure_mod.measure_cases(cases, root, device="cpu", iters=2, discard=1,
                                       machine="ci", command="c", runs=runs, stored=stored.append)
    return failed, stored


def _run_of(folder):
    """Which fake run wrote the stored case's case.toml and trace (they must agree)."""
    trace = (folder / store.MEASURED_TRACE).read_text()
    assert f"# {trace}" in (folder / store.CASE).read_text()
    return trace


def test_a_failed_later_run_leaves_the_completed_runs(tmp_path, monkeypatch, capsys):
    """Run 1 completes, run 2's ranks fail after writing the cases: the group is reported failed
    but stored with run 1 (so the caller predicts it), its figures, case.toml and trace run 1's,
    saying one of two runs did not complete; run 2's folders stay in .runs."""
    cases, calls = _fake_runs(monkeypatch, lambda run: run == 1, n_cases=2)
    names = [c.name for c in cases]
    assert _measure(tmp_path, cases, 2) == (names, names)
    assert calls == [tmp_path / store.RUNS / "run1", tmp_path / store.RUNS / "run2"]
    assert f"run 2 of 2: {', '.join(names)}" in capsys.readouterr().out
    for name in names:
        folder = tmp_path / name
        meas = store.read_json(folder / store.MEASURED)
        assert meas["run_step_times_s"] == [1.0] and meas["step_time_s"] == 1.0
        assert "1 of the 2 runs did not complete" in meas["notes"][-1]
        assert _run_of(folder) == "run 1"
        assert store.read_json(calls[1] / name / store.MEASURED)["step_time_s"] == 2.0
    assert not calls[0].exists()  # adopted: nothing left of run 1 there
    assert store.stored_cases(tmp_path) == [tmp_path / n for n in names]


def test_a_first_run_that_fails_stores_nothing(tmp_path, monkeypatch):
    cases, _ = _fake_runs(monkeypatch, lambda run: False)
    assert _measure(tmp_path, cases, 2) == ([cases[0].name], [])
    assert store.stored_cases(tmp_path) == []


def test_a_stopped_validation_loses_no_completed_run(tmp_path, monkeypatch):
    """Stopped (a time limit's signal) during run 3 of 3: the case holds runs 1 and 2 merged,
    with run 2's case.toml and trace, and the stopped run's finished case is in .runs."""
    cases, calls = _fake_runs(monkeypatch, lambda run: KeyboardInterrupt() if run == 3 else True)
    with pytest.raises(KeyboardInterrupt):
        _measure(tmp_path, cases, 3)
    folder = tmp_path / cases[0].name
    meas = store.read_json(folder / store.MEASURED)
    assert meas["run_step_times_s"] == [1.0, 2.0] and meas["step_time_s"] == 1.5
    assert "1 of the 3 runs did not complete" in meas["notes"][-1]
    assert _run_of(folder) == "run 2"
    assert store.read_json(calls[2] / cases[0].name / store.MEASURED)["step_time_s"] == 3.0


def _stored_before(folder, case):
    """A case stored by an earlier validation, predicted."""
    store.write_case(folder, case, "before")
    (folder / store.MEASURED_TRACE).write_text("before")
    store.write_json(folder / store.MEASURED, {"step_time_s": 9.0})
    store.write_json(folder / store.PREDICTED, {"before": True})


def test_a_stop_in_the_first_run_leaves_the_stored_case_whole(tmp_path, monkeypatch):
    """Stopped during run 1: a new case is not stored at all (the summary and --predict-only
    see nothing half-written), and a case stored before keeps its files and prediction."""
    from slidedp.validate.summary import write_summary

    cases, _ = _fake_runs(monkeypatch, lambda run: KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        _measure(tmp_path, cases, 2)
    assert store.stored_cases(tmp_path) == []
    write_summary(tmp_path)  # nothing to read, nothing to trip on
    folder = tmp_path / cases[0].name
    _stored_before(folder, cases[0])
    with pytest.raises(KeyboardInterrupt):
        _measure(tmp_path, cases, 2)
    assert _run_of(folder) == "before" and store.read_json(folder / store.MEASURED) == {
        "step_time_s": 9.0} and (folder / store.PREDICTED).is_file()


def test_a_stop_inside_the_adoption_mixes_no_measurements(tmp_path, monkeypatch):
    """Stopped between the adoption's two renames: no stored case of that name (nothing
    half-written for the summary), the earlier case and the new run both kept under .runs; a
    later validation adopts its run over what that stop left."""
    cases, calls = _fake_runs(monkeypatch, lambda run: True)
    folder = tmp_path / cases[0].name
    _stored_before(folder, cases[0])
    real = os.replace

    def stop_second(src, dst):  # the run's folder renamed into place: stopped there
        if Path(dst) == folder and Path(src).parent == calls[-1]:
            raise KeyboardInterrupt
        real(src, dst)

    monkeypatch.setattr(store.os, "replace", stop_second)
    with pytest.raises(KeyboardInterrupt):
        _measure(tmp_path, cases, 1)
    assert store.stored_cases(tmp_path) == []
    before = calls[0] / f"{cases[0].name}.before"
    assert _run_of(before) == "before" and _run_of(calls[0] / cases[0].name) == "run 1"
    monkeypatch.setattr(store.os, "replace", real)
    assert _measure(tmp_path, cases, 1) == ([], [cases[0].name])
    assert _run_of(folder) == "run 2" and not (folder / store.PREDICTED).exists()
    assert not (tmp_path / store.RUNS).exists()


def test_one_run_stores_its_figures_unmerged(tmp_path, monkeypatch):
    """With one run there is nothing to merge: measured.json is the run's, with its host check,
    beside its case.toml and trace; the prediction of the case before is gone with it (the
    caller predicts anew), and no .runs folder is left."""
    cases, _ = _fake_runs(monkeypatch, lambda run: True)
    folder = tmp_path / cases[0].name
    _stored_before(folder, cases[0])
    assert _measure(tmp_path, cases, 1) == ([], [cases[0].name])
    meas = store.read_json(folder / store.MEASURED)
    assert meas["step_time_s"] == 1.0 and "host_check" in meas and _run_of(folder) == "run 1"
    assert "run_step_times_s" not in meas and not (folder / store.PREDICTED).exists()
    assert not (tmp_path / store.RUNS).exists()


def test_cli_predicts_each_group_as_it_is_stored(tmp_path, monkeypatch):
    """The CLI predicts every case measure_cases says it stored, a failed group's too, as it
    is said (before the next group runs)."""
    from slidedp.validate import measure as measure_mod
    from slidedp.validate import predict as predict_mod

    f = tmp_path / "cases.toml"
    f.write_text(TINY)
    events = []

    def fake(cases, root, **kwargs):
        for c in cases:
            events.append(("measured", c.name))
            kwargs["stored"](c.name)
        return [cases[-1].name]  # the last group failed after a completed run

    monkeypatch.setattr(measure_mod, "measure_cases", fake)
    monkeypatch.setattr(predict_mod, "write_predictions",
                        lambda folder, hw, notes: events.append(("predicted", folder.name)))
    monkeypatch.setattr("slidedp.commands.validate.print_summary", lambda *a: None)
    rc = main(["validate", "--hardware", "h200x2", "--cases", str(f), "--out",
               str(tmp_path / "v"), "--device", "cpu"])
    assert rc == 1
    assert events == [("measured", "tiny-r1"), ("predicted", "tiny-r1"),
                      ("measured", "tiny-r2"), ("predicted", "tiny-r2")]


def test_host_check_against_the_profile():
    """A check reading exactly the hardware file's rates is 1.0 of it on every kernel; one
    reading half its AdamW, 0.5 there; the teams only where the file measured them."""
    hw = load_hardware("h200x1")
    n = 12
    same = {"threads": n, "adam_gparam_per_s": hw.host.adam_rate(n) / 1e9,
            "cast_gelem_per_s": hw.host.cast_rate(n) / 1e9, "teams_gbps": 100.0}
    assert hw.host.dram_teams is None
    assert against_profile(same, hw) == {"adam": pytest.approx(1.0), "cast": pytest.approx(1.0)}
    half = same | {"adam_gparam_per_s": same["adam_gparam_per_s"] / 2}
    assert against_profile(half, hw)["adam"] == pytest.approx(0.5)
    teams = dataclasses.replace(hw, host=dataclasses.replace(hw.host, dram_teams=(n, n, 200e9)))
    assert against_profile(same, teams)["teams"] == pytest.approx(0.5)
    assert "teams" not in against_profile(same | {"threads": n - 1}, teams)  # other team sizes
    state = same | {"state_adam_gparam_per_s": 0.7 * same["adam_gparam_per_s"]}
    assert against_profile(state, hw)["state adam"] == pytest.approx(0.7)


def test_at_state_adam_scales_only_the_adam_curves_and_explains_a_slow_update():
    """The explanation's hardware: both AdamW curves times the ratio, the rest as measured; on
    a host-bound case a slower state's AdamW predicts a slower update and step."""
    from slidedp.sim.simulator import simulate
    from slidedp.validate.hostcheck import at_state_adam

    hw = load_hardware("h200x1")
    slow = at_state_adam(hw, 0.8)
    assert slow.host.adam_rate(12) == pytest.approx(0.8 * hw.host.adam_rate(12))
    assert slow.host.adam_rate(12, 2) == pytest.approx(0.8 * hw.host.adam_rate(12, 2))
    assert (slow.host.cast_rate(12), slow.pcie, slow.gpu) == (hw.host.cast_rate(12), hw.pcie,
                                                              hw.gpu)
    case = next(c for c in load_cases(VALIDATION / "cases-h200-matrix.toml")
                if c.name == "h200m-4b-r1-gb1-mb1-c64")
    base = simulate(hw, case.workload(), case.plan)
    at = simulate(slow, case.workload(), case.plan)
    assert at.channel_busy_s["UPDATE"] > 1.1 * base.channel_busy_s["UPDATE"]
    assert at.step_time_s > base.step_time_s


def test_state_check_times_one_adam_pass_over_the_whole_state():
    """state_adam_rate updates every parameter of the state once (the masters move), chunk by
    chunk, and returns parameters per second and the bytes of the gradient ring it read."""
    import torch

    from slidedp.exec.host_state import HostState
    from slidedp.validate.hostcheck import STATE_CHUNK_ELEMS, grad_ring_slots, state_adam_rate

    hs = HostState.create([STATE_CHUNK_ELEMS + 5, 7], None)
    try:
        hs.master.fill_(1.0)
        rate, ring = state_adam_rate(hs, 1, ring_bytes=0)  # the smallest ring: two slots
        assert rate > 0 and bool((hs.master != 1.0).all()) and bool((hs.exp_avg > 0).all())
        assert torch.isfinite(hs.master).all() and ring == 2 * 4 * STATE_CHUNK_ELEMS
    finally:
        hs.close()
    # the ring's slots: as many as the bytes hold, at least two, at most one per chunk
    n = STATE_CHUNK_ELEMS
    assert grad_ring_slots([3 * n + 1, 5], 0) == (2, n)  # 4 + 1 chunks, the floor of two
    assert grad_ring_slots([3 * n + 1, 5], 3 * 4 * n) == (3, n)
    assert grad_ring_slots([3 * n + 1, 5], 100 * 4 * n) == (5, n)  # one per chunk at most
    assert grad_ring_slots([7, 5], 100 * 4 * n) == (2, 7)  # two small units: two small slots
    assert grad_ring_slots([7], 100 * 4 * n) == (1, 7)


def test_a_failed_host_check_never_stops_a_validation(monkeypatch):
    """The check only informs: where it raises, the run keeps {"error": why} and the prediction
    sets no ratio for that run, keeping the others in run order."""
    from slidedp.validate import measure as measure_mod
    from slidedp.validate.predict import host_checks

    def broken():
        raise OSError("no room in /dev/shm")

    monkeypatch.setattr(measure_mod, "host_check", broken)
    assert measure_mod.checked_host() == {"error": "OSError: no room in /dev/shm"}
    ok = {"threads": 1, "adam_gparam_per_s": 1.0}
    assert host_checks({"run_host_checks": [None, ok]}) == [None, ok]
    assert host_checks({"run_host_checks": [None, None]}) == []
    assert host_checks({"host_check": ok}) == [ok] and host_checks({}) == []


def test_runs_spread_is_the_measurements_own_uncertainty():
    assert runs_spread({"run_step_times_s": [2.5, 2.0, 2.2]}) == pytest.approx(0.25)
    assert runs_spread({"run_step_times_s": [2.0]}) is None and runs_spread({}) is None


def test_cli_refuses_zero_runs(tmp_path, capsys):
    f = tmp_path / "cases.toml"
    f.write_text(TINY)
    assert main(["validate", "--hardware", "h200x2", "--cases", str(f), "--out", str(tmp_path),
                 "--device", "cpu", "--runs", "0"]) == 2
    assert "--runs" in capsys.readouterr().err and not (tmp_path / "tiny-r1").exists()


def test_cli_select_measures_only_the_matching_cases(tmp_path, monkeypatch, capsys):
    """--select picks cases of the file by name (one device call can run part of a matrix); a
    glob matching none is an error naming the option, before anything runs."""
    from slidedp.validate import measure as measure_mod

    f = tmp_path / "cases.toml"
    f.write_text(TINY)
    ran = []

    def fake(cases, root, **kwargs):
        ran.append(([c.name for c in cases], kwargs["command"]))
        return [c.name for c in cases]  # all failed, none stored: nothing to predict

    monkeypatch.setattr(measure_mod, "measure_cases", fake)
    argv = ["validate", "--hardware", "h200x2", "--cases", str(f), "--out", str(tmp_path / "v"),
            "--device", "cpu"]
    main([*argv, "--select", "*-r2"])
    assert ran == [(["tiny-r2"], ran[0][1])] and "--select '*-r2'" in ran[0][1]
    assert "1 case(s), 2 run(s) each: tiny-r2\n" in capsys.readouterr().out  # said before it runs
    assert main([*argv, "--select", "nothing*"]) == 2
    assert len(ran) == 1 and "--select" in capsys.readouterr().err


def _multi_gpu_row(case: str, ranks: int, step_s: float | None) -> dict:
    """One row of a benchmarks/multi_gpu.py JSONL for tiny-qwen3 at seq 32 (no step time: a
    compute-only reference row, which the importer skips)."""
    gb, mb, plan = parse_case_spec(case)
    row = {"case": case, "model": "tiny-qwen3", "seq": 32, "ranks": ranks, "global_batch": gb,
           "micro_batch": mb, "plan": plan_dict(plan), "date": "2000-01-02", "gpu": "G",
           "cpus": 4}
    if step_s is not None:
        row |= {"step_s": step_s, "all_steps_s": [9.0, step_s, step_s],
                "tokens_per_s": gb * 32 / step_s, "channel_s": {"COMPUTE": step_s / 2},
                "gpu_peak_gib": 1.5, "host_pss_gib_all_ranks": 2.0, "loss_last": 3.0}
    return row


# The fixture archive: two results files and their provenance, as `import_results` reads them.
MULTI_ROWS = [  # (case string, ranks, step seconds)
    ("4:4:sharded:gpu:rank0", 1, None),  # a compute-only reference row: skipped
    ("4:4:sharded:gpu:rank0", 1, 2.0),  # two protocol runs of one plan: one case, mean 2.1 s
    ("4:2:sharded:gpu:rank0:cast_threads=1:update_threads=1", 1, 3.0),  # ran_threads: [2, 2]
    ("4:1:sharded:gpu:sharded", 2, 4.0),  # two ranks
    ("4:4:sharded:gpu:rank0", 1, 2.2),
    ("2:2:replicated:cpu:rank0", 1, 5.0),  # in `skip`
]
SINGLE_ROWS = [  # (micro-batch, host_bf16_copy, window_slots, step seconds)
    (2, False, 3, 1.0),
    (1, True, 5, 1.5),
]
IMPORTS = """\
[[source]]
results = "../benchmarks/results/multi.jsonl"
format = "multi_gpu"
prefix = "m"
ran_threads = {default = [1, 1], "4:2:sharded:gpu:rank0:cast_threads=1:update_threads=1" = [2, 2]}
skip = ["2:2:replicated:cpu:rank0"]
machine = "box-x2"
discard = 1
command = "multi_gpu.py"
hardware = "../benchmarks/results/profile.toml"
hardware_notes = ["hw-note"]
notes = ["run-note"]

[[source]]
results = "../benchmarks/results/single.json"
format = "single_gpu"
prefix = "s"
ran_threads = {default = [3, 5]}
machine = "box-x1"
discard = 2
command = "single_gpu.py"
hardware = "h200x1"
"""
# the case folders the archive imports to, in order
IMPORTED = ["m-r1-gb4-mb4-sharded-gpu-rank0-s32", "m-r1-gb4-mb2-sharded-gpu-rank0-t1-1-s32",
            "m-r2-gb4-mb1-sharded-gpu-sharded-s32", "s-r1-gb2-mb2-sharded-gpu-rank0-s32",
            "s-r1-gb1-mb1-sharded-gpu-rank0-bf16copy-w5-s32"]


def write_archive(root: Path, imports: str = IMPORTS) -> Path:
    """The fixture archive under `root`: benchmarks/results/{multi.jsonl, single.json,
    profile.toml (a copy of the h200x2 preset)} and validation/imports.toml; the provenance
    file's path."""
    results = root / "benchmarks" / "results"
    results.mkdir(parents=True)
    (results / "multi.jsonl").write_text("".join(
        json.dumps(_multi_gpu_row(*r)) + "\n" for r in MULTI_ROWS))
    (results / "single.json").write_text(json.dumps({
        "meta": {"date": "2000-01-03", "gpu": "G1", "torch": "t", "cpus": 2},
        "rows": [{"model": "tiny-qwen3", "seq": 32, "micro_batch": mb,
                  "plan": {"host_bf16_copy": copy, "window_slots": w, "h2d_chunk_mib": 64.0,
                           "d2h_chunk_mib": 64.0},
                  "step_s": step, "all_steps_s": [9.0, step, step], "tokens_per_s": 1.0,
                  "gpu_peak_gib": 1.0, "host_pss_gib": 2.0,
                  "channel_s_last_step": {"COMPUTE": step / 2}, "loss_first_last": [4.0, 3.0],
                  "reference_step_s": step / 4} for mb, copy, w, step in SINGLE_ROWS]}))
    shutil.copy(preset_dir() / "h200x2.toml", results / "profile.toml")
    (root / "validation").mkdir()
    (root / "validation" / "imports.toml").write_text(imports)
    return root / "validation" / "imports.toml"


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> Path:
    """The fixture archive imported into its validation/ folder (the archive's root)."""
    root = tmp_path_factory.mktemp("archive")
    provenance = write_archive(root)
    out = provenance.parent
    assert main(["validate", "--import-results", str(provenance), "--out", str(out)]) == 0
    return root


def test_import_writes_one_case_per_configuration_of_the_archive(imported):
    """Each measured row of the fixture archive lands in the case folder its plan names:
    compute-only and skipped rows nowhere, two runs of one plan in one case (their mean), the
    threads that ran in the stored plan, each source's machine, hardware and notes."""
    out = imported / "validation"
    assert [f.name for f in store.stored_cases(out)] == sorted(IMPORTED)
    meas = {n: json.loads((out / n / store.MEASURED).read_text()) for n in IMPORTED}
    plans = {n: store.read_case(out / n).plan for n in IMPORTED}
    merged = meas[IMPORTED[0]]
    assert merged["run_step_times_s"] == [2.0, 2.2]
    assert merged["step_time_s"] == pytest.approx(2.1)  # (2.0 + 2.2) / 2
    assert [m["step_time_s"] for n, m in meas.items() if n != IMPORTED[0]] == [3.0, 4.0, 1.0, 1.5]
    assert [m["gpus_used"] for m in meas.values()] == [1, 1, 2, 1, 1]
    assert [m["machine"] for m in meas.values()] == ["box-x2"] * 3 + ["box-x1"] * 2
    assert [m["discard"] for m in meas.values()] == [1, 1, 1, 2, 2]
    assert [m["iters"] for m in meas.values()] == [3] * 5  # len(all_steps_s)
    assert [m["date"] for m in meas.values()] == ["2000-01-02"] * 3 + ["2000-01-03"] * 2
    assert meas[IMPORTED[2]]["host_pss_bytes"] == 2 * 2**30
    assert [(p.cast_threads, p.update_threads) for p in plans.values()] == [
        (1, 1), (2, 2), (1, 1), (3, 5), (3, 5)]
    asked = meas[IMPORTED[1]]["notes"][-1]
    assert "cast 2 + update 2 threads" in asked and "asked for 1 + 1" in asked
    assert (plans[IMPORTED[4]].host_bf16_copy, plans[IMPORTED[4]].window_slots) == (True, 5)
    for n, m in meas.items():
        assert m["trace"] is None and m["notes"][0] == NO_TRACE
        assert ("run-note" in m["notes"]) == n.startswith("m-")
        results = "multi.jsonl" if n.startswith("m-") else "single.json"
        assert (out / n / m["source"]).resolve() == imported / "benchmarks" / "results" / results
    profile = imported / "benchmarks" / "results" / "profile.toml"
    for n in IMPORTED:
        hw = json.loads((out / n / store.PREDICTED).read_text())["hardware"]
        if n.startswith("m-"):
            assert (hw["sha256"], hw["notes"]) == (store.sha256(profile), ["hw-note"])
            assert (out / n / hw["file"]).resolve() == profile
        else:
            assert (hw["preset"], hw["notes"]) == ("h200x1", [])
    with (out / store.SUMMARY_CSV).open() as f:
        rows = list(csv.DictReader(f))
    assert sorted(r["case"] for r in rows) == sorted(IMPORTED)
    assert {r["case"]: r["source"] for r in rows}[IMPORTED[3]] == "single.json"


def test_predict_only_recomputes_and_summarizes(imported, tmp_path, capsys):
    shutil.copytree(imported, tmp_path, dirs_exist_ok=True)
    out = tmp_path / "validation"
    for f in store.stored_cases(out):
        (f / store.PREDICTED).write_text(json.dumps(
            json.loads((f / store.PREDICTED).read_text()) | {"analytic": {}, "simulated": {}}))
    assert main(["validate", "--predict-only", "--out", str(out)]) == 0
    assert f"simulated: {len(IMPORTED)} cases, MAPE" in capsys.readouterr().out
    rows = (out / store.SUMMARY_CSV).read_text().splitlines()
    assert len(rows) == 1 + len(IMPORTED)
    for f in store.stored_cases(out):
        pred = json.loads((f / store.PREDICTED).read_text())
        assert pred["analytic"]["step_time_s"] > 0 and pred["simulated"]["step_time_s"] > 0
        assert pred["hardware"]["notes"] == (["hw-note"] if f.name.startswith("m-") else [])
    assert main(["validate", "--predict-only", "--out", str(out), "--hardware", "h200x2",
                 "--select", "*bf16copy*"]) == 0
    pred = json.loads((out / IMPORTED[4] / store.PREDICTED).read_text())
    assert (pred["hardware"]["name"], pred["hardware"]["notes"]) == ("h200x2", [])
    assert main(["validate", "--predict-only", "--out", str(out), "--select", "nothing*"]) == 2
    # a case not yet predicted (stored by a validation stopped before its prediction): one line
    # naming its predicted.json and what to give
    (out / IMPORTED[4] / store.PREDICTED).unlink()
    capsys.readouterr()
    assert main(["validate", "--predict-only", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{IMPORTED[4]}/predicted.json" in err and "--hardware" in err and "\n" not in err


@pytest.mark.xdist_group("dist")  # two torchrun ranks, with the dist modules
def test_tiny_cpu_run_writes_every_file(tmp_path, capfd):
    cases = tmp_path / "cases.toml"
    cases.write_text(TINY)
    out = tmp_path / "validation"
    rc = main(["validate", "--hardware", "h200x2", "--cases", str(cases), "--out", str(out),
               "--device", "cpu", "--iters", "2", "--discard", "1", "--machine", "ci"])
    err = capfd.readouterr().err[-4000:]  # the ranks' output too, for the messages below
    assert rc == 0, err
    for name, ranks in (("tiny-r1", 1), ("tiny-r2", 2)):
        f = out / name
        for file in (store.CASE, store.MEASURED, store.PREDICTED, store.MEASURED_TRACE,
                     store.SIMULATED_TRACE, store.OVERLAY):
            assert (f / file).is_file(), (name, file)
        meas = json.loads((f / store.MEASURED).read_text())
        assert {"step_time_s", "all_steps_s", "channel_s", "gpu_peak_bytes", "host_pss_bytes",
                "date", "machine", "gpu", "torch", "command"} <= set(meas)
        assert (meas["machine"], meas["gpu"], meas["gpus_used"], len(meas["all_steps_s"])) == (
            "ci", "cpu", ranks, 2)
        # two runs by default (method.md section 10), each on its own host state: their mean
        runs = meas["run_step_times_s"]
        assert len(runs) == 2, (meas["notes"], err)  # a failed run: why
        assert meas["step_time_s"] == pytest.approx(sum(runs) / 2)
        assert meas["run_all_steps_s"][-1] == meas["all_steps_s"] and "--runs 2" in meas["command"]
        assert not (out / store.RUNS).exists()  # every run adopted
        checks = meas["run_host_checks"]  # one host check before each run, kept with the case
        assert len(checks) == 2 and meas["host_check"] == checks[-1]
        assert all(c["adam_gparam_per_s"] > 0 and c["threads"] >= 1 for c in checks)
        # the state check: one process only, its AdamW pass over the run's own host state
        assert all(("state_adam_gparam_per_s" in c) == (ranks == 1) for c in checks)
        assert all(("state_adam_ring_mib" in c) == (ranks == 1) for c in checks)
        assert "state_adam_gparam_per_s" not in meas
        vs = json.loads((f / store.PREDICTED).read_text())["host_check_vs_profile"]
        assert set(vs) == {"adam", "cast", "teams", "state adam"}
        assert all(len(v) == 2 for v in vs.values())
        assert min(vs["adam"] + vs["cast"] + (vs["state adam"] if ranks == 1 else [])) > 0
        assert vs["teams"] == [None, None]  # the preset measured no teams at these sizes
        spread = runs_spread(meas)
        assert f"| {meas['step_time_s']:.3f} ({100 * spread:.1f}%) |" in (
            out / store.SUMMARY_MD).read_text()
        assert meas["channel_s"]["COMPUTE"] > 0 and "--cases" in meas["command"]
        measured = load_trace(f / store.MEASURED_TRACE)
        computes = {r.agent for r in measured.records if r.channel == "COMPUTE"}
        assert computes == {f"gpu{i}.compute" for i in range(ranks)}  # every rank merged
        assert load_trace(f / store.SIMULATED_TRACE).records
        pred = json.loads((f / store.PREDICTED).read_text())
        assert {"analytic", "simulated", "hardware"} <= set(pred) and pred["hardware"]["sha256"]
        # the explanation at the state's AdamW: one process only, at the runs' mean ratio
        at = pred.get("simulated_at_state_adam")
        assert (at is not None) == (ranks == 1)
        if at is not None:
            assert at["state_adam_vs_profile"] == pytest.approx(sum(vs["state adam"]) / 2)
            assert at["step_time_s"] > 0
        kinds = pred["task_kind_s"]  # per task kind: [measured, simulated] seconds of the step
        assert {"FWD", "BWD", "ADAM"} <= set(kinds) and all(m >= 0 and s >= 0 for m, s in kinds.values())
        assert kinds["FWD"][0] == pytest.approx(measured.kind_seconds()["FWD"])
        # the GPU agents' tasks with their issue: on CPU the work is done while issuing
        issue = pred["measured_issue_s"]
        assert {"FWD", "BWD", "H2D", "D2H"} <= set(issue) and "ADAM" not in issue
        assert all(during == pytest.approx(span) for span, during in issue.values())
    assert len((out / store.SUMMARY_CSV).read_text().splitlines()) == 3


def test_case_spec_parses_plan_overrides_and_names_bad_fields():
    gb, mb, plan = parse_case_spec("16:4:replicated:cpu:rank0:window_slots=36:h2d_chunk_mib=16.0")
    assert (gb, mb, str(plan.param_route), str(plan.grad_route), plan.window_slots,
            plan.h2d_chunk_mib) == (16, 4, "replicated", "cpu", 36, 16.0)
    with pytest.raises(SpecError, match="plan.window_size"):
        parse_case_spec("8:4:sharded:gpu:rank0:window_size=3")
    with pytest.raises(SpecError, match="GB:MB"):
        parse_case_spec("8:4:sharded")
    with pytest.raises(SpecError, match="param_route"):
        parse_case_spec("8:4:diagonal:gpu:rank0")


def test_case_spec_reads_a_plan_file(tmp_path):
    f = tmp_path / "plan.toml"
    f.write_text('[plan]\nparam_route = "replicated"\nwindow_slots = 5\nlayer_policies = ["none", "layer"]\n')
    gb, mb, plan = parse_case_spec(f"8:2:plan={f}:window_slots=7")
    assert (gb, mb, str(plan.param_route), plan.window_slots, plan.layer_policies) == (
        8, 2, "replicated", 7, ("none", "layer"))
    with pytest.raises(SpecError, match="missing.toml"):
        parse_case_spec(f"8:2:plan={tmp_path / 'missing.toml'}")


@pytest.mark.parametrize("field, given", [
    ("ran_threads", 'ran_threads = {default = [1, 1], "4:4:nosuchcase" = [1, 1]}'),
    ("skip", 'ran_threads = {default = [1, 1]}\nskip = ["4:4:nosuchcase"]')])
def test_import_refuses_case_strings_of_no_case(tmp_path, field, given):
    first = IMPORTS.split("\n\n")[0].splitlines()
    kept = [line for line in first if not line.startswith(("ran_threads", "skip"))]
    provenance = write_archive(tmp_path, "\n".join([*kept, given]) + "\n")
    with pytest.raises(SpecError, match=f"{field}.4:4:nosuchcase"):
        import_results(provenance, tmp_path / "validation")
    assert store.stored_cases(tmp_path / "validation") == []


def test_a_gpu_tasks_issue_interval_survives_the_trace_file_and_the_shifts(tmp_path):
    """A measured GPU task's issue interval (when its agent enqueued it) is written to the
    Chrome trace's args, read back to the nanosecond, and moved with the record by the steady
    step's shift; a record without one stays without."""
    from slidedp.graph.timeline import Record, Timeline
    from slidedp.validate.traces import save_trace, steady_step

    gpu = Record(2, "BWD", 3, 0, -1, "gpu0.compute", 1.25, 1.5, 1.2000004, 1.2100004)
    cpu = Record(2, "ADAM", 3, -1, 0, "cpu.update0", 1.5, 1.75)
    before = Record(1, "BWD", 3, 0, -1, "gpu0.compute", 0.25, 0.5, 0.2, 0.21)
    save_trace(Timeline([before, gpu, cpu]), tmp_path / "t.json.gz")
    back = {(r.iteration, r.kind): r for r in load_trace(tmp_path / "t.json.gz").records}
    assert back[(2, "BWD")].issue_start_s == pytest.approx(1.2000004, abs=1e-9)
    assert back[(2, "BWD")].issue_end_s == pytest.approx(1.2100004, abs=1e-9)
    assert (back[(2, "ADAM")].issue_start_s, back[(2, "ADAM")].issue_end_s) == (None, None)
    # the part of a span before its issue ended: none here (issued before it started), 0.1 s
    # of the copy issued late, nothing for the CPU task
    late = Record(2, "D2H", 3, 0, 0, "gpu0.d2h", 2.0, 2.5, 1.9, 2.1)
    overlap = Timeline([gpu, cpu, late]).issue_overlap_s()
    assert set(overlap) == {"BWD", "D2H"}
    assert overlap["BWD"] == pytest.approx((0.25, 0.0)) and overlap["D2H"] == pytest.approx((0.5, 0.1))
    steady = {r.kind: r for r in steady_step(Timeline([before, gpu, cpu])).records}
    assert (steady["BWD"].start_s, steady["BWD"].issue_start_s) == pytest.approx((0.75, 0.7000004))
    assert steady["ADAM"].issue_start_s is None and steady["ADAM"].start_s == pytest.approx(1.0)


def test_a_long_case_gets_a_trace_file_name_the_file_system_takes(tmp_path):
    """A case with one policy per decoder layer (36 of them: 700 characters) gets a name of its
    first characters and a digest of the whole, which a file can have (on nvidia-h200,
    2026-12-01, multi_gpu.py --traces failed on such a case); distinct cases stay distinct."""
    cases = [f"4:4:sharded:gpu:rank0:layer_policies=[{','.join([repr(p)] * 36)}]"
             for p in ("sac", "none")]
    names = [trace_file_name(c) for c in cases]
    assert names[0] != names[1] and names[0] == trace_file_name(cases[0])
    for n in names:
        assert n.endswith(".json.gz") and len(n.encode()) <= 255
        (tmp_path / n).write_bytes(b"")
    assert trace_file_name("2:1:sharded:gpu:rank0") == "2_1_sharded_gpu_rank0.json.gz"


def test_multi_gpu_traces_are_imported_beside_their_cases(tmp_path):
    """benchmarks/multi_gpu.py --traces (the real script, on the CPU) writes each case's last
    step (gzip); the importer stores it as the case's measured trace, with the simulated one and
    their overlay, also from a plain .json of that name (an older run's); a case without a file
    in the folder is stored without a trace and says so."""
    results, traces = tmp_path / "r.jsonl", tmp_path / "r.traces"
    cases = ["2:1:sharded:gpu:rank0", "2:2:sharded:gpu:rank0:window_slots=4"]
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "multi_gpu.py"), str(results),
                    "tiny-qwen3", "--seq", "32", "--device", "cpu", *cases, "--iters", "2",
                    "--discard", "1", "--traces", str(traces)],
                   check=True, env=os.environ | {"PYTHONPATH": str(ROOT)}, capture_output=True)
    assert sorted(p.name for p in traces.iterdir()) == sorted(trace_file_name(c) for c in cases)
    written = traces / trace_file_name(cases[0])
    assert written.name.endswith(".json.gz") and written.read_bytes()[:2] == GZIP_MAGIC
    doc = read_trace_doc(written)
    written.with_suffix("").write_text(json.dumps(doc))  # NAME.json: the plain form
    written.unlink()
    (traces / trace_file_name(cases[1])).unlink()
    prov = tmp_path / "imports.toml"
    prov.write_text('[[source]]\nresults = "r.jsonl"\nformat = "multi_gpu"\nprefix = "t"\n'
                    'ran_threads = {default = [1, 1]}\nmachine = "cpu"\ndiscard = 1\n'
                    'command = "multi_gpu.py"\nhardware = "h200x1"\ntraces = "r.traces"\n')
    out = tmp_path / "validation"
    folders = import_results(prov, out)
    with_trace, without = folders
    meas = json.loads((with_trace / store.MEASURED).read_text())
    assert meas["trace"] == store.MEASURED_TRACE and NO_TRACE not in meas["notes"]
    for name in (store.MEASURED_TRACE, store.SIMULATED_TRACE, store.OVERLAY):
        assert (with_trace / name).is_file()
    assert json.loads(gzip.decompress((with_trace / store.MEASURED_TRACE).read_bytes())) == doc
    assert json.loads((with_trace / store.PREDICTED).read_text())["task_kind_s"]["ADAM"][0] > 0
    meas = json.loads((without / store.MEASURED).read_text())
    assert meas["trace"] is None and NO_TRACE in meas["notes"]
    assert not (without / store.MEASURED_TRACE).exists()


def test_protocol_runs_of_one_plan_import_as_one_case(tmp_path):
    """benchmarks/confirm_sweep.py measures each plan twice, interleaved (rows A B C A B C): the
    importer stores one case per plan, its step time the runs' mean, and names the activation
    policies and the sequence length in the folder (the rows differ only there)."""
    rows = ROOT / "benchmarks/results/2026-12-01-h200-autopolicy-4b-seq16384-0428/confirm-0840.jsonl"
    steps: dict[str, list[float]] = {}
    for line in rows.read_text().splitlines():
        d = json.loads(line)
        steps.setdefault(d["case"], []).append(d["step_s"])
    assert len(steps) == 4 and all(len(v) == 2 for v in steps.values())
    prov = tmp_path / "imports.toml"
    prov.write_text(f'[[source]]\nresults = "{rows}"\nformat = "multi_gpu"\nprefix = "t"\n'
                    'ran_threads = {default = [12, 12]}\nmachine = "nvidia-h200"\ndiscard = 8\n'
                    'command = "confirm_sweep.py"\nhardware = "h200x1"\n')
    folders = import_results(prov, tmp_path / "validation")
    assert len(folders) == 4
    assert {f.name for f in folders} == {
        "t-r1-gb1-mb1-replicated-gpu-rank0-w36-c256-sacx36-s16384",
        "t-r1-gb1-mb1-sharded-gpu-rank0-s16384",
        "t-r1-gb1-mb1-sharded-gpu-rank0-w36-sacx36-s16384",
        "t-r1-gb1-mb1-sharded-gpu-rank0-c256-sacx36-s16384"}
    means = sorted(sum(v) / 2 for v in steps.values())
    got = sorted(json.loads((f / store.MEASURED).read_text())["step_time_s"] for f in folders)
    assert got == pytest.approx(means)
    meas = json.loads((folders[0] / store.MEASURED).read_text())
    assert len(meas["run_step_times_s"]) == 2 and "the mean of 2 runs" in meas["notes"][-1]


def test_rows_of_different_plans_never_share_a_case_folder(tmp_path):
    """The folder name leaves out most plan fields: two rows that differ only there are refused,
    not averaged as runs of one plan (nor one overwritten by the other)."""
    src = ROOT / "benchmarks/results/2026-12-01-h200-autopolicy-4b-seq16384-0428/confirm-0840.jsonl"
    row = json.loads(src.read_text().splitlines()[1])
    other = json.loads(json.dumps(row))
    other["case"] += ":reload_ahead_layers=3"
    other["plan"]["reload_ahead_layers"] = 3
    (tmp_path / "r.jsonl").write_text(json.dumps(row) + "\n" + json.dumps(other) + "\n")
    prov = tmp_path / "imports.toml"
    prov.write_text('[[source]]\nresults = "r.jsonl"\nformat = "multi_gpu"\nprefix = "t"\n'
                    'ran_threads = {default = [12, 12]}\nmachine = "m"\ndiscard = 8\n'
                    'command = "c"\nhardware = "h200x1"\n')
    with pytest.raises(SpecError, match="one case folder per configuration"):
        import_results(prov, tmp_path / "validation")
    assert not (tmp_path / "validation").exists()


def test_an_older_store_of_plain_json_traces_is_read_and_repredicted(tmp_path):
    """Stored traces are gzip files (NAME.json.gz, what gzip -d and Perfetto read); a case stored
    before them (plain measured_trace.json and simulated_trace.json) is read as it is, and its
    re-prediction writes the simulated trace in the .json.gz form in place of the plain one."""
    src = VALIDATION / "h200-2153-qwen3-4b-r1-gb4-mb4-sharded-gpu-rank0-w36"
    assert src.joinpath(store.MEASURED_TRACE).read_bytes()[:2] == GZIP_MAGIC
    case = tmp_path / "validation" / src.name
    shutil.copytree(src, case)
    for name in (store.MEASURED_TRACE, store.SIMULATED_TRACE):
        (case / name.removesuffix(".gz")).write_bytes(gzip.decompress((case / name).read_bytes()))
        (case / name).unlink()
    plain, packed = load_trace(case / "measured_trace.json"), load_trace(src / store.MEASURED_TRACE)
    assert plain.records and (plain.records, plain.exposures) == (packed.records, packed.exposures)
    assert main(["validate", "--predict-only", "--out", str(case.parent), "--hardware", "h200x1"]) == 0
    assert (case / "measured_trace.json").is_file() and not (case / "simulated_trace.json").exists()
    pred = json.loads((case / store.PREDICTED).read_text())
    assert pred["simulated_trace"] == store.SIMULATED_TRACE and pred["task_kind_s"]["FWD"][0] > 0
    simulated = (case / store.SIMULATED_TRACE).read_bytes()
    assert json.loads(gzip.decompress(simulated))["traceEvents"]
    assert main(["validate", "--predict-only", "--out", str(case.parent), "--hardware", "h200x1"]) == 0
    assert (case / store.SIMULATED_TRACE).read_bytes() == simulated  # no time stamp in the gzip


def test_import_refuses_a_skip_that_is_not_a_list(tmp_path):
    provenance = write_archive(tmp_path, IMPORTS.replace(
        'skip = ["2:2:replicated:cpu:rank0"]', 'skip = "2:2:replicated:cpu:rank0"', 1))
    with pytest.raises(SpecError, match="skip.*a list of case strings"):
        import_results(provenance, tmp_path / "validation")


def test_task_kind_rows_read_each_kind_and_its_issuing_part():
    """task_kind_rows: per stored case and task kind, the measured and simulated seconds of
    predicted.json, with the issuing part of the GPU kinds where the trace recorded it (the
    stored 4B mb 1 case of 2026-12-02 02:58: the 64 MiB recompute mostly waited on its
    issuing thread)."""
    root = Path(__file__).parents[1] / "validation"
    name = "h200m0259-4b-r1-gb1-mb1-c64"
    rows = {r["kind"]: r for r in task_kind_rows(root, name)}
    pred = json.loads((root / name / "predicted.json").read_text())
    assert set(rows) == set(pred["task_kind_s"])
    rec = rows["RECOMPUTE"]
    assert [rec["measured_s"], rec["simulated_s"]] == pred["task_kind_s"]["RECOMPUTE"]
    assert rec["issuing_s"] == pred["measured_issue_s"]["RECOMPUTE"][1] > 0.5 * rec["measured_s"]
    assert rows["ADAM"]["issuing_s"] is None  # a CPU kind: its span is host time already
    old = task_kind_rows(root, "h200m0013-4b-r1-gb1-mb1-c64")  # before the issue intervals
    assert old and all(r["issuing_s"] is None for r in old)
