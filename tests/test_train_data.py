"""`slidedp train` on data a practitioner has, against plain Hugging Face references.

The real process: a model id resolved from a local hub cache (offline), a chat-format jsonl with
--chat (loss on assistant tokens only), an eval set, TensorBoard: every step's loss and eval loss
equal HF's (from_pretrained, torch.optim.AdamW, labels from transformers' own assistant mask,
num_items_in_batch) within 1e-5 in FP32 on the CPU; final/ holds the tokenizer and the
generation config, and loads and generates. In process: --chat --pack equals the same documents
unpacked through HF; --save-dtype; bad options are one line, exit 2, before training.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from reference_docs import doc_losses, label_tokens
from tiny_hf import CHATML_TAGS, chat_jsonl, hub_cache, save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from slidedp import cli
from slidedp.exec.data import DataOptions, open_tokens

SEQ, GB, LR = 48, 4, 1e-3
RUN = ["--seq", str(SEQ), "--global-batch", str(GB), "--micro-batch", "2", "--no-shuffle",
       "--lr", str(LR), "--lr-schedule", "constant", "--warmup-steps", "0", "--device", "cpu"]


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    return {"model": save_model(d / "model", CHATML_TAGS), "train": chat_jsonl(d / "t.jsonl", 12, 0),
            "eval": chat_jsonl(d / "e.jsonl", 5, 1), "many": chat_jsonl(d / "m.jsonl", 30, 2)}


def _hf_docs(model_dir, path):
    """(ids, labels) per conversation: labels from transformers' assistant mask."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    out = []
    for line in path.read_text().splitlines():
        enc = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True,
                                      return_dict=True, return_assistant_tokens_mask=True)
        ids = torch.tensor(enc["input_ids"])
        out.append((ids, torch.where(torch.tensor(enc["assistant_masks"]).bool(), ids, -100)))
    return out


def _rows(out):
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]


def test_chat_from_the_hub_cache_trains_like_hf_and_exports_a_complete_model(files, tmp_path):
    cache = tmp_path / "hub"
    snap = hub_cache(cache, "Org/tiny-chat", files["model"])
    out = tmp_path / "out"
    env = dict(os.environ, HF_HUB_CACHE=str(cache), HF_HUB_OFFLINE="1")
    p = subprocess.run([sys.executable, "-m", "slidedp.cli", "train", "--model", "Org/tiny-chat",
                        "--data", str(files["train"]), "--chat", "--eval-data", str(files["eval"]),
                        "--eval-every", "1", "--steps", "2", "--report-to", "tensorboard",
                        "--out", str(out), *RUN], capture_output=True, text=True, env=env)
    assert p.returncode == 0, p.stderr
    assert f'model = "{snap}"' in p.stdout  # the id, resolved in the printed configuration
    rows = _rows(out)

    docs, evals = _hf_docs(snap, files["train"]), _hf_docs(snap, files["eval"])
    steps = [docs[i * GB:(i + 1) * GB] for i in range(2)]
    assert all(label_tokens(s) < sum(len(ids) - 1 for ids, _ in s) for s in steps)  # masked
    model = AutoModelForCausalLM.from_pretrained(snap)
    unmasked = doc_losses(model, [[(ids, ids) for ids, _ in steps[0]]])[0]
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    for row, docs_of_step in zip(rows, steps, strict=True):
        loss = doc_losses(model, [docs_of_step], opt)[0]
        with torch.no_grad():
            eval_loss = doc_losses(model, [evals])[0]
        assert abs(row["loss"] - loss) <= 1e-5, (row["step"], row["loss"], loss)
        assert abs(row["eval_loss"] - eval_loss) <= 1e-5, (row["step"], row["eval_loss"], eval_loss)
    assert abs(rows[0]["loss"] - unmasked) > 1e-2  # the prompts' tokens would change it

    final = out / "final"
    tok, src = AutoTokenizer.from_pretrained(final), AutoTokenizer.from_pretrained(snap)
    msgs = json.loads(files["eval"].read_text().splitlines()[0])["messages"]
    assert tok("the cat sat")["input_ids"] == src("the cat sat")["input_ids"]
    assert tok.apply_chat_template(msgs) == src.apply_chat_template(msgs)
    assert (tok.eos_token, tok.pad_token) == ("<eos>", "<pad>")
    model = AutoModelForCausalLM.from_pretrained(final)
    assert model.generation_config.max_new_tokens == 7  # the source's generation_config.json
    ids = tok.apply_chat_template(msgs[:2], add_generation_prompt=True, return_tensors="pt",
                                  return_dict=True)["input_ids"]
    gen = model.generate(ids, max_new_tokens=3, min_new_tokens=3, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 3)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(out / "tensorboard")).Reload()
    assert [e.step for e in events.Scalars("loss")] == [1, 2]
    assert [e.value for e in events.Scalars("eval_loss")] == pytest.approx(
        [r["eval_loss"] for r in rows], rel=1e-6)


def _segments(data, rows):
    """The documents of packed rows: segments where the position ids restart, padding left out."""
    docs = []
    for r in rows:
        pos = data.position_ids[r]
        starts = [*np.flatnonzero(pos == 0), len(pos)]
        for lo, hi in zip(starts[:-1], starts[1:], strict=True):
            labels = data.labels[r, lo:hi]
            if (labels != -100).any():
                docs.append((torch.tensor(data.tokens[r, lo:hi], dtype=torch.long),
                             torch.tensor(labels, dtype=torch.long)))
    return docs


def test_packed_chat_equals_its_documents_unpacked(files, tmp_path):
    out = tmp_path / "packed"
    assert cli.main(["train", "--model", str(files["model"]), "--data", str(files["many"]),
                     "--chat", "--pack", "--steps", "2", "--save-dtype", "bfloat16",
                     "--out", str(out), *RUN]) == 0
    data = open_tokens(files["many"], SEQ, 512, files["model"], DataOptions(chat=True, pack=True))
    assert len(data) >= 2 * GB and data.documents == 30
    steps = [_segments(data, range(i * GB, (i + 1) * GB)) for i in range(2)]
    assert all(len(s) > GB for s in steps)  # rows hold several conversations
    model = AutoModelForCausalLM.from_pretrained(files["model"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=1e-8,
                            weight_decay=0.01)
    ref = doc_losses(model, steps, opt)
    got = [r["loss"] for r in _rows(out)]
    assert got == pytest.approx(ref, abs=1e-5)
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    assert final.dtype == torch.bfloat16


@pytest.mark.parametrize("extra, where", [
    (["--report-to", "trackio"], "--report-to"),
    (["--model", "Org/not-cached"], "Org/not-cached"),
    (["--data-field", "body"], "field 'body'"),
])
def test_bad_data_options_are_one_line_exit_2_before_training(files, tmp_path, capsys, extra,
                                                              where, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    if extra[0] == "--report-to" and __import__("importlib").util.find_spec("trackio"):
        pytest.skip("trackio is installed here")
    out = tmp_path / "o"
    args = ["train", "--model", str(files["model"]), "--data", str(files["train"]), "--chat",
            "--out", str(out), *RUN, *extra]
    assert cli.main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and where in err, err
    assert not (out / "metrics.jsonl").exists()


@pytest.mark.xdist_group("dist")  # with the other torchrun jobs, one at a time (test_train_dist)
def test_two_ranks_train_and_evaluate_packed_chat_like_one_process(files, tmp_path):
    opts = ["--model", str(files["model"]), "--data", str(files["many"]), "--chat", "--pack",
            "--eval-data", str(files["eval"]), "--eval-every", "1", "--steps", "2",
            "--eps", "1e-6", *RUN]
    p = subprocess.run([sys.executable, "-m", "slidedp.cli", "train", "--nproc", "2",
                        "--out", str(tmp_path / "dp"), *opts], capture_output=True, text=True,
                       timeout=240)
    assert p.returncode == 0, p.stderr[-3000:]
    assert cli.main(["train", "--out", str(tmp_path / "one"), *opts]) == 0
    two, one = _rows(tmp_path / "dp"), _rows(tmp_path / "one")
    for key in ("loss", "eval_loss"):
        assert [r[key] for r in two] == pytest.approx([r[key] for r in one], rel=1e-6, abs=1e-6)
