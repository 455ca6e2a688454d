"""Activation policies of one decoder layer, and the segments they are defined over.

ONE definition, read by the analytic model, the graph (hence the simulator) and the executor.

Segments of a Qwen3/Llama/Qwen2/Mistral decoder layer (x: the layer input; out: its output):
  s  name            computes                                          output = boundary s
  0  input_norm      xn = input_layernorm(x)                           xn              h
  1  qkv             q, k, v projections (+ q_norm/k_norm, RoPE)       q_rot, k_rot, v q + 2k
  2  attention       o = SDPA(q_rot, k_rot, v), causal                 o               q
  3  o_proj_residual h1 = x + o_proj(o)                                h1              h
  4  post_norm       h1n = post_attention_layernorm(h1)                h1n             h
  5  gate_up         g, u = gate_proj(h1n), up_proj(h1n)  (MoE: router  g, u           2w
                     + the e experts' gate/up on gathered inputs)
  6  act_mul         a = SiLU(g) * u                                   a               w
  7  down_residual   out = h1 + down_proj(a)                           (the layer output)
Boundaries 0..6 are the outputs of segments 0..6 (widths in elements per token; bf16).
Besides its input, a segment's backward needs "internal" tensors autograd saves inside it:
  0: rstd (fp32) + the eager norm's 6 h   1: q, k before q_norm/k_norm, their rstd and the eager
  norms' 4 (q + k) (qwen3 only)   2: logsumexp (fp32)   3: the contiguous o_proj input copy (q)
  4: rstd + the eager norm's 6 h   5: MoE only: gathered expert inputs (e h) and router
  probabilities (E, fp32)   6: SiLU(g) (w)   7: none
The norms are the ops the executor runs: transformers' eager RMSNorm (x.to(fp32), pow, mean,
rsqrt, mul, .to(bf16), weight *), on the GPU as on the CPU (it calls the HF modules; no fused
norm kernel), which saves its fp32 input copy (4 B per element) and the normalized bf16 tensor
before the weight (2 B) besides rstd: EAGER_NORM_BYTES = 6 per normalized element more than a
fused norm (measured by slidedp.exec.policy_profile, tests/test_exec_policy_profile.py). For
q_norm / k_norm the bf16 q, k the model counts are not kept (the fp32 copies are): 4 (q + k)
more. The o_proj input copy (2 q) is kept as an upper bound: SDPA on the CPU and the flash /
efficient CUDA kernels return the attention output already in o_proj's (batch, seq, heads)
order, so o.transpose(1, 2).contiguous() copies nothing there (measured on the CPU: 2 q fewer
bytes); another attention backend may copy, so the memory check keeps it (conservative).
x + boundaries + internals is exactly ModelSpec.activation_bytes_per_token("none").

Policies (their names are what plan.layer_policies holds):
  "none"          plain autograd: keeps everything, recomputes nothing.
  "layer"         whole-layer checkpoint: keeps x, recomputes segments 0..7 (torch.utils.checkpoint).
  "seg:0bMMMMMMM" segment checkpoint, a 7-bit mask; bit i (i = 0 the rightmost digit) set = keep
                  boundary i. Segment s in 0..6 is recomputed in backward iff boundary s is not
                  kept (its consumer needs it: re-run s from the nearest kept tensor, x at worst);
                  a segment that is not recomputed keeps its internals. Segment 7 is never
                  recomputed (backward needs only its input a = boundary 6, and the residual add
                  saves nothing). seg:0b0000000 keeps x alone and recomputes 0..6 (layer minus
                  down_proj); seg:0b1111111 keeps what "none" keeps.
  "sac"           selective activation checkpointing, default op choice: keep the outputs of the
                  matmuls and of attention (q, k before their norms, v; o and its logsumexp; h1 =
                  x + o_proj(o); g, u; MoE routing state), recompute the cheap memory-bound ops
                  (input_norm, q/k norm + RoPE, the o_proj input copy, post_norm, SiLU(g) * u).
Every policy has: retained bytes per token (kept until the layer's backward; what offload_ratio
applies to), transient bytes per token (what its recompute + backward hold at once), recompute
FLOPs per token (matmul + attention, as ModelSpec.layer_flops_per_token counts them) and recompute
elementwise HBM bytes per token (norms, RoPE, SiLU, residual adds, copies: memory-bound, their
FLOPs are not counted; an estimate: one read per input, one write per output, bf16).
"""

from __future__ import annotations

from dataclasses import dataclass

from slidedp.spec.errors import SpecError
from slidedp.spec.model import BF16, FP32, ModelSpec

SEGMENTS = (
    "input_norm",
    "qkv",
    "attention",
    "o_proj_residual",
    "post_norm",
    "gate_up",
    "act_mul",
    "down_residual",
)
N_BOUNDARIES = len(SEGMENTS) - 1  # 7: the mask width
ALL_KEPT = (1 << N_BOUNDARIES) - 1
SEG_PREFIX = "seg:"
# transformers' eager RMSNorm keeps, per normalized element, its fp32 input copy (4 B) and the
# normalized bf16 tensor before the weight (2 B) besides rstd (module docstring)
EAGER_NORM_BYTES = FP32 + BF16
# q_norm / k_norm: those 6 B per element instead of the bf16 q, k the fused count keeps (2 B)
EAGER_QK_NORM_EXTRA = EAGER_NORM_BYTES - BF16


@dataclass(frozen=True)
class LayerPolicy:
    """A parsed activation policy: kind "none" | "layer" | "sac" | "seg" (+ its mask)."""

    kind: str
    mask: int = 0

    @property
    def name(self) -> str:
        """The canonical name written to plan.layer_policies."""
        return f"{SEG_PREFIX}0b{self.mask:0{N_BOUNDARIES}b}" if self.kind == "seg" else self.kind


def parse_policy(text: object, where: str = "plan", field: str = "layer_policies") -> LayerPolicy:
    """ "none", "layer", "sac" or "seg:0b<7 bits>" (also "seg:<int 0..127>"); else SpecError."""
    expected = (
        f"one of none, layer, sac, seg:0b<{N_BOUNDARIES} bits> (a mask over the "
        f"decoder layer's segment boundaries), got {text!r}"
    )
    if not isinstance(text, str):
        raise SpecError(where, field, expected)
    if text in ("none", "layer", "sac"):
        return LayerPolicy(text)
    if not text.startswith(SEG_PREFIX):
        raise SpecError(where, field, expected)
    digits = text[len(SEG_PREFIX) :]
    try:
        mask = int(digits[2:], 2) if digits.startswith("0b") else int(digits, 10)
    except ValueError:
        raise SpecError(where, field, expected) from None
    if not 0 <= mask <= ALL_KEPT or (digits.startswith("0b") and len(digits) - 2 > N_BOUNDARIES):
        raise SpecError(where, field, expected)
    return LayerPolicy("seg", mask)


@dataclass(frozen=True)
class SegmentCosts:
    """Per-token figures of one layer's segments (lists indexed by segment or boundary)."""

    input_bytes: float  # x, the layer input, bf16
    fwd_flops: tuple[float, ...]  # per segment
    fwd_hbm_bytes: tuple[float, ...]  # per segment: its elementwise (memory-bound) traffic
    boundary_bytes: tuple[float, ...]  # per boundary 0..6
    internal_bytes: tuple[float, ...]  # per segment


def segment_costs(m: ModelSpec, seq: int, layer: int | None = None) -> SegmentCosts:
    """The segment table of the module docstring for model `m` at sequence length `seq`."""
    h, q, k = m.hidden, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    moe = m.is_moe_layer(layer)
    w = m.experts_per_token * m.moe_ffn if moe else m.ffn
    router_flops = 2.0 * m.n_experts * h if moe else 0.0
    qk_elementwise = 4.0 * (q + k) * (2 if m.qk_norm else 1)  # RoPE (+ q/k norm): read + write
    flops = (
        0.0,
        2.0 * h * (q + 2 * k),
        2.0 * q * seq,
        2.0 * q * h,
        0.0,
        4.0 * h * w + router_flops,
        0.0,
        2.0 * w * h,
    )
    gather = 4.0 * m.experts_per_token * h if moe else 0.0
    hbm = (4.0 * h, qk_elementwise, 0.0, 6.0 * h, 4.0 * h, gather, 6.0 * w, 6.0 * h)
    bnd = tuple(BF16 * e for e in (h, q + 2 * k, q, h, h, 2 * w, w))
    qk_int = ((BF16 + EAGER_QK_NORM_EXTRA) * (q + k) + FP32 * (m.n_heads + m.n_kv_heads)
              if m.qk_norm else 0.0)
    moe_int = BF16 * m.experts_per_token * h + FP32 * m.n_experts if moe else 0.0
    norm_int = FP32 + EAGER_NORM_BYTES * h
    internal = (norm_int, qk_int, FP32 * m.n_heads, BF16 * q, norm_int, moe_int, BF16 * w, 0.0)
    return SegmentCosts(float(BF16 * h), flops, hbm, bnd, internal)


@dataclass(frozen=True)
class PolicyCost:
    """Per-token figures of one policy (module docstring)."""

    retained_bytes: float
    transient_bytes: float
    recompute_flops: float
    recompute_hbm_bytes: float

    @property
    def recomputes(self) -> bool:
        return self.recompute_flops > 0 or self.recompute_hbm_bytes > 0


def recomputed_segments(p: LayerPolicy) -> tuple[int, ...]:
    """The segments a "layer" or "seg" policy re-runs in backward (() for none; sac re-runs ops
    inside segments instead, see the module docstring)."""
    if p.kind == "layer":
        return tuple(range(len(SEGMENTS)))
    if p.kind == "seg":
        return tuple(s for s in range(N_BOUNDARIES) if not p.mask >> s & 1)
    return ()


def keeps_beyond_input(policy: str | LayerPolicy) -> bool:
    """Whether the policy keeps anything besides the layer input x (then what it keeps exists
    only once the layer's forward ran: its offload follows that forward, graph/build.py)."""
    p = policy if isinstance(policy, LayerPolicy) else parse_policy(policy)
    return p.kind in ("none", "sac") or (p.kind == "seg" and p.mask != 0)


def policy_cost(
    m: ModelSpec, policy: str | LayerPolicy, seq: int, layer: int | None = None
) -> PolicyCost:
    """Retained / transient bytes and recompute work per token of `policy` on layer `layer`.

    transient = what the recompute brings back (none's bytes - retained, + x once more when it
    recomputes, as backward_transient_bytes_per_token counts a whole-layer recompute) + the
    backward's gradient temporaries (output and input gradients, d g and d u: 2 h + 2 w, bf16).
    """
    p = policy if isinstance(policy, LayerPolicy) else parse_policy(policy)
    c = segment_costs(m, seq, layer)
    none = c.input_bytes + sum(c.boundary_bytes) + sum(c.internal_bytes)
    if p.kind == "sac":
        # kept: x, q/k before norms + v, o + logsumexp, h1, g + u, MoE routing state
        retained = (
            c.input_bytes
            + c.boundary_bytes[1]
            + c.boundary_bytes[2]
            + c.internal_bytes[2]
            + c.boundary_bytes[3]
            + c.boundary_bytes[5]
            + c.internal_bytes[5]
        )
        q = m.n_heads * m.head_dim
        # recomputed elementwise: norms, q/k norm + RoPE, the o_proj input copy, SiLU(g) * u
        rflops, rhbm = (
            0.0,
            c.fwd_hbm_bytes[0]
            + c.fwd_hbm_bytes[1]
            + 4.0 * q
            + c.fwd_hbm_bytes[4]
            + c.fwd_hbm_bytes[6],
        )
    else:
        redo = recomputed_segments(p)
        kept_b = [i for i in range(N_BOUNDARIES) if i not in redo]
        retained = (
            c.input_bytes
            + sum(c.boundary_bytes[i] for i in kept_b)
            + sum(c.internal_bytes[s] for s in range(len(SEGMENTS)) if s not in redo)
        )
        rflops = sum(c.fwd_flops[s] for s in redo)
        rhbm = sum(c.fwd_hbm_bytes[s] for s in redo)
    recomputes = rflops > 0 or rhbm > 0
    w = c.boundary_bytes[6] / BF16
    transient = (
        none - retained + (c.input_bytes if recomputes else 0.0) + BF16 * (2 * m.hidden + 2 * w)
    )
    return PolicyCost(retained, transient, rflops, rhbm)


def recompute_fraction(
    m: ModelSpec,
    policy: str | LayerPolicy,
    seq: int,
    flops_per_hbm_byte: float,
    layer: int | None = None,
) -> float:
    """Recompute time / forward time of one layer: (FLOPs + HBM bytes x flops_per_hbm_byte) of the
    recomputed work over the same for the whole forward; 1 for "layer", 0 for "none".

    flops_per_hbm_byte: what one elementwise HBM byte costs in FLOPs of the forward's matmuls
    (graph/costs.py flops_per_hbm_byte supplies it: from policy sac's measured recompute where
    the hardware has it, else the achieved FLOP/s over the HBM bytes/s)."""
    c = segment_costs(m, seq, layer)
    pc = policy_cost(m, policy, seq, layer)
    full = sum(c.fwd_flops) + sum(c.fwd_hbm_bytes) * flops_per_hbm_byte
    return (pc.recompute_flops + pc.recompute_hbm_bytes * flops_per_hbm_byte) / full
