"""Compute-only reference for the single-GPU benchmark: the same model with every parameter
resident on the GPU (BF16), whole-layer gradient checkpointing (non-reentrant), SDPA, forward +
backward per step and no host work at all (no optimizer step, no transfers).

This is the ceiling a host-streaming step chases: ratio = reference step time / our step time.
"""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def reference_step_s(config: dict, micro_batch: int, seq: int, accum: int = 1, iters: int = 15,
                     discard: int = 8, seed: int = 0) -> dict:
    """Median-free mean step time over iterations [discard, iters) (method.md section 10)."""
    cfg = AutoConfig.for_model(**config)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    torch.manual_seed(seed)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    data = torch.randint(0, cfg.vocab_size, (micro_batch, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(accum):
            loss = model(input_ids=data, labels=data).loss
            loss.backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    steady = times[discard:]
    out = {"step_s": sum(steady) / len(steady), "all_steps_s": [round(x, 4) for x in times],
           "gpu_peak_bytes": torch.cuda.max_memory_reserved()}
    del model
    torch.cuda.empty_cache()
    return out
