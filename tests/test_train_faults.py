"""`slidedp train` (one process) under faults: options that are not finite, an --out or --trace
that cannot be written, a full disk, a model or a --seq the executor cannot run, a second run on
the same --out, a torn metrics line, other data on resume, NaN, and SIGINT / SIGTERM. Each ends in
one line with its exit code (2 bad input, 1 run failure, 130 / 143 stopped), before anything large
where it can, never with a traceback, and never loses the newest checkpoint. Faults are injected
(a patched statvfs or write, RLIMIT_FSIZE, paths under /proc): CI runs as root, where chmod does
not make a path read-only. The --nproc 2 cases are in test_train_dist.py.
"""

import errno
import json
import math
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp import cli
from slidedp.exec import checkpoint, fused_kernels, host_state, rundir, trainer
from slidedp.exec.checkpoint import latest_checkpoint
from slidedp.exec.io import stream
from slidedp.exec.schedule import LrSchedule

FAST = ["--global-batch", "8", "--micro-batch", "4", "--warmup-steps", "2", "--device", "cpu"]


def train(out, *extra):
    return cli.main(["train", "--out", str(out), *FAST, *extra])


def rows(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def one_line(capsys) -> str:
    """The one line on stderr besides the progress bar (tqdm's lines hold "%|")."""
    err = [ln for ln in capsys.readouterr().err.replace("\r", "\n").splitlines()
           if ln.strip() and "%|" not in ln]
    assert len(err) == 1, err
    return err[0]


def final_tensors(out):
    return load_file(str(out / "final" / "model.safetensors"))


def checkpoint_state(ckpt):
    return {k: v for f in sorted(ckpt.glob("unit-*.safetensors"))
            for k, v in ((f"{f.name}/{n}", t) for n, t in load_file(str(f)).items())}


@pytest.fixture
def no_host_state(monkeypatch):
    """Fails the test if a run gets as far as creating its host state."""
    def refuse(*a, **k):
        raise AssertionError("the host state was created before the check")
    monkeypatch.setattr(host_state.HostState, "create", refuse)


# ---- bad input: one line, exit 2, before anything large --------------------------------------


def test_options_must_be_finite_and_chunks_not_tiny(tmp_path, capsys, no_host_state):
    cases = [(["--lr", "nan"], "--lr"), (["--lr", "inf"], "--lr"), (["lr=nan"], "lr=nan"),
             (["--eps=-inf"], "--eps"), (["betas=[nan, 0.9]"], "betas"),
             (["--grad-clip", "inf"], "--grad-clip"), (["--chunk-mib", "0.5"], "--chunk-mib")]
    for extra, needle in cases:
        assert train(tmp_path / "o", "--steps", "2", *extra) == 2, extra
        err = one_line(capsys)
        assert needle in err and ("finite" in err or "at least 1 MiB" in err), err
    assert cli.main(["predict", "--chunk-mib", "1e-6"]) == 2  # it used to allocate until killed
    assert "--chunk-mib" in one_line(capsys)


def test_out_and_trace_that_cannot_be_written_fail_first(tmp_path, capsys, no_host_state):
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, needle in ((afile, "a directory, got a file"),
                        (tmp_path / "afile" / "run", "--out"),
                        ("/proc/slidedp-test/run", "--out")):
        assert cli.main(["train", "--out", str(out), "--device", "cpu"]) == 2
        assert needle in one_line(capsys)
    out = tmp_path / "run"
    assert train(out, "--trace", "/proc/slidedp-test/trace.json") == 2
    assert "--trace" in one_line(capsys)
    assert not (out / "metrics.jsonl").exists()


def test_model_the_executor_cannot_run_is_refused_before_the_host_state(tmp_path, capsys,
                                                                         no_host_state):
    cfg = AutoConfig.for_model(model_type="qwen3_moe", hidden_size=32, intermediate_size=64,
                               moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, vocab_size=512)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / "moe")
    capsys.readouterr()
    assert train(tmp_path / "o", "--model", str(tmp_path / "moe")) == 2
    err = one_line(capsys)
    assert "qwen3_moe" in err and "model_type" in err


def _llama(path, rope_scaling):
    cfg = AutoConfig.for_model(model_type="llama", hidden_size=32, intermediate_size=64,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               vocab_size=512, max_position_embeddings=32,
                               rope_scaling=rope_scaling)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    return str(path)


def test_seq_past_the_models_positions_warns_or_is_refused(tmp_path, capsys):
    plain = _llama(tmp_path / "plain", None)
    scaled = _llama(tmp_path / "yarn", {"rope_type": "yarn", "factor": 2.0,
                                        "original_max_position_embeddings": 16})
    capsys.readouterr()
    assert train(tmp_path / "a", "--model", plain, "--steps", "1") == 0  # seq 64 > 32
    err = capsys.readouterr().err
    assert "warning: --seq 64 is longer than the model's max_position_embeddings 32" in err
    assert train(tmp_path / "b", "--model", scaled, "--steps", "1") == 2
    err = one_line(capsys)
    assert "--seq" in err and "at most 32" in err and "yarn" in err


def test_full_disk_is_refused_up_front_and_a_failed_write_is_one_line(tmp_path, capsys,
                                                                      monkeypatch):
    """No room for a checkpoint: refused before training, saying how much is needed. A write
    that fails anyway (ENOSPC injected, then RLIMIT_FSIZE) ends the run in one line, exit 1,
    the previous checkpoint intact and nothing exported."""
    real_statvfs = os.statvfs

    class Full:
        f_frsize, f_bavail = 4096, 10

    monkeypatch.setattr(rundir.os, "statvfs", lambda p: Full)
    assert train(tmp_path / "full", "--steps", "2") == 2
    err = one_line(capsys)
    assert "disk space" in err and "needs" in err and "one checkpoint" in err
    monkeypatch.setattr(rundir.os, "statvfs", real_statvfs)

    real_write, saves = stream.SafetensorsWriter.write, []

    def enospc(self, name, t):
        if "checkpoints" in str(self.path) and "step-00000004" in str(self.path.parent):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self.path))
        return real_write(self, name, t)

    monkeypatch.setattr(stream.SafetensorsWriter, "write", enospc)
    out = tmp_path / "enospc"
    assert train(out, "--steps", "6", "--checkpoint-every", "2") == 1
    err = one_line(capsys)
    assert "No space left on device" in err and "unit-" in err
    assert latest_checkpoint(out / "checkpoints").name == "step-00000002"
    assert not (out / "final").exists()
    monkeypatch.setattr(stream.SafetensorsWriter, "write", real_write)

    real_save = checkpoint.save_checkpoint

    def small_files(*a, **k):  # file size limit from the second save on
        saves.append(1)
        if len(saves) < 2:
            return real_save(*a, **k)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1024, hard))
        try:
            return real_save(*a, **k)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))

    monkeypatch.setattr(trainer, "save_checkpoint", small_files)
    out = tmp_path / "fsize"
    assert train(out, "--steps", "6", "--checkpoint-every", "2") == 1
    assert "File too large" in one_line(capsys)
    assert latest_checkpoint(out / "checkpoints").name == "step-00000002"
    assert not list((out / "checkpoints").glob(".*"))  # the failed save's temp dir is gone


def test_with_nproc_2_the_same_checks_come_before_any_rank_starts(tmp_path, capsys, monkeypatch,
                                                                  no_host_state):
    """--out a file, a bad --trace, a full disk: refused by the launcher, torchrun never run."""
    import slidedp.exec.dist

    def refuse(*a, **k):
        raise AssertionError("the rank processes were started before the check")

    monkeypatch.setattr(slidedp.exec.dist, "launch", refuse)
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert cli.main(["train", "--out", str(afile), "--device", "cpu", "--nproc", "2"]) == 2
    assert "a directory, got a file" in one_line(capsys)
    assert train(tmp_path / "o", "--nproc", "2", "--trace", "/proc/x/t.json") == 2
    assert "--trace" in one_line(capsys)

    class Full:
        f_frsize, f_bavail = 4096, 10

    monkeypatch.setattr(rundir.os, "statvfs", lambda p: Full)
    assert train(tmp_path / "o", "--nproc", "2") == 2
    assert "disk space" in one_line(capsys)


# ---- shared memory left by dead processes -------------------------------------------------------


def test_files_of_dead_processes_are_reclaimed_and_live_ones_kept(tmp_path, capsys):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True).stdout.strip()  # its pid: gone now
    me, start = os.getpid(), host_state.process_start(os.getpid())
    names = {"dead": f"slidedp-{dead}-123-0123abcd.state.master",
             "reused": f"slidedp-{me}-{start + 1}-0123abcd.status1",  # this pid, another start
             "older": f"slidedp-{dead}-89abcdef.json",  # the name form without a start time
             "live": f"slidedp-{me}-{start}-0123abcd.state.master",
             "other": "notslidedp-1-2-0123abcd.x"}
    for name in names.values():
        (tmp_path / name).write_bytes(b"\0" * 4096)
    gone = host_state.reclaim_segments(tmp_path)
    assert sorted(p.name for p in gone) == sorted(names[k] for k in ("dead", "reused", "older"))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([names["live"], names["other"]])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "removed 3 shared-memory files" in err


# ---- the run directory ------------------------------------------------------------------------


def test_a_held_out_is_refused_and_a_dead_holders_lock_is_taken_over(tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    lock = rundir.RunLock.acquire(out)  # as a live run holds it
    assert train(out, "--steps", "2") == 2
    err = one_line(capsys)
    assert "--out" in err and f"pid {os.getpid()}" in err
    lock.release()
    rank = rundir.RunLock.hold_rank(out, 1)  # a rank process of an earlier run, still alive
    assert train(out, "--steps", "2") == 2
    assert "rank process of an earlier run" in one_line(capsys)
    rank.release()
    (out / ".lock").write_text('{"pid": 999999999, "argv": ["dead"]}')  # its holder is gone
    assert train(out, "--steps", "2") == 0


def test_resume_reads_config_toml_and_steps_is_the_new_total(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "3") == 0
    assert 'steps = 3' in (out / "config.toml").read_text()
    assert train(out, "--resume", "--lr", "1e-3") == 2  # what the run computes may not change
    assert "--lr" in one_line(capsys)
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "2"]) == 2
    assert "--steps" in one_line(capsys)
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "6"]) == 0
    got = rows(out)
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    horizon6 = LrSchedule("cosine", 3e-3, warmup_steps=2, total_steps=6)
    assert [r["lr"] for r in got[3:]] == [horizon6.lr(i) for i in (3, 4, 5)]
    assert "steps = 6" in (out / "config.toml").read_text()
    assert "horizon is now 6 steps" in capsys.readouterr().out


def test_a_torn_metrics_line_is_dropped_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out, "--steps", "4", "--checkpoint-every", "2") == 0
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "loss": 6.1, "l')  # a crash mid-write
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "6"]) == 0
    assert [r["step"] for r in rows(out)] == [1, 2, 3, 4, 5, 6]
    lines = (out / "metrics.jsonl").read_text().splitlines()
    (out / "metrics.jsonl").write_text("\n".join([lines[0], "{oops", *lines[1:]]) + "\n")
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "7"]) == 2
    assert "metrics.jsonl:2" in one_line(capsys)


def test_resume_on_other_data_of_the_same_shape_is_refused(tmp_path, capsys, monkeypatch):
    data = tmp_path / "data.npy"
    rng = np.random.default_rng(0)
    np.save(data, rng.integers(0, 512, (32, 64)))
    out = tmp_path / "run"
    assert train(out, "--data", str(data), "--steps", "2") == 0
    hashed = []
    real = trainer.data_fingerprint.__globals__["_hash_files"]
    monkeypatch.setitem(trainer.data_fingerprint.__globals__, "_hash_files",
                        lambda p: hashed.append(p) or real(p))
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "3"]) == 0
    assert hashed == []  # the cached fingerprint: (path, size, mtime) unchanged
    np.save(data, rng.integers(0, 512, (32, 64)))  # same shape, other tokens
    capsys.readouterr()
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", "4"]) == 2
    err = one_line(capsys)
    assert "data_fingerprint" in err and "other contents" in err and "data.npy" in err


# ---- non-finite values ------------------------------------------------------------------------


def test_nan_stops_with_one_line_and_keeps_the_last_finite_checkpoint(tmp_path, capsys):
    """--lr 1e6: the gradient norm turns NaN at step 3; the run stops there (exit 1), the
    checkpoints of steps 1 and 2 stay (keep 2, one per step), nothing is exported."""
    out = tmp_path / "run"
    assert train(out, "--lr", "1e6", "--steps", "8", "--checkpoint-every", "1") == 1
    err = one_line(capsys)
    assert err.startswith("slidedp train: error: step 3: the gradient norm is nan")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == \
        ["step-00000001", "step-00000002"]
    state = checkpoint_state(out / "checkpoints" / "step-00000002")
    assert all(torch.isfinite(t).all() for t in state.values())
    assert not (out / "final").exists()
    assert [r["step"] for r in rows(out)] == [1, 2, 3]


def test_skip_nonfinite_skips_the_update_and_leaves_the_state_untouched(tmp_path, capsys,
                                                                        monkeypatch):
    """A NaN injected into the loss's gradient at steps 3 and 5: with --skip-nonfinite 1 step 3's
    update is skipped (its checkpoint equals step 2's: weights, Adam moments, update counts) and
    step 5 stops the run; the same run with --skip-nonfinite 2 ends normally."""
    real, calls = fused_kernels.linear_cross_entropy, []  # HEAD_LOSS's loss on the eager kernels

    def nan_at_3_and_5(*a, **k):
        loss, grad = real(*a, **k)
        calls.append(1)
        if (len(calls) - 1) // 2 + 1 in (3, 5):  # two micro-batches per step
            return loss * math.nan, grad * math.nan
        return loss, grad

    monkeypatch.setattr(fused_kernels, "linear_cross_entropy", nan_at_3_and_5)
    out = tmp_path / "one"
    args = ["--steps", "6", "--checkpoint-every", "1", "--keep-checkpoints", "9"]
    assert train(out, *args, "--skip-nonfinite", "1") == 1
    assert "step 5: the loss is nan and the gradient norm is nan (1 such steps skipped" \
        in one_line(capsys)
    ckpts = out / "checkpoints"
    s2, s3 = (checkpoint_state(ckpts / f"step-0000000{k}") for k in (2, 3))
    assert s2.keys() == s3.keys() and all(torch.equal(s2[k], s3[k]) for k in s2)
    meta2, meta3 = (json.loads((ckpts / f"step-0000000{k}" / "meta.json").read_text())
                    for k in (2, 3))
    assert meta3["unit_steps"] == meta2["unit_steps"] and meta3["nonfinite_skipped"] == 1
    assert not (s2.keys() and all(torch.equal(s2[k], checkpoint_state(ckpts / "step-00000004")[k])
                                  for k in s2))  # step 4 trained again
    assert [r.get("skipped", False) for r in rows(out)] == [False, False, True, False, False]
    calls.clear()
    assert train(tmp_path / "two", *args, "--skip-nonfinite", "2") == 0


# ---- SIGINT and SIGTERM -----------------------------------------------------------------------


def test_a_signal_saves_at_the_step_boundary_and_the_readme_resume_line_goes_on(
        tmp_path, capsys, monkeypatch):
    """SIGINT after step 3: a checkpoint of step 3, "stopped at step 3; resume with: ...", exit
    130; then `slidedp train --out DIR --resume` as the README writes it trains steps 4-6 to the
    same final weights as an uninterrupted run, bit for bit. SIGTERM exits 143, with
    --no-save-on-stop nothing is saved, and a second signal stops at once."""
    assert train(tmp_path / "whole", "--steps", "6") == 0
    real = trainer.metrics_row
    plan = {}

    def signal_at(step, *a, **k):
        for sig in plan.get(step, ()):
            os.kill(os.getpid(), sig)
        return real(step, *a, **k)

    monkeypatch.setattr(trainer, "metrics_row", signal_at)
    out = tmp_path / "run"
    plan[3] = [signal.SIGINT]
    capsys.readouterr()
    assert train(out, "--steps", "6") == 130
    printed = capsys.readouterr()
    assert printed.out.strip().endswith(f"stopped at step 3; resume with: slidedp train --out "
                                        f"{out} --resume")
    assert "Traceback" not in printed.err
    assert latest_checkpoint(out / "checkpoints").name == "step-00000003"
    plan.clear()
    assert cli.main(["train", "--out", str(out), "--resume"]) == 0
    assert [r["step"] for r in rows(out)] == list(range(1, 7))
    a, b = final_tensors(tmp_path / "whole"), final_tensors(out)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    plan[2] = [signal.SIGTERM]
    assert train(tmp_path / "term", "--steps", "6", "--no-save-on-stop") == 143
    assert "stopped at step 2, not saved" in capsys.readouterr().out
    assert not (tmp_path / "term" / "checkpoints").exists()
    plan[2] = [signal.SIGINT, signal.SIGINT]
    assert train(tmp_path / "twice", "--steps", "6") == 130
    assert "by a second SIGINT, unsaved" in capsys.readouterr().out
    assert not (tmp_path / "twice" / "final").exists()


def test_ctrl_c_of_the_real_process_saves_without_tracebacks(tmp_path, capsys):
    """The real `slidedp train` process: while it trains, a second run on its --out (same
    options, --resume) is refused; SIGINT then saves, prints the resume line, exits 130, with no
    traceback; the run resumes to a longer total with one metrics row per step."""
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "slidedp.cli", "train", "--out", str(out),
                             *FAST, "--steps", "100000"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = out / "metrics.jsonl", time.monotonic() + 120
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        assert train(out, "--steps", "100000", "--resume") == 2
        assert f"pid {proc.pid}" in one_line(capsys)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, stderr[-2000:]
    assert "Traceback" not in stderr
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("stopped at step ") and last.endswith(f"--out {out} --resume")
    n = int(last.split()[3].rstrip(";"))
    assert latest_checkpoint(out / "checkpoints").name == f"step-{n:08d}"
    assert cli.main(["train", "--out", str(out), "--resume", "--steps", str(n + 2)]) == 0
    assert [r["step"] for r in rows(out)] == list(range(1, n + 3))
