"""GPU compute (CUDA only): one decoder layer's fwd + bwd time by shape and policy; a bf16 matmul.

The layer is `model.model.layers[0]` of a one-layer copy of the model's Hugging Face config,
built with AutoModelForCausalLM on the meta device and materialized on GPU 0 in BF16 (weights
N(0, 0.02), norms 1, biases 0), SDPA attention with the causal mask and no padding mask, rotary
embeddings from the model's own rotary class: the code the executor runs (exec/layer_runner.py,
whose config checks apply: dense qwen3, qwen2, llama, mistral), with the kernels a plan's
`kernels` would run there (exec/fused_kernels.py; "auto" by default: liger-kernel's where it imports),
recorded in each LayerTiming and in the hardware file's layer_time rows. Input and output gradient are
random BF16 (micro_batch, seq, hidden); the input requires grad, as inside a model. Per policy,
CUDA events around each phase on the one stream, median of `repeats` after `warmup`:
  none    forward with autograd | backward                 -> fwd_s, bwd_s
  layer   no-grad forward | forward again (recompute) with autograd + backward
          (whole-layer checkpoint)                         -> fwd_s, bwd_s (recompute + bwd)
Sustained (`LayerBench.sustained`): the same iterations (one per policy, same inputs and
phases) enqueued back to back with no host synchronization in between, `iters` of each policy
in the given order (the profile runs `layer` first, then `none`, so the `none` figure the cost
model uses is taken after the GPU has worked the longest), CUDA events between phases of every
iteration; per policy the median of the last half of its iterations: the steady time under
load, as in the training pipeline (clocks settle under sustained load). `span_s` is the CUDA-event
time from the first iteration's start to the last one's end, `busy` the summed iteration times
over it (near 1: the host kept the GPU fed).
A shape that runs out of GPU memory is skipped (None). The matmul is C = A B, 8192^3 bf16.
"""

from __future__ import annotations

import dataclasses
import statistics
from dataclasses import dataclass

import torch

from slidedp.exec import fused_kernels
from slidedp.exec.layer_runner import hf_config
from slidedp.profile.timing import cuda_median_s
from slidedp.spec.model import ModelSpec, first_layers_config

MATMUL_N = 8192


@dataclass(frozen=True)
class LayerTiming:
    model: str
    hidden: int
    ffn: int
    seq: int
    micro_batch: int
    policy: str  # "none" | "layer"
    fwd_s: float  # none: forward with autograd; layer: no-grad forward
    bwd_s: float  # none: backward; layer: recompute + backward
    flops: float  # counted FLOPs of the timed work (ModelSpec.layer_flops_per_token)
    iterations: int = 0  # sustained: iterations of this policy back to back (0: a short run)
    span_s: float = 0.0  # sustained: GPU time of the whole back-to-back run (all policies)
    busy: float = 0.0  # sustained: summed iteration times / span_s
    kernels: str = "eager"  # the kernels the layer ran: eager | liger (exec/fused_kernels.py)

    @property
    def total_s(self) -> float:
        return self.fwd_s + self.bwd_s

    @property
    def flops_per_s(self) -> float:
        return self.flops / self.total_s


def one_layer_config(spec: ModelSpec):
    """The model's transformers config cut to one layer; a SpecError if the executor can't run it."""
    hf_config(dict(spec.config))  # the executor's checks, on every layer of the model
    return hf_config(first_layers_config(spec.config, 1))


def build_layer(spec: ModelSpec, device: torch.device, kernels: str = "auto"):
    """(decoder layer 0 in BF16 on `device`, the model's rotary embedding on `device`, the
    kernels it runs: exec/kernels.apply's resolution of `kernels`)."""
    from transformers import AutoModelForCausalLM

    config = one_layer_config(spec)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    ran, _ = fused_kernels.apply(model, kernels, device)
    layer = model.model.layers[0].to_empty(device=device).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.02)
            else:
                p.fill_(0.0 if name.endswith("bias") else 1.0)
    return layer, type(model.model.rotary_emb)(config=config).to(device), ran


def rope(rotary, seq: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for positions 0..seq-1 in BF16, shape (1, seq, head_dim), as the executor's."""
    pos = torch.arange(seq, device=device)[None]
    return rotary(torch.empty(0, device=device, dtype=torch.bfloat16), pos)


def forward(layer, x: torch.Tensor, cos_sin) -> torch.Tensor:
    """The layer on (micro_batch, seq, hidden): causal SDPA, no padding mask."""
    out = layer(x, position_embeddings=cos_sin, attention_mask=None)
    return out[0] if isinstance(out, tuple) else out


class LayerBench:
    """One decoder layer of `spec` on GPU 0, built once and timed at several shapes."""

    def __init__(self, spec: ModelSpec, warmup: int, repeats: int, kernels: str = "auto"):
        self.device = torch.device("cuda", 0)
        self.layer, self.rotary, self.kernels = build_layer(spec, self.device, kernels)
        self.spec, self.warmup, self.repeats = spec, warmup, repeats

    def time(self, seq: int, micro_batch: int, policy: str) -> LayerTiming | None:
        """Median fwd / bwd seconds of one micro-batch; None when it does not fit GPU memory."""
        try:
            once = self._iteration(seq, micro_batch)
            for _ in range(self.warmup):
                once(policy)
            runs = [once(policy) for _ in range(self.repeats)]
            torch.cuda.synchronize(self.device)
            fwd_s, bwd_s = _medians(runs)
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            self.layer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        return self._timing(seq, micro_batch, policy, fwd_s, bwd_s)

    def sustained(self, seq: int, micro_batch: int,
                  iters: dict[str, int]) -> list[LayerTiming] | None:
        """`iters[policy]` iterations of each policy back to back, in order, no sync in between;
        per policy the median fwd / bwd of its last half (module docstring). None: out of memory."""
        try:
            once = self._iteration(seq, micro_batch)
            once(next(iter(iters)))  # allocations, outside the timed run
            torch.cuda.synchronize(self.device)
            runs = {p: [once(p) for _ in range(n)] for p, n in iters.items()}
            torch.cuda.synchronize(self.device)
        except torch.cuda.OutOfMemoryError:
            return None
        finally:
            self.layer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
        every = [ev for rs in runs.values() for ev in rs]
        span = every[0][0].elapsed_time(every[-1][2]) / 1e3
        busy = sum(a.elapsed_time(c) for a, _, c in every) / 1e3 / span
        out = []
        for policy, rs in runs.items():
            fwd_s, bwd_s = _medians(rs[len(rs) // 2:])
            t = self._timing(seq, micro_batch, policy, fwd_s, bwd_s)
            out.append(dataclasses.replace(t, iterations=len(rs), span_s=span, busy=busy))
        return out

    def _timing(self, seq: int, micro_batch: int, policy: str, fwd_s: float,
                bwd_s: float) -> LayerTiming:
        f = self.spec.layer_flops_per_token(seq)
        kinds = ("fwd", "bwd") if policy == "none" else ("fwd", "recompute", "bwd")
        flops = sum(f[k] for k in kinds) * seq * micro_batch
        s = self.spec
        return LayerTiming(s.name, s.hidden, s.ffn, seq, micro_batch, policy, fwd_s, bwd_s, flops,
                           kernels=self.kernels)

    def _iteration(self, seq: int, micro_batch: int):
        """once(policy): enqueue one micro-batch's fwd + bwd; its 3 CUDA events (start, fwd end,
        end)."""
        shape = (micro_batch, seq, self.spec.hidden)
        x = torch.randn(shape, device=self.device, dtype=torch.bfloat16)
        dy = torch.randn_like(x)
        cos_sin = rope(self.rotary, seq, self.device)

        def once(policy: str) -> tuple[torch.cuda.Event, ...]:
            self.layer.zero_grad(set_to_none=True)
            ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            xin = x.detach().requires_grad_()
            ev[0].record()
            if policy == "none":
                y = forward(self.layer, xin, cos_sin)
            else:
                with torch.no_grad():
                    forward(self.layer, x, cos_sin)
            ev[1].record()
            if policy == "layer":
                y = forward(self.layer, xin, cos_sin)
            y.backward(dy)
            ev[2].record()
            return tuple(ev)

        return once


def _medians(runs) -> tuple[float, float]:
    """(median fwd, median bwd) seconds of synchronized (start, fwd end, end) event triples."""
    fwd = statistics.median(a.elapsed_time(b) for a, b, _ in runs) / 1e3
    bwd = statistics.median(b.elapsed_time(c) for _, b, c in runs) / 1e3
    return fwd, bwd


def matmul_flops_per_s(warmup: int, repeats: int) -> float:
    """Achieved rate of one 8192^3 bf16 matmul on GPU 0 (2 n^3 FLOPs / CUDA-event time)."""
    dev = torch.device("cuda", 0)
    a = torch.randn(MATMUL_N, MATMUL_N, device=dev, dtype=torch.bfloat16)
    b, c = torch.randn_like(a), torch.empty_like(a)
    with torch.cuda.device(dev):
        t = cuda_median_s(lambda: torch.mm(a, b, out=c), warmup, repeats)
    return 2 * MATMUL_N**3 / t
