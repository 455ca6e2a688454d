"""`slidedp train --nproc 2 --device cpu`: the real CLI runs two rank processes (torchrun, gloo)
that train like one process with the same global batch, resume from their own checkpoint, and
stop with the failing rank named; a global batch the ranks cannot split is refused before any
rank starts.

Adam's eps is 1e-6 here (not the CLI's 1e-8): with 1e-8 an element whose gradient is ~1e-8
turns FP32 summation-order noise into a sign-flipped update (see test_dist_engine.py).
"""

import json
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from slidedp import cli
from slidedp.exec.checkpoint import latest_checkpoint

# one xdist worker runs the torchrun jobs of the dist modules one at a time (addopts: --dist
# loadgroup): two at once on the 2-core CI machine stretch their timing-bound checks
pytestmark = pytest.mark.xdist_group("dist")

# 6 steps of the tiny preset; 2 ranks x micro-batch 2 x accumulation 2 = global batch 8
RUN = ["--steps", "6", "--global-batch", "8", "--micro-batch", "2", "--warmup-steps", "2",
       "--device", "cpu", "--checkpoint-every", "2", "--eps", "1e-6"]
TIMED = {"tokens_per_s", "step_time_s", "channel_s", "gpu_peak_bytes", "host_pss_bytes"}


def train_cli(out, *extra):
    return subprocess.run([sys.executable, "-m", "slidedp.cli", "train", "--out", str(out), *RUN,
                           *extra], capture_output=True, text=True, timeout=240)


def rows(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def stable(row):
    """A metrics row without its timings and memory (they differ between runs)."""
    return {k: v for k, v in row.items() if k not in TIMED}


def final_tensors(out):
    return load_file(str(out / "final" / "model.safetensors"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(2-rank run, 1-process run) of the same options."""
    tmp = tmp_path_factory.mktemp("train_dist")
    p = train_cli(tmp / "dp", "--nproc", "2")
    assert p.returncode == 0, p.stderr[-3000:]
    assert p.stdout.count("# resolved configuration") == 1 and "nproc = 2" in p.stdout
    assert cli.main(["train", "--out", str(tmp / "one"), *RUN]) == 0
    return tmp / "dp", tmp / "one"


def test_two_ranks_train_log_and_export(runs):
    dp, _ = runs
    got = rows(dp)
    assert [r["step"] for r in got] == list(range(1, 7))  # written once, by local rank 0
    assert got[-1]["loss"] < got[0]["loss"] - 0.1
    assert latest_checkpoint(dp / "checkpoints").name == "step-00000006"
    model = AutoModelForCausalLM.from_pretrained(dp / "final")
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()


def test_two_ranks_equal_one_process_with_the_same_global_batch(runs):
    dp, one = runs
    for a, b in zip(rows(dp), rows(one), strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-5, (a["step"], a["loss"], b["loss"])
        assert a["lr"] == b["lr"] and a["tokens"] == b["tokens"]
    ta, tb = final_tensors(dp), final_tensors(one)
    for k in ta:
        assert torch.allclose(ta[k], tb[k], rtol=0, atol=1e-5), k


def test_two_ranks_resume_from_their_checkpoint(runs, tmp_path):
    """A copy of the 2-rank run cut back to its step-4 checkpoint resumes to the same end."""
    dp, _ = runs
    cut = tmp_path / "cut"
    shutil.copytree(dp, cut)
    shutil.rmtree(cut / "checkpoints" / "step-00000006")
    shutil.rmtree(cut / "final")
    p = train_cli(cut, "--nproc", "2", "--resume")
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resuming after step 4" in p.stdout
    assert [stable(r) for r in rows(cut)] == [stable(r) for r in rows(dp)]
    ta, tb = final_tensors(dp), final_tensors(cut)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_global_batch_the_ranks_cannot_split_is_one_line_exit_2(tmp_path, capsys):
    # 12 = 4 x 3 runs in one process; 2 ranks x micro-batch 4 need a multiple of 8
    rc = cli.main(["train", "--out", str(tmp_path / "o"), "--device", "cpu", "--nproc", "2",
                   "--global-batch", "12", "--micro-batch", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert "global_batch" in err and "nproc = 4 x 2 = 8, got 12" in err
    assert not (tmp_path / "o").exists()


def test_a_failing_rank_stops_the_job_naming_rank_and_cause(tmp_path):
    """Bad token ids found by the ranks (not by the launcher): nonzero exit, the cause named."""
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full((16, 64), 600))
    p = train_cli(tmp_path / "o", "--nproc", "2", "--data", str(bad))
    assert p.returncode != 0
    assert re.search(r"slidedp rank \d: failed: SpecError: .*bad\.npy.*token ids", p.stderr), \
        p.stderr[-3000:]
    assert not (tmp_path / "o" / "final").exists()


def test_a_killed_launcher_stops_its_ranks(tmp_path):
    """SIGTERM to `slidedp train --nproc 2` (a user's kill, a preemption) reaches the ranks
    through torchrun: they stop, one named as terminated, none left training as an orphan."""
    import signal
    import time

    out = tmp_path / "sig"
    args = [a if a != "6" else "100000" for a in RUN]  # train on until stopped
    proc = subprocess.Popen([sys.executable, "-m", "slidedp.cli", "train", "--out", str(out),
                             *args, "--nproc", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        metrics = out / "metrics.jsonl"
        deadline = time.monotonic() + 180
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.2)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=90)
        assert proc.returncode != 0 and time.monotonic() - t0 < 60
        assert re.search(r"slidedp rank \d: failed: terminated by SIGTERM", err), err[-3000:]
        left = subprocess.run(["pgrep", "-f", str(out)], capture_output=True, text=True).stdout
        assert not left.split(), f"rank processes left running: {left}"
    finally:  # whatever failed above, no orphan keeps training
        proc.kill()
        subprocess.run(["pkill", "-KILL", "-f", str(out)])
