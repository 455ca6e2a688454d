"""The real `slidedp train` process: the demo defaults train the tiny model with a falling loss,
write metrics.jsonl with every key, a Chrome trace, checkpoints, and an export that
from_pretrained loads and that gives the logits of the final host state."""

import json
import subprocess
import sys

import torch
from transformers import AutoModelForCausalLM

from slidedp.exec.checkpoint import latest_checkpoint, load_checkpoint
from slidedp.exec.io import open_model_source
from slidedp.exec.layout import model_layout

KEYS = {"step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "step_time_s", "channel_s",
        "gpu_peak_bytes", "host_pss_bytes"}
STEPS = 40


def test_demo_trains_logs_traces_and_exports(tmp_path):
    out = tmp_path / "demo"
    trace = tmp_path / "trace.json"
    p = subprocess.run([sys.executable, "-m", "slidedp.cli", "train", "--out", str(out),
                        "--steps", str(STEPS), "--device", "cpu", "--trace", str(trace)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert 'model = "tiny-qwen3"' in p.stdout and "steps = 40" in p.stdout  # resolved config

    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert all(r.keys() >= KEYS for r in rows)
    assert {"UPLOAD", "COMPUTE", "DOWNLOAD", "UPDATE"} <= rows[-1]["channel_s"].keys()
    assert rows[-1]["host_pss_bytes"] > 0 and rows[-1]["gpu_peak_bytes"] is None
    first, last = rows[0]["loss"], sum(r["loss"] for r in rows[-5:]) / 5
    assert first > 6.0 and last < first - 1.5, (first, last)
    assert rows[0]["lr"] < rows[9]["lr"] and rows[-1]["lr"] < rows[10]["lr"]  # warmup, cosine

    events = json.loads(trace.read_text())["traceEvents"]
    assert any("ADAM" in str(e.get("name")) for e in events)

    # the export loads and computes the logits of the final host state (the last checkpoint)
    src = open_model_source("tiny-qwen3")
    meta, reader = load_checkpoint(latest_checkpoint(out / "checkpoints"), src.fingerprint())
    assert meta["step"] == STEPS
    ref = AutoModelForCausalLM.from_config(src.config)
    sd = ref.state_dict()
    for lay in model_layout(ref):
        master = torch.empty(lay.numel)
        reader.read_unit(lay.unit, master, torch.empty(lay.numel), torch.empty(lay.numel))
        for e in lay.entries:
            sd[e.name].copy_(master[e.offset:e.offset + e.numel].view(e.shape))
    loaded = AutoModelForCausalLM.from_pretrained(out / "final")
    assert loaded.dtype == torch.float32  # cpu run: float32 export
    ids = torch.randint(0, 512, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, ref(ids).logits)


def test_bad_input_from_the_real_process_is_one_line_exit_2(tmp_path):
    p = subprocess.run([sys.executable, "-m", "slidedp.cli", "train", "--out", str(tmp_path / "o"),
                        "--model", str(tmp_path / "missing")], capture_output=True, text=True)
    assert p.returncode == 2
    assert p.stderr.count("\n") == 1 and str(tmp_path / "missing") in p.stderr
