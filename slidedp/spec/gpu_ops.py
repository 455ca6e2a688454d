"""GPU compute by kind of operation: one decoder layer's time on a GPU nobody profiled.

A decoder layer (Qwen3 / Llama / Qwen2 / Mistral, dense MLP) is a list of operations, forward and
backward, each of one kind, and each kind is timed from the GPU's microbenchmarks and datasheet,
never from whole-layer measurements:
  gemm         2 M N K FLOPs at the GPU's matmul rate for the shape, or its bytes (A, B and C in
               BF16, each once) at the copy rate if slower. The rate for (M, N, K): the measured
               rate of that shape where gpu.ops gemm_measured has it; else the reference
               product's (gemm_tflops at gemm_shape) scaled by the shape's tile and wave
               efficiency against the reference's: output tiles of 128 x 256 (or 256 x 128,
               whichever fills better) spread over the GPU's SMs in waves, efficiency = useful
               output / (waves x SMs x tile area) (NVIDIA's Matrix Multiplication Background
               guide: tile and wave quantization), at most the reference's own rate: the wave
               model prices what a shape loses to the reference's filling, never a gain (the
               measured reference already holds the kernel's other losses and the clocks).
  attention    causal SDPA: forward FLOPs 2 n_q d seq per token (QK^T and PV over the causal half
               of the square), backward 2.5 x forward (FlashAttention's count: the scores are
               recomputed), at the GPU's attention rates (gpu.ops attention_fwd_tflops,
               attention_bwd_tflops: published kernel benchmarks of the backend torch picks on
               that GPU), or their bytes at the copy rate if slower.
  elementwise  memory-bound ops (RMSNorm, RoPE, SiLU x up, the residual adds and autograd's
               gradient sums, attention backward's streaming passes): HBM bytes / (copy rate x
               the kind's fraction) + kernels x kernel_overhead_us. elementwise_fraction is that
               fraction for transformers' eager kernels, fused_fraction for liger-kernel's fused
               ones (each one number or a table by kind: rmsnorm, rope, swiglu, residual; the
               fused one defaults to the eager one): each kind's bytes as counted below over its
               measured time in a microbenchmark of the same kernels (Liger-Kernel's public
               benchmark data; benchmarks/gpu_ops_microbench.py measures them on a GPU at hand).
Linear layers: forward y = x W^T is (M, N, K) = (tokens, out, in); backward dX = dY W (tokens,
in, out) and dW = dY^T X (out, in, tokens): twice the forward's FLOPs.

Bytes per element of the width an op works on, as the kernels that run move them (BF16 tensors,
FP32 where the eager code upcasts, the norms' weights BF16 as the layer holds them), and kernels
per op; `kernels` "eager" (transformers' modules, as the executor runs them) or "fused"
(liger-kernel's RMSNorm, RoPE and SwiGLU, one kernel each way; the adds stay eager):
                                  eager fwd   eager bwd   fused fwd   fused bwd
  RMSNorm (h; q, k with qk-norm)   36 / 8      92 / 16      4 / 1       6 / 2    (B/elem / kernels)
  RoPE (q, k)                      20 / 5      30 / 9       4 / 1       4 / 1
  SiLU(gate) x up (ffn)            10 / 2      18 / 3       6 / 1      10 / 1
  residual add (h, twice)           6 / 1       6 / 1       6 / 1       6 / 1
Eager RMSNorm forward: to FP32 (2 + 4), pow (4 + 4), mean (4), the row's + eps and rsqrt (two
small kernels), x * rstd (4 + 4), to BF16 (4 + 2), weight * (2 + 2). Its backward, autograd's
kernels through the same ops: weight * -> grad x weight (2 + 2) and the weight's gradient, grad x
input (2 + 2 + 2) summed over the tokens (2); to BF16 -> the gradient to FP32 (2 + 4); x * rstd ->
grad x rstd (4 + 4) and rstd's gradient, grad x x (4 + 4 + 4) summed over the row (4); rsqrt and
+ eps (three small kernels); mean -> the row's gradient expanded and divided (4); pow(2) ->
x.pow(1) (4 + 4), x 2 (4 + 4), x grad (4 + 4 + 4); the two paths into x summed (4 + 4 + 4); to
FP32 -> back to BF16 (4 + 2). Eager RoPE forward: q * cos (2 + 2), the negated half (1 + 1), cat
(2 + 2), * sin (2 + 2), add (2 + 2 + 2); backward: grad x cos and grad x sin (2 + 2 each), the
negated half (1 + 1), each half slice's zero-filled gradient (2, then 1 + 1; twice) and the three
paths summed (2 + 2 + 2, twice). The backward's residual add is the gradient accumulated where
the residual branches; autograd sums the input gradients of the projections that share an input
the same way: q, k and v (two adds of h), gate and up (one). The attention output's transpose
copies nothing (the kernels write it in the o_proj's order, spec/segments.py). The attention
backward runs two streaming passes beside its main kernel (FlashAttention-2's and cuDNN's
dot_do_o and convert_dq kernels): the rows' dO . O (2 + 2 per q element) and dQ from its FP32
accumulator to BF16 (4 + 2), at the residual kind's rate.

Each op carries the segment of spec/segments.py it belongs to, so a policy's recompute is the
forward ops of the segments it re-runs (policy_recompute_seconds).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import MappingProxyType

from slidedp.spec.errors import SpecError
from slidedp.spec.model import BF16, ModelSpec, load_model
from slidedp.spec.segments import SEGMENTS, parse_policy, recomputed_segments
from slidedp.spec.tomlio import Table, sources_of
from slidedp.spec.units import GB

KERNELS = ("eager", "fused")
TILES = ((128, 256), (256, 128))
ATTENTION_BWD_FLOPS = 2.5  # backward / forward FLOPs of a FlashAttention-style kernel

# (fwd bytes per element, fwd kernels, bwd bytes per element, bwd kernels) by kernels choice
ELEMENTWISE = {
    "eager": {"rmsnorm": (36, 8, 92, 16), "rope": (20, 5, 30, 9), "swiglu": (10, 2, 18, 3),
              "residual": (6, 1, 6, 1)},
    "fused": {"rmsnorm": (4, 1, 6, 2), "rope": (4, 1, 4, 1), "swiglu": (6, 1, 10, 1),
              "residual": (6, 1, 6, 1)},
}
FUSED_KINDS = ("rmsnorm", "rope", "swiglu")  # the kinds liger's kernels replace
ADD_BYTES = 3 * BF16  # an add of two BF16 tensors: two reads, one write, per element
ATTENTION_BWD_PASS_BYTES = 2 * BF16 + 4 + BF16  # dO . O rows; dQ from FP32 (module docstring)
SEGMENT = {name: i for i, name in enumerate(SEGMENTS)}
# the layer shapes a GPU nobody profiled gets its `achieved` rows for (reference_achieved_rows):
# one model preset per hidden width, at one sequence length and three micro-batches
REFERENCE_MODELS = ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen2.5-72b")
REFERENCE_SEQ = 4096
REFERENCE_MICRO_BATCHES = (1, 4, 16)


@dataclass(frozen=True)
class GpuOps:
    """A GPU's rates by kind of operation (the [gpu.ops] table), in FLOP/s, bytes/s, seconds."""

    sms: int
    gemm_flops: float  # measured (or estimated) rate of the reference product
    gemm_shape: tuple[int, int, int]
    copy_bps: float  # device-to-device copy, bytes read + written per second
    elementwise_fraction: MappingProxyType  # kind -> its eager kernels' byte rate / the copy's
    kernel_overhead_s: float  # per elementwise kernel, beyond its bytes
    attention: str  # the SDPA backend the rates are of (descriptive)
    attention_fwd_flops: float
    attention_bwd_flops: float
    sources: MappingProxyType = field(default_factory=lambda: MappingProxyType({}))
    # (M, N, K, FLOP/s) of products measured at the layers' shapes; () where not measured
    gemm_measured: tuple[tuple[int, int, int, float], ...] = ()
    # kind -> liger's fused kernels' byte rate / the copy's; None: elementwise_fraction's
    fused_fraction: MappingProxyType | None = None

    def fraction(self, kind: str, fused: bool) -> float:
        """The byte rate of an elementwise kind's kernels over the copy rate (module docstring)."""
        table = self.fused_fraction if fused and self.fused_fraction is not None else (
            self.elementwise_fraction)
        return table[kind]


def parse_gpu_ops(t: Table, peak_flops: float) -> GpuOps:
    """The [gpu.ops] table of a hardware file (module docstring); rates at most the peak."""
    keys = ["sms", "gemm_tflops", "gemm_shape", "copy_gbps", "elementwise_fraction",
            "kernel_overhead_us", "attention", "attention_fwd_tflops", "attention_bwd_tflops"]
    shape = t.raw("gemm_shape")
    if not (isinstance(shape, list) and len(shape) == 3 and all(
            isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in shape)):
        raise SpecError(t.where, "gpu.ops.gemm_shape", f"[M, N, K] positive integers, got {shape!r}")
    frac = _fractions(t.raw("elementwise_fraction"), t.where, "elementwise_fraction")
    fused = (_fractions(t.raw("fused_fraction"), t.where, "fused_fraction")
             if t.has("fused_fraction") else None)
    measured = []
    for r in t.raw("gemm_measured", []):
        if not (isinstance(r, list) and len(r) == 4 and all(
                isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in r)):
            raise SpecError(t.where, "gpu.ops.gemm_measured",
                            f"[M, N, K, tflops] positive numbers, got {r!r}")
        measured.append((int(r[0]), int(r[1]), int(r[2]), float(r[3]) * 1e12))
    rates = {k: t.num(k) * 1e12 for k in ("gemm_tflops", "attention_fwd_tflops",
                                          "attention_bwd_tflops")}
    for k, v in rates.items():
        if v > peak_flops * 1.001:
            raise SpecError(t.where, f"gpu.ops.{k}", f"at most peak_bf16_tflops "
                                                     f"({peak_flops / 1e12:g}), got {v / 1e12:g}")
    ops = GpuOps(t.int("sms"), rates["gemm_tflops"], tuple(shape), t.num("copy_gbps") * GB, frac,
                 t.num("kernel_overhead_us", allow_zero=True) * 1e-6, t.str("attention"),
                 rates["attention_fwd_tflops"], rates["attention_bwd_tflops"],
                 sources_of(t, keys + (["gemm_measured"] if measured else [])
                            + (["fused_fraction"] if fused is not None else [])),
                 tuple(measured), fused)
    t.done()
    return ops


def _fractions(v, where: str, key: str) -> MappingProxyType:
    """gpu.ops.<key> (elementwise_fraction, fused_fraction): a number in (0, 1] for every kind,
    or a table by kind."""
    name = f"gpu.ops.{key}"
    table = dict.fromkeys(ELEMENTWISE["eager"], v) if not isinstance(v, dict) else v
    if set(table) != set(ELEMENTWISE["eager"]):
        raise SpecError(where, name, f"a number or a table of {', '.join(ELEMENTWISE['eager'])}, "
                                     f"got {v!r}")
    for k, x in table.items():
        if isinstance(x, bool) or not isinstance(x, int | float) or not 0 < x <= 1:
            raise SpecError(where, f"{name}" + (f".{k}" if isinstance(v, dict) else ""),
                            f"a fraction in (0, 1], got {x!r}")
    return MappingProxyType({k: float(x) for k, x in table.items()})


@dataclass(frozen=True)
class Op:
    """One operation of a layer: its kind, work and the segment (spec/segments.py) it is in."""

    name: str
    phase: str  # "fwd" | "bwd"
    kind: str  # "gemm" | "attention" | "elementwise"
    segment: int
    flops: float = 0.0
    hbm_bytes: float = 0.0
    kernels: int = 0
    shape: tuple[int, int, int] | None = None  # gemm: (M, N, K)
    elementwise: str = ""  # elementwise: its kind (ELEMENTWISE's keys)
    fused: bool = False  # elementwise: liger's fused kernel (fused_fraction), else eager


def layer_ops(m: ModelSpec, seq: int, micro_batch: int, kernels: str = "eager") -> list[Op]:
    """The operations of one dense decoder layer's forward and backward on one micro-batch of
    `micro_batch` sequences of `seq` tokens (module docstring)."""
    if kernels not in KERNELS:
        raise SpecError("gpu_ops", "kernels", f"one of {', '.join(KERNELS)}, got {kernels!r}")
    if m.is_moe_layer():
        raise SpecError(m.source or m.name, "layer", "a dense decoder layer (MoE layers are not "
                                                      "modelled by kind of operation)")
    T = seq * micro_batch
    h, q, k, f = m.hidden, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim, m.ffn
    ew = ELEMENTWISE[kernels]
    ops: list[Op] = []

    def linear(name: str, seg: str, out: int, inp: int) -> None:
        s = SEGMENT[seg]
        ops.append(Op(name, "fwd", "gemm", s, 2.0 * T * out * inp, shape=(T, out, inp)))
        ops.append(Op(f"{name} dX", "bwd", "gemm", s, 2.0 * T * out * inp, shape=(T, inp, out)))
        ops.append(Op(f"{name} dW", "bwd", "gemm", s, 2.0 * T * out * inp, shape=(out, inp, T)))

    def elementwise(name: str, seg: str, kind: str, width: int) -> None:
        fb, fk, bb, bk = ew[kind]
        s, fused = SEGMENT[seg], kernels == "fused" and kind in FUSED_KINDS
        ops.append(Op(name, "fwd", "elementwise", s, hbm_bytes=fb * T * width, kernels=fk,
                      elementwise=kind, fused=fused))
        ops.append(Op(f"{name} grad", "bwd", "elementwise", s, hbm_bytes=bb * T * width,
                      kernels=bk, elementwise=kind, fused=fused))

    def streaming(name: str, seg: str, bytes_per_token: float, kernels: int) -> None:
        """A backward-only pass at the residual kind's rate (module docstring)."""
        ops.append(Op(name, "bwd", "elementwise", SEGMENT[seg], hbm_bytes=bytes_per_token * T,
                      kernels=kernels, elementwise="residual"))

    elementwise("input_norm", "input_norm", "rmsnorm", h)
    for name, width in (("q_proj", q), ("k_proj", k), ("v_proj", k)):
        linear(name, "qkv", width, h)
    streaming("q/k/v dX sum", "qkv", 2 * ADD_BYTES * h, 2)
    if m.qk_norm:
        elementwise("q_norm", "qkv", "rmsnorm", q)
        elementwise("k_norm", "qkv", "rmsnorm", k)
    elementwise("rope", "qkv", "rope", q + k)
    att = 2.0 * q * seq * T  # causal: QK^T and PV over half the square
    io = BF16 * T * (2 * q + 2 * k)  # q, k, v in, o out
    ops.append(Op("attention", "fwd", "attention", SEGMENT["attention"], att, io))
    ops.append(Op("attention grad", "bwd", "attention", SEGMENT["attention"],
                  ATTENTION_BWD_FLOPS * att, 2 * io + BF16 * T * 2 * q))
    streaming("attention grad passes", "attention", ATTENTION_BWD_PASS_BYTES * q, 2)
    linear("o_proj", "o_proj_residual", h, q)
    elementwise("attention residual", "o_proj_residual", "residual", h)
    elementwise("post_norm", "post_norm", "rmsnorm", h)
    linear("gate_proj", "gate_up", f, h)
    linear("up_proj", "gate_up", f, h)
    streaming("gate/up dX sum", "gate_up", ADD_BYTES * h, 1)
    elementwise("act_mul", "act_mul", "swiglu", f)
    linear("down_proj", "down_residual", h, f)
    elementwise("mlp residual", "down_residual", "residual", h)
    return ops


# ---- time by kind ------------------------------------------------------------------------------


def wave_efficiency(M: int, N: int, sms: int) -> float:
    """Useful output / (waves x SMs x tile area), the better of the TILES (tile and wave
    quantization of an output-tiled GEMM)."""
    best = 0.0
    for tm, tn in TILES:
        tiles = math.ceil(M / tm) * math.ceil(N / tn)
        waves = math.ceil(tiles / sms)
        best = max(best, M * N / (waves * sms * tm * tn))
    return best


def gemm_flops_per_s(shape: tuple[int, int, int], ops: GpuOps, peak_flops: float) -> float:
    """The matmul rate of an (M, N, K) product: measured where gemm_measured has the shape, else
    the reference's scaled by the shape's wave efficiency against the reference's, at most the
    reference's rate (module docstring); never above the peak."""
    for M, N, K, rate in ops.gemm_measured:
        if tuple(shape) == (M, N, K):
            return min(peak_flops, rate)
    ref = wave_efficiency(ops.gemm_shape[0], ops.gemm_shape[1], ops.sms)
    return ops.gemm_flops * min(1.0, wave_efficiency(shape[0], shape[1], ops.sms) / ref)


def op_seconds(op: Op, ops: GpuOps, peak_flops: float) -> float:
    """One operation's time on the GPU (module docstring)."""
    if op.kind == "gemm":
        M, N, K = op.shape
        moved = BF16 * (M * K + K * N + M * N)
        return max(op.flops / gemm_flops_per_s(op.shape, ops, peak_flops), moved / ops.copy_bps)
    if op.kind == "attention":
        rate = ops.attention_fwd_flops if op.phase == "fwd" else ops.attention_bwd_flops
        return max(op.flops / rate, op.hbm_bytes / ops.copy_bps)
    return (op.hbm_bytes / (ops.copy_bps * ops.fraction(op.elementwise, op.fused))
            + op.kernels * ops.kernel_overhead_s)


def _gpu_ops(gpu) -> GpuOps:
    if gpu.ops is None:
        raise SpecError("gpu", "gpu.ops", f"the GPU's rates by kind of operation ([gpu.ops]) for "
                                          f"{gpu.model}")
    return gpu.ops


def layer_seconds(m: ModelSpec, seq: int, micro_batch: int, gpu, kernels: str = "eager"
                  ) -> dict[str, float]:
    """{"fwd": s, "bwd": s} of one layer on one micro-batch on `gpu` (a GpuSpec with ops)."""
    g = _gpu_ops(gpu)
    out = {"fwd": 0.0, "bwd": 0.0}
    for op in layer_ops(m, seq, micro_batch, kernels):
        out[op.phase] += op_seconds(op, g, gpu.peak_bf16_flops)
    return out


def seconds_by_kind(m: ModelSpec, seq: int, micro_batch: int, gpu, kernels: str = "eager"
                    ) -> dict[tuple[str, str], float]:
    """(phase, kind) -> seconds of one layer on one micro-batch: where its time goes."""
    g = _gpu_ops(gpu)
    out: dict[tuple[str, str], float] = {}
    for op in layer_ops(m, seq, micro_batch, kernels):
        key = (op.phase, op.kind)
        out[key] = out.get(key, 0.0) + op_seconds(op, g, gpu.peak_bf16_flops)
    return out


def policy_recompute_seconds(m: ModelSpec, seq: int, micro_batch: int, gpu, policy: str,
                             kernels: str = "eager") -> float:
    """The forward work an activation policy re-runs in backward: the forward ops of the
    segments it recomputes ("layer", "seg:..."); for "sac" the memory-bound ones outside the
    residual adds (spec/segments.py: sac keeps the matmuls', attention's and h1's outputs)."""
    p = parse_policy(policy, "policy", "policy")
    g = _gpu_ops(gpu)
    fwd = [op for op in layer_ops(m, seq, micro_batch, kernels) if op.phase == "fwd"]
    if p.kind == "sac":
        chosen = [op for op in fwd if op.kind == "elementwise" and "residual" not in op.name]
    else:
        segs = set(recomputed_segments(p))
        chosen = [op for op in fwd if op.segment in segs]
    return sum(op_seconds(op, g, gpu.peak_bf16_flops) for op in chosen)


def achieved_rows(m: ModelSpec, seq: int, micro_batches: tuple[int, ...], gpu,
                  kernels: str = "eager") -> list[list[float]]:
    """[[hidden, tokens, TFLOP/s], ...]: the `achieved` rows of a hardware file for this layer
    shape, FLOPs counted as ModelSpec.layer_flops_per_token does (what graph/costs.py divides by
    the achieved rate), from the layer's fwd + bwd time by kind of operation."""
    per_token = sum(m.layer_flops_per_token(seq)[k] for k in ("fwd", "bwd"))
    rows = []
    for b in micro_batches:
        t = layer_seconds(m, seq, b, gpu, kernels)
        rows.append([m.hidden, seq * b, round(per_token * seq * b / (t["fwd"] + t["bwd"]) / 1e12,
                                              1)])
    return rows


def reference_achieved_rows(gpu, kernels: str = "eager") -> list[list[float]]:
    """The `achieved` table of a GPU nobody profiled: achieved_rows of each REFERENCE_MODELS
    layer at REFERENCE_SEQ and REFERENCE_MICRO_BATCHES, by hidden width (what a hardware file
    without measured layers carries; benchmarks/achieved_from_gpu_ops.py writes it)."""
    rows: list[list[float]] = []
    for name in REFERENCE_MODELS:
        rows += achieved_rows(load_model(name), REFERENCE_SEQ, REFERENCE_MICRO_BATCHES, gpu,
                              kernels)
    return sorted(rows)
