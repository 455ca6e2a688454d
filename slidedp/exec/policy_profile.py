"""Per-layer measurement of an activation policy by the executor's own code (method.md section 7,
stage 3, ProfileCkpt): one decoder layer of a model, one micro-batch, one policy.

`profile_layer_policy` runs the layer as the engine does (policy_runner.PolicyRunner forward,
recompute and backward, what it keeps in the activation offload's store with the plan's offload
ratio, offloaded to host and reloaded in between: features/offload.py) and reports:
    fwd_s, recompute_s, bwd_s, compute_s  median seconds over `repeats` runs after one warm-up
                                          (compute_s = their sum), the device synchronized
                                          around each phase; recompute_s = 0 for a policy that
                                          recomputes nothing
    retained_bytes        what the layer keeps from forward to backward, the input included:
                          the bytes of its kept entries (counted, on every device)
    retained_alloc_bytes  CUDA only: allocated memory held after the forward with the output
                          dropped, minus before it, plus the input (None on the CPU)
    transient_peak_bytes  CUDA only: peak allocated memory during recompute + backward above
                          what was allocated when it began (None on the CPU)
    offload_bytes         bytes ACT_OFFLOAD moves for the micro-batch (ratio r of the entries)
Parameters are random (values do not change what is kept); the layer is layer 1 of the model's
config.

Measured against the model (tests/test_exec_policy_profile.py, CPU, bf16): retained_bytes equals
policy_cost's retained bytes x tokens exactly for "layer", "sac" and every mask that does not keep
segment 3 (the model counts transformers' eager RMSNorm as the executor runs it); a kept segment 3
keeps 2 q bytes per token less (SDPA's output is already in o_proj's order: o.transpose(1, 2)
.contiguous() copies nothing), and kept segments 3 and 4 together 2 h less (policy_runner keeps
boundary 3, h1, only where a recompute starts from it, i.e. segment 4 is recomputed; otherwise no
backward reads the BF16 h1: the eager post-norm saves its FP32 copy, the residual adds nothing).
AutoPolicy's real probes (slidedp/policy/probe.py, layer_delta_s) bound a policy's measured
marginal cost by its compute_s here; benchmarks/policy_layers.py tabulates every policy.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from slidedp.exec.features.offload import OffloadedActivations
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.policy_runner import PolicyRunner, kept_layout, recomputes
from slidedp.exec.staging import PinnedPool
from slidedp.spec.errors import SpecError
from slidedp.spec.segments import LayerPolicy, parse_policy


@dataclass(frozen=True)
class PolicyProfile:
    policy: str
    tokens: int
    fwd_s: float
    recompute_s: float
    bwd_s: float
    compute_s: float
    retained_bytes: int
    retained_alloc_bytes: int | None
    transient_peak_bytes: int | None
    offload_bytes: int


def profile_layer_policy(model_config, policy: str | LayerPolicy, micro_batch: int, seq_len: int,
                         *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.bfloat16,
                         offload_ratio: float = 0.0, repeats: int = 3,
                         seed: int = 0) -> PolicyProfile:
    """Measure one decoder layer of `model_config` (config.json dict or PretrainedConfig) under
    `policy` for a (micro_batch, seq_len) micro-batch; see the module docstring."""
    p = policy if isinstance(policy, LayerPolicy) else parse_policy(policy, "profile", "policy")
    if micro_batch < 1 or seq_len < 1 or repeats < 1:
        raise SpecError("profile", "micro_batch/seq_len/repeats", "integers >= 1, got "
                        f"{micro_batch}/{seq_len}/{repeats}")
    if not 0.0 <= offload_ratio <= 1.0:
        raise SpecError("profile", "offload_ratio", f"a ratio in [0, 1], got {offload_ratio}")
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    runner = ModelRunner(model_config, dev, dtype)
    gen = torch.Generator(device=dev).manual_seed(seed)
    flat = (torch.randn(runner.layouts[1].numel, generator=gen, device=dev) * 0.02).to(dtype)
    params = runner.layouts[1].views(flat)
    rope = runner.rope(seq_len)
    shape = (micro_batch, seq_len, runner.hidden)
    layers = PolicyRunner(runner, None)
    layout = kept_layout(layers, p, params, torch.zeros(shape, device=dev, dtype=dtype), rope)
    pool = PinnedPool(pin=cuda)
    acts = layers.acts = OffloadedActivations([layout], 1, offload_ratio, 1, dev, pool)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def once():
        x = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
        grad = torch.randn(shape, generator=gen, device=dev, dtype=dtype)
        sync()
        base = torch.cuda.memory_allocated(dev) if cuda else 0
        t0 = time.perf_counter()
        acts.add(1, 0, x)
        out, st = layers.forward(p, 1, 0, params, x, rope)
        sync()
        t1 = time.perf_counter()
        kept = acts.kept_bytes(1, 0)
        del out, x
        held = torch.cuda.memory_allocated(dev) - base + kept_input if cuda else None
        if acts.offload_bytes(1):
            acts.offload(1)
            acts.reload_layer(1)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(dev)
        start = torch.cuda.memory_allocated(dev) if cuda else 0
        t2 = time.perf_counter()
        if recomputes(p):  # else there is no RECOMPUTE task: nothing to time
            layers.recompute(st, params, rope)
            sync()
        t3 = time.perf_counter() if recomputes(p) else t2
        layers.backward(st, grad)
        sync()
        t4 = time.perf_counter()
        peak = torch.cuda.max_memory_allocated(dev) - start if cuda else None
        del st
        acts.release(1, 0)
        return t1 - t0, t3 - t2, t4 - t3, kept, held, peak

    kept_input = shape[0] * shape[1] * shape[2] * torch.finfo(dtype).bits // 8
    try:
        with torch.no_grad():
            once()  # warm-up
            runs = [once() for _ in range(repeats)]
    finally:
        pool.close()
    fwd, rec, bwd = (statistics.median(r[i] for r in runs) for i in range(3))
    last = runs[-1]
    return PolicyProfile(p.name, micro_batch * seq_len, fwd, rec, bwd, fwd + rec + bwd,
                         last[3], last[4], last[5], acts.offload_bytes(1))
