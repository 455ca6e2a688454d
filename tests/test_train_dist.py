"""`slidedp train --nproc 2 --device cpu`: the real CLI runs two rank processes (torchrun, gloo)
that train like one process with the same global batch, resume from their own checkpoint, and
stop with the failing rank named; a global batch the ranks cannot split is refused before any
rank starts. Faults of the real launcher: SIGTERM saves and stops every rank at one step
boundary, a killed torchrun or a rank killed while the model loads leaves no process and no
shared memory, and non-finite steps are skipped alike by both ranks.

Adam's eps is 1e-6 here (not the CLI's 1e-8): with 1e-8 an element whose gradient is ~1e-8
turns FP32 summation-order noise into a sign-flipped update (see test_dist_engine.py).
"""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

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
    """Bad token ids found by the ranks (not by the launcher): the launcher's last line names the
    rank and the cause, exit 2 (bad input)."""
    bad = tmp_path / "bad.npy"
    np.save(bad, np.full((16, 64), 600))
    p = train_cli(tmp_path / "o", "--nproc", "2", "--data", str(bad))
    assert p.returncode == 2, p.stderr[-3000:]
    assert re.search(r"slidedp rank \d: failed: SpecError: .*bad\.npy.*token ids", p.stderr), \
        p.stderr[-3000:]
    assert re.search(r"slidedp train: error: rank \d failed: SpecError: .*bad\.npy.*token ids",
                     p.stderr.strip().splitlines()[-1])
    assert not (tmp_path / "o" / "final").exists()


# ---- faults of the real launcher: signals, a killed torchrun, a rank killed while loading -----


def _launch_cli(out, *extra, env=None):
    return subprocess.Popen([sys.executable, "-m", "slidedp.cli", "train", "--out", str(out),
                             *RUN, *extra, "--nproc", "2"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _children(pid):
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _ranks(launcher):
    """{rank: pid} of the rank processes under `launcher` (its torchrun's children)."""
    ranks = {}
    for torchrun in _children(launcher.pid):
        for pid in _children(torchrun):
            environ = Path(f"/proc/{pid}/environ").read_text().split("\0")
            env = dict(kv.split("=", 1) for kv in environ if "=" in kv)
            ranks[int(env["RANK"])] = pid
    return ranks


def _alive(pid):
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


def _wait_for(cond, what, proc, timeout_s=180):
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert proc.poll() is None, f"the run ended before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} after {timeout_s} s"
        time.sleep(0.1)


def _segments(pid):
    """Shared-memory files of a job whose rank 0 has `pid` (host_state.segment_name)."""
    return list(Path("/dev/shm").glob(f"slidedp-{pid}-*"))


def _training(out):
    metrics = out / "metrics.jsonl"
    return lambda: metrics.is_file() and metrics.read_text().count("\n") >= 2


def test_sigterm_to_the_launcher_saves_at_the_step_boundary_and_stops(tmp_path, capsys):
    """SIGTERM to `slidedp train --nproc 2` (a user's kill, a preemption): every rank stops at
    the same step boundary after rank 0 saved it; the launcher prints "stopped at step N; resume
    with: ...", exits 143, no traceback, no process left. While it trained, a second run on its
    --out was refused; afterwards the run resumes, here in one process, with one row per step."""
    out = tmp_path / "sig"
    proc = _launch_cli(out, "steps=100000")
    try:
        _wait_for(_training(out), "training", proc)
        assert cli.main(["train", "--out", str(out), *RUN, "--nproc", "2", "--resume"]) == 2
        assert f"pid {proc.pid}" in capsys.readouterr().err
        ranks = _ranks(proc)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr
    last = stdout.strip().splitlines()[-1]
    assert re.fullmatch(rf"stopped at step (\d+); resume with: slidedp train --out {out} --resume",
                        last), last
    n = int(last.split()[3].rstrip(";"))
    assert latest_checkpoint(out / "checkpoints").name == f"step-{n:08d}"
    assert not any(_alive(p) for p in ranks.values())
    assert cli.main(["train", "--out", str(out), "--resume", "--nproc", "1",
                     "--steps", str(n + 1)]) == 0
    assert [r["step"] for r in rows(out)] == list(range(1, n + 2))


def test_killed_torchrun_stops_its_ranks_within_seconds(tmp_path):
    """kill -9 of torchrun (an OOM kill): its ranks notice their launcher is gone and stop within
    10 s, writing nothing more; the launcher says so in its last line and exits non-zero."""
    out = tmp_path / "run"
    proc = _launch_cli(out, "steps=100000")
    try:
        _wait_for(_training(out), "training", proc)
        ranks = _ranks(proc)
        os.kill(_children(proc.pid)[0], signal.SIGKILL)
        t0 = time.monotonic()
        while any(_alive(p) for p in ranks.values()) and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        stop_s = time.monotonic() - t0
        _, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert stop_s < 10, f"ranks still running {stop_s:.0f} s after torchrun's death"
    assert proc.returncode == 1
    assert "torchrun" in stderr.strip().splitlines()[-1] and "SIGKILL" in stderr
    written = (out / "metrics.jsonl").read_text()
    time.sleep(1)
    assert (out / "metrics.jsonl").read_text() == written
    assert not _segments(ranks[0])


@pytest.mark.parametrize("victim", [1, 0])
def test_a_rank_killed_while_the_model_loads_leaves_no_shared_memory(victim, tmp_path):
    """Rank 0 pauses while it fills the host state (the test hook SLIDEDP_PAUSE_AT), its files in
    /dev/shm; rank `victim` is killed there with SIGKILL. The job stops, nothing of it is left in
    /dev/shm, torchrun's root cause is the killed rank (not a survivor), and the launcher's last
    line names it."""
    out, paused = tmp_path / "run", tmp_path / "paused"
    paused.mkdir()
    proc = _launch_cli(out, env=os.environ | {"SLIDEDP_PAUSE_AT": f"load:{paused}"})
    try:
        _wait_for(lambda: any(paused.iterdir()), "the pause in the load", proc)
        ranks = _ranks(proc)
        assert _segments(ranks[0]), "the host state is not in /dev/shm: the test shows nothing"
        os.kill(ranks[victim], signal.SIGKILL)
        _, stderr = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode != 0
    assert not _segments(ranks[0]), "shared memory left behind"
    assert not any(_alive(p) for p in ranks.values())
    root = stderr[stderr.index("Root Cause"):]
    assert re.search(rf"rank\s*: {victim} \(local_rank: {victim}\)", root), root
    assert re.search(rf"slidedp train: error: rank {victim} failed: its process \(pid "
                     rf"{ranks[victim]}\) died", stderr.strip().splitlines()[-1]), stderr[-2000:]


def test_nonfinite_steps_are_skipped_alike_by_both_ranks_then_stop(tmp_path):
    """--lr 1e6 with 2 ranks: the gradient norm turns NaN; --skip-nonfinite 2 skips two steps
    on both ranks without touching the shared state (their checkpoints equal the one before),
    the third stops the run (exit 1, one line), the finite checkpoints kept, nothing exported."""
    out = tmp_path / "nan"
    p = train_cli(out, "--nproc", "2", "--lr", "1e6", "--skip-nonfinite", "2",
                  "--checkpoint-every", "1", "--keep-checkpoints", "9", "steps=12")
    assert p.returncode == 1, p.stderr[-3000:]
    got = rows(out)
    k = next(r["step"] for r in got if r.get("skipped"))
    assert [r.get("skipped", False) for r in got] == [False] * (k - 1) + [True, True, False]
    assert re.search(rf"slidedp train: error: step {k + 2}: .*nan.*2 such steps skipped",
                     p.stderr.strip().splitlines()[-1]), p.stderr[-2000:]
    states = [load_file_state(out / "checkpoints" / f"step-{s:08d}") for s in (k - 1, k, k + 1)]
    for st in states[1:]:
        assert st.keys() == states[0].keys() and all(torch.equal(st[n], states[0][n]) for n in st)
    assert all(torch.isfinite(t).all() for t in states[0].values())
    assert not (out / "final").exists()


def load_file_state(ckpt):
    return {f"{f.name}/{n}": t for f in sorted(ckpt.glob("unit-*.safetensors"))
            for n, t in load_file(str(f)).items()}
