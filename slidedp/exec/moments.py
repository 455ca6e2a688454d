"""Compact Adam moments: m and v kept in FP32, BF16 or block-wise 8-bit, and the chunk update that
reads, dequantizes, steps and requantizes them (plan.moments; the FP32 master is never compact).

Formats (bytes per parameter for m and v together):
  fp32  8      the moments as torch.optim.AdamW keeps them (adamw.adamw_chunk on them directly)
  bf16  4      each moment rounded to BF16 (round to nearest even) after every update
  int8  2.03   the bitsandbytes block-wise scheme: blocks of QBLOCK = 256 elements, each with
               its FP32 absolute maximum (absmax); an element is the index of the nearest value
               of the 256-entry dynamic map (signed for m, unsigned for v; dynamic_map) to
               x / absmax (ties to the lower entry). Dequantized: map[q] x absmax.
A block never straddles two units: a unit's moments start on a block boundary of their own
(host_state.py pads the int8 arrays per unit), and every update chunk of a unit starts on one
(graph/features/compact_moments.py aligns the gradient chunks to QBLOCK).

The update of a chunk goes COMPACT_BLOCK elements at a time through per-thread FP32 scratch:
dequantize m and v, widen the gradient if narrower (times the clip coefficient), apply torch's
fused AdamW (adamw._fused: the FP32 path's own kernel, so the arithmetic is the FP32 path's) to the
master and the scratch moments, requantize. Host memory sees the compact moments read and written
once, the scratch stays in the cores' caches.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from slidedp.exec.adamw import AdamWConfig, _fused, adamw_chunk
from slidedp.spec.elements import MOMENT_QBLOCK as QBLOCK  # bitsandbytes' optimizers' block

COMPACT_BLOCK = 1 << 20  # elements dequantized, stepped and requantized at a time (a multiple of
# QBLOCK): each of the ~30 torch ops per block splits it among the update team's threads and joins
# them, so a block must be large against that cost (on 2 busy cores, 1 thread: 1 << 18 and 1 << 20
# ran alike, 2 threads: 1 << 20 fastest; benchmarks/moments_rate.py --compact-block sweeps it)
ABSMAX_FLOOR = 1e-38  # divisor of an all-zero block (its elements quantize to the map's zero)
FORMATS = ("fp32", "bf16", "int8")
STORED_DTYPE = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.uint8}
_scratch = threading.local()


def dynamic_map(signed: bool) -> torch.Tensor:
    """The 256 sorted values of bitsandbytes' dynamic quantization map (create_dynamic_map with
    7 exponent bits, 8 bits in all): for exponent e = 0..6, 2^e (signed) or 2^(e+1) (unsigned)
    linear fractions between 0.1 and 1 scaled by 10^(e-6), their negatives when signed, then 0
    and 1, zero-filled to 256 values."""
    values: list[float] = []
    for e in range(7):
        items = (2 ** e if signed else 2 ** (e + 1)) + 1
        edges = torch.linspace(0.1, 1, items, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        values += (10.0 ** (e - 6) * mids).tolist()  # scaled in FP32, as bitsandbytes does
        if signed:
            values += (-(10.0 ** (e - 6)) * mids).tolist()
    values += [0.0, 1.0]
    values += [0.0] * (256 - len(values))
    return torch.tensor(sorted(values), dtype=torch.float32)


@dataclass(frozen=True)
class QuantMap:
    """A dynamic map, the midpoints between its neighbours, and the tables that find the nearest
    entry in constant time.

    The nearest entry to x is the number of midpoints below x (torch.bucketize's answer, which
    takes a binary search per element: ~100 ns each on a CPU, slower than the whole AdamW).
    Instead: the FP32 numbers that round to one BF16 value b (x.to(bfloat16), round to nearest
    even: a vectorized cast) form an interval with at most one midpoint inside (QuantMap.of
    checks it), so the count is base[b] (midpoints below the interval) plus (x > bound[b]) (the
    midpoint inside, +inf if none): two table look-ups and a comparison, bucketize's answer for
    every finite x."""

    signed: bool  # unsigned: for values never negative (v), whose max |x| is their max
    code: torch.Tensor
    bounds: torch.Tensor
    base: torch.Tensor  # int32 [65536], by BF16 bits: midpoints below its interval
    bound: torch.Tensor  # FP32 [65536], by BF16 bits: the midpoint inside, +inf if none

    @classmethod
    def of(cls, signed: bool) -> QuantMap:
        code = dynamic_map(signed)
        bounds = (code[:-1] + code[1:]) / 2
        lo, hi = rounding_intervals()
        inside = (bounds.view(1, -1) >= lo.view(-1, 1)) & (bounds.view(1, -1) < hi.view(-1, 1))
        if int(inside.sum(1).max()) > 1:
            raise ValueError("a quantization map with two midpoints in one BF16 interval")
        base = torch.bucketize(lo, bounds, out_int32=True)  # midpoints < lo
        bound = torch.where(inside.any(1), torch.where(inside, bounds, 0).sum(1), torch.inf)
        return cls(signed, code, bounds, base, bound.float())


def rounding_intervals() -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) FP32 [65536] by BF16 bit pattern b: the least and the greatest FP32 number that
    rounds to b (round to nearest, ties to even: a magnitude whose low 16 bits are 0x8000 goes to
    the even one of its two BF16 neighbours; Inf holds the finite numbers that round to it). The
    NaN patterns get empty intervals."""
    b = torch.arange(1 << 16, dtype=torch.int64)
    mag, neg = b & 0x7FFF, b >= 0x8000
    even = (mag & 1) == 0
    first = torch.where(mag == 0, 0, ((mag - 1) << 16) + 0x8000 + (~even).long())
    last = ((mag << 16) + 0x7FFF + even.long()).clamp_max(0x7F7FFFFF)  # Inf: from the largest
    small, large = (t.to(torch.int32).view(torch.float32) for t in (first, last))
    lo, hi = torch.where(neg, -large, small), torch.where(neg, -small, large)
    nan = mag > 0x7F80
    return torch.where(nan, torch.inf, lo), torch.where(nan, -torch.inf, hi)


SIGNED, UNSIGNED = QuantMap.of(True), QuantMap.of(False)  # m's map, v's map


def blocks(n: int) -> int:
    """Quantization blocks of n elements."""
    return -(-n // QBLOCK)


@dataclass
class MomentSpan:
    """The stored m and v of elements [lo, hi) of one unit (lo on a block boundary for int8),
    with their blocks' absmax for int8 (None otherwise)."""

    fmt: str
    m: torch.Tensor
    v: torch.Tensor
    m_absmax: torch.Tensor | None = None
    v_absmax: torch.Tensor | None = None

    def adamw(self, param: torch.Tensor, grad: torch.Tensor, step: int, cfg: AdamWConfig,
              lr: float, clip: float = 1.0) -> None:
        """AdamW of FP32 `param` from `grad` (FP32 or narrower) times `clip` when below 1, with
        these moments read and written in their format (module docstring)."""
        if self.fmt == "fp32":
            adamw_chunk(param, grad, self.m, self.v, step, cfg, lr, clip)
            return
        s = _thread_scratch()
        for lo in range(0, len(param), COMPACT_BLOCK):
            hi = min(len(param), lo + COMPACT_BLOCK)
            k = hi - lo
            m, v = s.m[:k], s.v[:k]
            self._load(lo, hi, m, v, s)
            if grad.dtype == torch.float32 and clip >= 1.0:
                g = grad[lo:hi]
            else:
                g = s.g[:k]
                g.copy_(grad[lo:hi])
                if clip < 1.0:
                    g.mul_(clip)
            _fused(param[lo:hi], g, m, v, step, cfg, lr)
            self._store(lo, hi, m, v, s)

    def _load(self, lo: int, hi: int, m: torch.Tensor, v: torch.Tensor, s) -> None:
        if self.fmt == "bf16":
            m.copy_(self.m[lo:hi])
            v.copy_(self.v[lo:hi])
            return
        b0, b1 = lo // QBLOCK, blocks(hi)
        dequantize(self.m[lo:hi], self.m_absmax[b0:b1], SIGNED, m, s.idx)
        dequantize(self.v[lo:hi], self.v_absmax[b0:b1], UNSIGNED, v, s.idx)

    def _store(self, lo: int, hi: int, m: torch.Tensor, v: torch.Tensor, s) -> None:
        if self.fmt == "bf16":
            self.m[lo:hi].copy_(m)
            self.v[lo:hi].copy_(v)
            return
        b0, b1 = lo // QBLOCK, blocks(hi)
        quantize(m, SIGNED, self.m[lo:hi], self.m_absmax[b0:b1], s)
        quantize(v, UNSIGNED, self.v[lo:hi], self.v_absmax[b0:b1], s)


def dequantize(q: torch.Tensor, absmax: torch.Tensor, qmap: QuantMap, out: torch.Tensor,
               idx: torch.Tensor) -> None:
    """out = qmap.code[q] x the absmax of each element's block (idx: int32 scratch)."""
    n = len(q)
    i = idx[:n]
    i.copy_(q)
    torch.index_select(qmap.code, 0, i, out=out)
    _per_block(out, absmax, torch.Tensor.mul_)


def quantize(x: torch.Tensor, qmap: QuantMap, q_out: torch.Tensor, absmax_out: torch.Tensor,
             s) -> None:
    """absmax_out = each block's max |x| (max |x| = max x for v, which is never negative);
    q_out = the index of the nearest map entry to x / absmax (QuantMap: as torch.bucketize on
    the midpoints). Divides x in place (it is scratch), as the thread's scratch `s`."""
    idx, s_low = s.idx, s.low
    n = len(x)
    full = n - n % QBLOCK
    if full:
        rows, out = x[:full].view(-1, QBLOCK), absmax_out[:full // QBLOCK]
        torch.amax(rows, dim=1, out=out)
        if qmap.signed:
            low = s_low[:full // QBLOCK]
            torch.amin(rows, dim=1, out=low)
            torch.maximum(out, low.neg_(), out=out)
    if n > full:
        absmax_out[-1] = x[full:].abs().max()
    _per_block(x, absmax_out.clamp_min(ABSMAX_FLOOR), torch.Tensor.div_)
    key, rounded, count, bound, above = (idx[:n], s.rounded[:n], s.count[:n], s.bound[:n],
                                         s.above[:n])
    rounded.copy_(x)  # to BF16
    key.copy_(rounded.view(torch.int16))
    key.bitwise_and_(0xFFFF)  # the BF16 bits (sign-extended by the widening)
    torch.index_select(qmap.base, 0, key, out=count)
    torch.index_select(qmap.bound, 0, key, out=bound)
    torch.gt(x, bound, out=above)
    count.add_(above)
    q_out.copy_(count)


def _per_block(x: torch.Tensor, per_block: torch.Tensor, op) -> None:
    """op(x's elements, their block's value) in place, the last block possibly partial."""
    n = len(x)
    full = n - n % QBLOCK
    if full:
        op(x[:full].view(-1, QBLOCK), per_block[:full // QBLOCK].view(-1, 1))
    if n > full:
        op(x[full:], per_block[-1])


def _thread_scratch():
    s = _scratch
    if getattr(s, "m", None) is None:
        s.m, s.v, s.g = (torch.empty(COMPACT_BLOCK, dtype=torch.float32) for _ in range(3))
        s.idx, s.count = (torch.empty(COMPACT_BLOCK, dtype=torch.int32) for _ in range(2))
        s.bound = torch.empty(COMPACT_BLOCK, dtype=torch.float32)
        s.rounded = torch.empty(COMPACT_BLOCK, dtype=torch.bfloat16)
        s.above = torch.empty(COMPACT_BLOCK, dtype=torch.bool)
        s.low = torch.empty(COMPACT_BLOCK // QBLOCK, dtype=torch.float32)
    return s
