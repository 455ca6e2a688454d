"""Correctness by method.md section 10: the loss of N training steps (200 there) of the streaming
executor against a GPU-resident reference, both in BF16 compute, same initial weights, same batches.

The reference is the same mixed precision with every tensor resident on the device: an FP32 master
of every parameter, a BF16 copy of the model the forward and backward run on (whole-layer gradient
checkpointing, SDPA, transformers' own loss), its BF16 gradients widened to FP32, and
torch.optim.AdamW on the masters (fused where the device has it). Ours: slidedp.exec.Engine with
the plan's defaults (FP32 master and Adam state in host memory, BF16 layers streamed through the
window, chunked loss, CPU AdamW). The data: `batches` distinct global batches of random tokens
(seeded), cycled, so the loss falls as the model memorizes them. Prints and writes (JSON) both
loss curves, the maximum and the mean absolute difference, and the last losses; the published
figure for its design is a maximum of 5.2e-4 to 6.3e-4 over 200 steps in BF16.

usage: PYTHONPATH=$PWD python3 benchmarks/loss_vs_resident.py OUT.json [--model qwen3-0.6b]
         [--steps 200] [--seq 1024] [--micro-batch 2] [--accum 2] [--batches 8] [--lr 1e-5]
         [--device cuda] [--window-slots 3]
On the CPU (--device cpu) it runs in float32 as a smoke test of the script (tiny-qwen3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from datetime import date

import torch
from transformers import AutoModelForCausalLM

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.engine import Engine
from slidedp.exec.host_state import HostState
from slidedp.exec.io import hf_config
from slidedp.exec.layout import model_layout
from slidedp.spec.model import load_model
from slidedp.spec.plan import Plan
from slidedp.spec.workload import Workload


def initial_model(config: dict, seed: int):
    """transformers' from_config weights under torch.manual_seed(seed), FP32 on the CPU."""
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(hf_config(dict(config)))


def resident_losses(model, data: list[torch.Tensor], accum: int, opt: AdamWConfig, device: str,
                    dtype: torch.dtype) -> list[float]:
    """Losses of the resident mixed-precision reference (module docstring) on `data`."""
    master = [p.detach().to(device, torch.float32).clone().requires_grad_() for p in model.parameters()]
    work = model.to(device, dtype)
    work.config.use_cache = False
    work.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    params = list(work.parameters())
    fused = {"fused": True} if device == "cuda" else {}
    adamw = torch.optim.AdamW(master, lr=opt.lr, betas=opt.betas, eps=opt.eps,
                              weight_decay=opt.weight_decay, **fused)
    losses = []
    for ids in data:
        with torch.no_grad():
            for p, m in zip(params, master, strict=True):
                p.copy_(m)
        ids = ids.to(device)
        mb = ids.shape[0] // accum
        # the global batch's mean over tokens: every micro-batch has the same token count
        total = 0.0
        for chunk in ids.split(mb):
            loss = work(input_ids=chunk, labels=chunk).loss / accum
            loss.backward()
            total += float(loss.detach())
        for p, m in zip(params, master, strict=True):
            m.grad = p.grad.float()
            p.grad = None
        adamw.step()
        adamw.zero_grad()
        losses.append(total)
    return losses


def streamed_losses(model, spec, data: list[torch.Tensor], wl: Workload, plan: Plan,
                    opt: AdamWConfig, device: str, dtype: torch.dtype) -> list[float]:
    """Losses of slidedp's executor, starting from the same weights."""
    state = HostState.create([u.numel for u in model_layout(model)], None)
    state.init_from_model(model)
    try:
        with Engine(dict(spec.config), wl, plan, device=device, dtype=dtype, optimizer=opt,
                    host_state=state) as eng:
            return [eng.step(ids).loss for ids in data]
    finally:
        state.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--batches", type=int, default=8, help="distinct global batches, cycled")
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--window-slots", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    dtype = torch.bfloat16 if a.device == "cuda" else torch.float32
    spec = load_model(a.model)
    gb = a.micro_batch * a.accum
    wl = Workload(spec, a.seq, gb, a.micro_batch, 1)
    opt = AdamWConfig(lr=a.lr, betas=(0.9, 0.95), weight_decay=0.01)
    gen = torch.Generator().manual_seed(a.seed)
    distinct = [torch.randint(0, spec.vocab_size, (gb, a.seq), generator=gen) for _ in range(a.batches)]
    data = [distinct[i % a.batches] for i in range(a.steps)]
    t0 = time.perf_counter()
    ours = streamed_losses(initial_model(spec.config, a.seed), spec, data, wl,
                           Plan(window_slots=a.window_slots), opt, a.device, dtype)
    t1 = time.perf_counter()
    ref = resident_losses(initial_model(spec.config, a.seed), data, a.accum, opt, a.device, dtype)
    t2 = time.perf_counter()
    diff = [abs(x - y) for x, y in zip(ours, ref, strict=True)]
    out = {"date": str(date.today()), "command": " ".join(sys.argv), "torch": torch.__version__,
           "device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu",
           "dtype": str(dtype), "model": a.model, "seq": a.seq, "global_batch": gb,
           "micro_batch": a.micro_batch, "steps": a.steps, "batches": a.batches, "lr": a.lr,
           "max_abs_diff": max(diff), "mean_abs_diff": sum(diff) / len(diff),
           "step_of_max": diff.index(max(diff)), "ours": ours, "reference": ref,
           "ours_s": t1 - t0, "reference_s": t2 - t1}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"{a.model} {dtype} {a.steps} steps: loss {ours[0]:.4f} -> {ours[-1]:.4f} (ours), "
          f"{ref[0]:.4f} -> {ref[-1]:.4f} (resident); max |diff| {max(diff):.3g} at step "
          f"{out['step_of_max']}, mean {out['mean_abs_diff']:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
