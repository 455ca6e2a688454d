"""`slidedp train` in-process: exact resume, a crash mid-save, the lr schedule, and bad input
(exit 2, one line naming the option or file). The real-subprocess runs are in test_train_cli.py.
"""

import json
import math

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp import cli
from slidedp.exec import checkpoint
from slidedp.exec.checkpoint import latest_checkpoint
from slidedp.exec.schedule import LrSchedule
from slidedp.spec.errors import SpecError

# 6 steps of the tiny preset, 2 micro-batches per step, cosine with warmup: a few seconds
FAST = ["--steps", "6", "--global-batch", "8", "--micro-batch", "4", "--warmup-steps", "2",
        "--device", "cpu", "--checkpoint-every", "2"]


def train(out, *extra):
    return cli.main(["train", "--out", str(out), *FAST, *extra])


def losses(out):
    return [json.loads(ln)["loss"] for ln in (out / "metrics.jsonl").read_text().splitlines()]


def final_tensors(out):
    return load_file(str(out / "final" / "model.safetensors"))


def test_crash_mid_save_then_resume_is_bit_exact(tmp_path, monkeypatch):
    """A save that fails after writing every unit leaves step 2 intact; resuming from it gives
    the same losses and the same final parameters as an uninterrupted run, bit for bit."""
    assert train(tmp_path / "a") == 0
    real, calls = checkpoint.capture_rng, []

    def crash_on_second_save():
        calls.append(1)
        if len(calls) == 2:  # inside the step-4 save: unit files written, meta.json not yet
            raise RuntimeError("injected crash mid-save")
        return real()

    monkeypatch.setattr(checkpoint, "capture_rng", crash_on_second_save)
    with pytest.raises(RuntimeError, match="injected"):
        train(tmp_path / "b")
    monkeypatch.setattr(checkpoint, "capture_rng", real)
    b = tmp_path / "b"
    assert latest_checkpoint(b / "checkpoints").name == "step-00000002"
    assert not list((b / "checkpoints").glob(".*"))  # the half-written temp dir is gone
    assert len(losses(b)) == 4  # the interrupted run logged steps 1..4
    assert train(b, "--resume") == 0
    assert losses(b) == losses(tmp_path / "a")
    ta, tb = final_tensors(tmp_path / "a"), final_tensors(b)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)
    assert latest_checkpoint(b / "checkpoints").name == "step-00000006"


def test_resume_extends_a_finished_run_and_refuses_a_fresh_start_over_it(tmp_path, capsys):
    out = tmp_path / "run"
    assert train(out) == 0
    assert train(out) == 2  # not --resume: an earlier run is there
    assert "--resume" in capsys.readouterr().err
    assert train(out, "--resume", "steps=8") == 0
    rows = (out / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in rows] == list(range(1, 9))


def test_resume_from_another_models_checkpoint_is_refused(tmp_path, capsys):
    """Another --model on --resume is refused against config.toml; without config.toml (a run
    directory copied without it), by the checkpoint's model fingerprint."""
    out = tmp_path / "run"
    assert train(out) == 0
    capsys.readouterr()
    assert train(out, "--resume", "--model", "qwen3-0.6b") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--model" in err and "'tiny-qwen3'" in err and "config.toml" in err
    (out / "config.toml").unlink()
    assert train(out, "--resume", "--model", "qwen3-0.6b") == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "meta.json" in err and "fingerprint" in err and "another model" in err


def test_cosine_and_constant_schedules():
    cos = LrSchedule("cosine", 1.0, warmup_steps=4, total_steps=14)
    assert [cos.lr(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert cos.lr(4) == 1.0 and cos.lr(9) == pytest.approx(0.5)
    assert cos.lr(13) == pytest.approx((1 + math.cos(math.pi * 0.9)) / 2)  # last step: > 0
    const = LrSchedule("constant", 2.0, warmup_steps=0, total_steps=5)
    assert [const.lr(i) for i in range(5)] == [2.0] * 5
    with pytest.raises(SpecError):
        LrSchedule("linear", 1.0, 0, 5)


def _moe_dir(tmp_path):
    """A real qwen3_moe directory: the specs read it, the executor does not run MoE."""
    cfg = AutoConfig.for_model(model_type="qwen3_moe", hidden_size=32, intermediate_size=64,
                               moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                               head_dim=16, vocab_size=512)
    d = tmp_path / "moe"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    return d


def _npy(tmp_path, name, arr):
    p = tmp_path / name
    np.save(p, arr)
    return str(p)


def _bad_cases(tmp_path):
    """(extra options, what the one-line message must contain)."""
    toml = tmp_path / "run.toml"
    toml.write_text("steps = 3\nbatch = 4\n")
    return [
        (["--model", str(tmp_path / "nope")], [str(tmp_path / "nope"), "does not exist"]),
        (["--model", str(_moe_dir(tmp_path))], ["moe", "model_type", "qwen3_moe"]),
        (["--data", _npy(tmp_path, "flat.npy", np.zeros(640, np.int64))], ["flat.npy", "shape"]),
        (["--data", _npy(tmp_path, "f.npy", np.zeros((16, 64), np.float32))], ["f.npy", "dtype"]),
        (["--data", _npy(tmp_path, "big.npy", np.full((16, 64), 600))], ["big.npy", "token ids"]),
        (["--data", _npy(tmp_path, "short.npy", np.zeros((16, 32), np.int32))], ["seq_len"]),
        (["--model", "qwen2.5-72b", "--hardware", "h200x1"],
         ["infeasible plan: host memory", "largest term: state"]),
        (["--model", "qwen3-0.6b", "--seq", "8192", "--micro-batch", "64", "--global-batch",
          "64"], ["infeasible plan: GPU memory", "cpu"]),
        (["--config", str(toml)], ["run.toml", "batch"]),
        (["steps=many"], ["override steps=many", "integer"]),
        (["--global-batch", "6"], ["global_batch", "multiple of"]),
        (["--window-slots", "1"], ["--window-slots"]),
    ]


def test_bad_input_is_one_line_naming_what_and_where(tmp_path, capsys):
    cases = _bad_cases(tmp_path)
    capsys.readouterr()  # save_pretrained's progress bar
    for i, (extra, needles) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc = cli.main(["train", "--out", str(out), "--device", "cpu", *extra])
        err = capsys.readouterr().err.strip()
        assert rc == 2, (extra, err)
        assert len(err.splitlines()) == 1, err
        assert all(n in err for n in needles), (needles, err)
        assert not (out / "final").exists()
    assert cli.main(["train", "--device", "cpu"]) == 2
    assert "--out" in capsys.readouterr().err


def test_grad_clip_trains_with_a_deferred_update(tmp_path):
    """--grad-clip runs (the plan defers the update) and changes the trajectory when it bites."""
    assert train(tmp_path / "plain") == 0
    assert train(tmp_path / "clip", "--grad-clip", "0.05") == 0
    rows = [json.loads(ln) for ln in (tmp_path / "clip" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["grad_norm"] > 0.05 for r in rows)  # the clip bites every step
    assert losses(tmp_path / "clip")[0] == losses(tmp_path / "plain")[0]
    assert losses(tmp_path / "clip")[-1] != losses(tmp_path / "plain")[-1]
