"""benchmarks/peers.py on the CPU: its figures and ratios from fake timings, the budget and the
process handling, bad input, the table across calls, and one real `ours` row of the tiny preset
(its `slidedp train` run, stopped once the last step is logged). The GPU peers run under -m gpu."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import peers  # noqa: E402


def _row(system, kernels, step_s, mb=4, model="qwen3-4b", **kw):
    r = {"model": model, "seq": 4096, "micro_batch": mb, "system": system, "kernels": kernels}
    return peers.finish_row(r, [9.0] * 5 + [step_s] * 7, 5, 1e15) | kw


def test_steady_mean_and_figures():
    assert peers.steady_mean([9, 1, 2, 3], 1) == 2
    with pytest.raises(ValueError, match="more than 4"):
        peers.steady_mean([1, 2, 3], 4)
    r = _row("resident", "liger", 2.0)
    assert r["step_s"] == 2.0 and r["tokens_per_s"] == 4 * 4096 / 2.0 and r["tflops"] == 500.0


def test_ours_row_from_metrics():
    m = [{"step": i, "step_time_s": 3.0 if i < 6 else 1.0, "loss": 12 - i,
          "gpu_peak_bytes": 2**30 * i, "host_pss_bytes": 2**31} for i in range(1, 13)]
    base = {"model": "qwen3-4b", "seq": 4096, "micro_batch": 4, "system": "ours",
            "kernels": "liger"}
    r = peers.ours_row(dict(base), m[::-1], 12, 5, 2e15)
    assert r["status"] == "ok" and r["step_s"] == 1.0 and r["tflops"] == 2000.0
    assert r["gpu_peak_bytes"] == 12 * 2**30 and r["loss_first_last"] == [11, 0]
    r = peers.ours_row(dict(base), m[:10], 12, 5, 2e15)
    assert r["status"] == "failed" and "steps" in r["note"]


def test_summary_pairs_ours_with_each_peer_at_the_same_kernels():
    rows = [_row("ours", "liger", 1.0), _row("resident", "liger", 1.1), _row("zero2", "liger", 2.0),
            _row("reference", "liger", 0.9), _row("ours-clip", "liger", 1.04),
            _row("ours", "eager", 1.5), _row("resident", "eager", 1.6),
            {"model": "qwen3-4b", "seq": 4096, "micro_batch": 4, "system": "zero2",
             "kernels": "eager", "status": "skipped", "note": "estimated 90 s, 10 s left"}]
    (liger, eager) = peers.summary(rows)
    assert liger["kernels"] == "liger" and eager["kernels"] == "eager"
    assert liger["ours_over_resident"] == pytest.approx(1.1)
    assert liger["ours_over_zero2"] == pytest.approx(2.0)
    assert liger["ours_over_reference"] == pytest.approx(0.9)
    assert liger["clipped_over_unclipped"] == pytest.approx(1.0 / 1.04)
    assert eager["ours_over_resident"] == pytest.approx(1.6 / 1.5)
    assert eager["ours_over_zero2"] is None and eager["clipped_over_unclipped"] is None
    md = peers.markdown(rows, [{"date": "d", "gpu": "g", "steps": 12, "discard": 5}])
    assert "| qwen3-4b | 4 | GPU-resident mixed precision, fused AdamW | liger | 1.100 |" in md
    assert "skipped: estimated 90 s, 10 s left" in md
    assert "| qwen3-4b | 4 | liger | 16,384 | 1000 | 1.100 | 2.000 | 0.900 | 0.962 |" in md
    assert "| qwen3-4b | 4 | eager | 10,923 | 667 | 1.067 | - | - | - |" in md
    assert "mean of 6-12" in md


def test_budget_and_estimates():
    now = [100.0]
    b = peers.Budget(60, clock=lambda: now[0])
    now[0] = 130
    assert b.left_s() == 30
    assert peers.estimate_s("resident", 1e15, 12, {}) == pytest.approx(30 + 12 * 1e15 / 330e12)
    assert peers.estimate_s("resident", 1e15, 12, {"resident": 50.0}) == pytest.approx(55.0)


def test_run_process_stops_when_done_or_out_of_time(tmp_path):
    log = tmp_path / "p.log"
    sleeper = [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"]
    t0 = time.monotonic()
    rc, wall, how = peers.run_process(sleeper, log, 30, lambda: "ready" in log.read_text(), 0.05)
    assert (rc, how) == (None, "done") and time.monotonic() - t0 < 20
    rc, wall, how = peers.run_process(sleeper, log, 0.3, poll_s=0.05)
    assert (rc, how) == (None, "timeout")
    rc, _, how = peers.run_process([sys.executable, "-c", "raise SystemExit(3)"], log, 30)
    assert (rc, how) == (3, "exit")


@pytest.mark.parametrize("args,what", [
    (["--micro-batch", "0"], "--micro-batch"), (["--micro-batch", "1", "--model", "nope"],
                                                "--model"),
    (["--micro-batch", "1", "--discard", "12"], "--discard"),
    (["--micro-batch", "1", "--budget-s", "0"], "--budget-s")])
def test_bad_input_is_one_line_and_exit_2(args, what, tmp_path, capsys):
    assert peers.main(["run", "--out", str(tmp_path), *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and what in err[0]


def test_rows_that_do_not_fit_the_budget_are_skipped_and_say_so(tmp_path, monkeypatch):
    monkeypatch.setattr(peers, "deepspeed_importable", lambda: False)
    out = tmp_path / "out"
    assert peers.main(["run", "--model", "tiny-qwen3", "--micro-batch", "1", "2", "--seq", "64",
                       "--budget-s", "0.001", "--out", str(out), "--work",
                       str(tmp_path / "w")]) == 0
    data = json.loads((out / "peers.json").read_text())
    rows = data["rows"]
    assert len(rows) == 2 * len(peers.PRIORITY)
    assert all(r["status"] == "skipped" for r in rows)
    assert {r["note"] for r in rows if r["system"] == "zero2"} == {"deepspeed does not import here"}
    assert all("of the budget left" in r["note"] for r in rows if r["system"] != "zero2")
    assert "skipped" in (out / "peers.md").read_text()


def test_table_merges_calls(tmp_path):
    for i, mb in enumerate((4, 8)):
        d = tmp_path / f"c{i}"
        d.mkdir()
        (d / "peers.json").write_text(json.dumps({"metas": [{"date": f"call{i}"}], "rows": [
            _row("ours", "liger", 1.0 * mb / 4, mb=mb), _row("resident", "liger", 1.2, mb=mb)]}))
    text = peers.table([str(tmp_path / "c0/peers.json"), str(tmp_path / "c1/peers.json")],
                       str(tmp_path / "all"))
    assert "call0" in text and "call1" in text
    assert "| qwen3-4b | 4 | liger |" in text and "| qwen3-4b | 8 | liger |" in text
    assert len(json.loads((tmp_path / "all/peers.json").read_text())["rows"]) == 4


def test_an_ours_row_runs_train_and_records_what_it_ran(tmp_path):
    out = tmp_path / "out"
    assert peers.main(["run", "--model", "tiny-qwen3", "--micro-batch", "2", "--seq", "64",
                       "--steps", "3", "--discard", "1", "--systems", "ours", "--kernels", "liger",
                       "--budget-s", "240", "--out", str(out), "--work", str(tmp_path / "w")]) == 0
    (row,) = json.loads((out / "peers.json").read_text())["rows"]
    assert row["status"] == "ok", row
    assert len(row["all_steps_s"]) == 3 and row["step_s"] > 0 and row["host_pss_bytes"] > 0
    # on the CPU the default (auto) runs eager: the row says so rather than claiming liger
    assert (row["kernels"], row["kernels_asked"]) == ("eager", "liger")
    assert "asked for liger, ran eager" in row["note"]
    assert not (tmp_path / "w" / "ours-liger-mb2").exists()  # its output is removed


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("system", ["resident", "reference"])
@pytest.mark.parametrize("kernels", ["eager", "liger"])
def test_one_hf_peer_row_on_the_gpu(system, kernels, capsys):
    if kernels == "liger":
        pytest.importorskip("liger_kernel")
    import subprocess

    p = subprocess.run([sys.executable, str(ROOT / "benchmarks/peers.py"), "one", system,
                        "--kernels", kernels, "--model", "tiny-qwen3", "--micro-batch", "2",
                        "--seq", "64", "--steps", "3", "--discard", "1"],
                       capture_output=True, text=True, timeout=300)
    rows = [json.loads(x[len(peers.ROW_MARK):]) for x in p.stdout.splitlines()
            if x.startswith(peers.ROW_MARK)]
    assert rows and rows[-1]["status"] == "ok", p.stdout[-2000:] + p.stderr[-2000:]
    assert len(rows[-1]["all_steps_s"]) == 3 and rows[-1]["gpu_peak_bytes"] > 0


def _zero2_rows(tmp_path, monkeypatch, avail_bytes):
    monkeypatch.setattr(peers, "deepspeed_importable", lambda: True)
    monkeypatch.setattr(peers, "host_mem_available_bytes", lambda: avail_bytes)
    out = tmp_path / "out"
    assert peers.main(["run", "--model", "tiny-qwen3", "--micro-batch", "1", "--seq", "64",
                       "--systems", "zero2", "--budget-s", "600", "--out", str(out), "--work",
                       str(tmp_path / "w")]) == 0
    return json.loads((out / "peers.json").read_text())


def test_zero2_without_host_memory_is_skipped_before_any_build(tmp_path, monkeypatch):
    data = _zero2_rows(tmp_path, monkeypatch, 0)
    assert [r["status"] for r in data["rows"]] == ["skipped", "skipped"]
    assert all(r["note"].startswith("needs 0 GiB of host memory (16 B/param), 0 GiB available")
               for r in data["rows"])
    assert not (tmp_path / "w" / "zero2-build.log").exists()


def test_a_failed_cpu_adam_build_skips_every_zero2_row_and_is_tried_once(tmp_path, monkeypatch):
    data = _zero2_rows(tmp_path, monkeypatch, 2**40)  # deepspeed is not really here: it fails
    notes = {r["note"] for r in data["rows"]}
    assert len(data["rows"]) == 2 and len(notes) == 1
    assert notes.pop().startswith("its CPU Adam did not build (exit)")
    assert data["metas"][0]["zero2_build_s"] is None
