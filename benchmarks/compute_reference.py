"""Compute-only reference for the single-GPU benchmark: the same model with every parameter
resident on the GPU (BF16), whole-layer gradient checkpointing (non-reentrant), SDPA, forward +
backward per step and no host work at all (no optimizer step, no transfers).

This is the ceiling a host-streaming step chases: ratio = reference step time / our step time.
`kernels` = "liger" first patches transformers' classes of the model's family with liger-kernel
(`use_kernels`: RoPE, RMSNorm, SwiGLU and the fused linear + cross-entropy of the causal-LM
forward, the kernels slidedp's liger plan runs): process-wide, so a liger reference runs in a
process of its own (benchmarks/peers.py runs every row so).
"""

from __future__ import annotations

import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM


def use_kernels(model_type: str, kernels: str) -> None:
    """Patch transformers' `model_type` classes with liger-kernel for "liger" (before a model is
    built; module docstring); nothing for "eager"."""
    if kernels == "eager":
        return
    if kernels != "liger":
        raise ValueError(f"kernels: eager or liger, got {kernels!r}")
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    MODEL_TYPE_TO_APPLY_LIGER_FN[model_type](rope=True, rms_norm=True, swiglu=True,
                                             cross_entropy=False, fused_linear_cross_entropy=True)


def reference_step_s(config: dict, micro_batch: int, seq: int, accum: int = 1, iters: int = 15,
                     discard: int = 8, seed: int = 0, kernels: str = "eager") -> dict:
    """Median-free mean step time over iterations [discard, iters) (method.md section 10)."""
    use_kernels(config["model_type"], kernels)
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
