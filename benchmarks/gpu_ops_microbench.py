"""Microbenchmarks of the operations a decoder layer is made of, for [gpu.ops] (spec/gpu_ops.py).

Never a whole layer: each kind alone, at the shapes the layers of the given models have.
  gemm        every (M, N, K) of spec/gpu_ops.layer_ops, as nn.Linear runs it (forward x W^T,
              dX = dY W, dW = dY^T X): 2 M N K / median CUDA-event time of `--repeats` after a
              warm-up; the reference 8192^3 product the same way, and sustained: back to back
              for `--sustain-s` seconds after as long a warm load (clocks under power limits)
  copy        a device-to-device copy of 1 GiB: bytes read + written / time
  elementwise transformers' eager ops (Qwen3RMSNorm, apply_rotary_pos_emb, SiLU(g) * u, a + b)
              forward and backward at each layer's widths: the bytes spec/gpu_ops.ELEMENTWISE
              counts / time, over the copy rate: elementwise_fraction by kind
  attention   causal SDPA with GQA (is_causal, enable_gqa, HF's layout), forward and backward,
              FLOPs as spec/gpu_ops.layer_ops counts them / time, with torch's default backend
              and with each backend it can force (flash, cudnn)
Prints one JSON object and a [gpu.ops] fragment to paste (with this command and the date as
each number's source). `--device cpu --quick` runs tiny shapes on the CPU (a smoke test).

  python benchmarks/gpu_ops_microbench.py out.json --model qwen3-4b qwen3-8b qwen3-14b
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time

import torch

from slidedp.spec.gpu_ops import ELEMENTWISE, layer_ops
from slidedp.spec.model import load_model

BF16 = torch.bfloat16


def timed_s(fn, device: str, warmup: int, repeats: int) -> float:
    """Median seconds of fn() after `warmup` calls (CUDA events on a GPU, wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def gemm_rate(shape, device, warmup, repeats, op) -> float:
    """FLOP/s of one product of `shape` (M, N, K) as the linear's `op` runs it."""
    M, N, K = shape
    if op == "fwd":  # y[M, N] = x[M, K] W[N, K]^T
        a, b = torch.randn(M, K, dtype=BF16, device=device), torch.randn(N, K, dtype=BF16,
                                                                         device=device)
        fn = lambda: torch.nn.functional.linear(a, b)  # noqa: E731
    elif op == "dX":  # dX[M, N] = dY[M, K] W[K, N]
        a, b = torch.randn(M, K, dtype=BF16, device=device), torch.randn(K, N, dtype=BF16,
                                                                         device=device)
        fn = lambda: a @ b  # noqa: E731
    else:  # dW[M, N] = dY[K, M]^T X[K, N]
        a, b = torch.randn(K, M, dtype=BF16, device=device), torch.randn(K, N, dtype=BF16,
                                                                         device=device)
        fn = lambda: a.t() @ b  # noqa: E731
    return 2.0 * M * N * K / timed_s(fn, device, warmup, repeats)


def sustained_rate(n: int, device: str, seconds: float) -> float:
    """FLOP/s of back-to-back n^3 products over `seconds`, after as long a warm load."""
    a, b = torch.randn(n, n, dtype=BF16, device=device), torch.randn(n, n, dtype=BF16,
                                                                     device=device)
    rate = 0.0
    for _ in range(2):  # warm load, then the timed one
        count, t = 0, time.perf_counter()
        while time.perf_counter() - t < seconds:
            for _ in range(8):
                a @ b
            count += 8
            if device == "cuda":
                torch.cuda.synchronize()
        rate = 2.0 * n**3 * count / (time.perf_counter() - t)
    return rate


def copy_rate(device: str, nbytes: int, warmup: int, repeats: int) -> float:
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2.0 * nbytes / timed_s(lambda: dst.copy_(src), device, warmup, repeats)


def elementwise_fractions(models, micro_batch, seq, device, warmup, repeats, copy_bps) -> dict:
    """kind -> (bytes of forward + backward by ELEMENTWISE["eager"]) / time / copy rate, over
    every model's widths (the eager transformers ops)."""
    from transformers.activations import ACT2FN
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm, apply_rotary_pos_emb

    out: dict[str, list[float]] = {k: [] for k in ELEMENTWISE["eager"]}
    T = micro_batch * seq
    for m in models:
        h, f, d = m.hidden, m.ffn, m.head_dim

        def run(kind, inputs, fn, width):
            xs = [x.detach().requires_grad_() for x in inputs]
            y = fn(*xs)
            y = y if isinstance(y, tuple) else (y,)
            grads = [torch.randn_like(t) for t in y]
            fwd = timed_s(lambda: fn(*xs), device, warmup, repeats)
            bwd = timed_s(lambda: torch.autograd.backward(fn(*xs), grads), device, warmup,
                          repeats) - fwd
            fb, _, bb, _ = ELEMENTWISE["eager"][kind]
            out[kind].append((fb + bb) * T * width / (fwd + bwd) / copy_bps)

        norm = Qwen3RMSNorm(h).to(device, BF16)
        run("rmsnorm", [torch.randn(micro_batch, seq, h, dtype=BF16, device=device)], norm, h)
        q = torch.randn(micro_batch, seq, m.n_heads, d, dtype=BF16, device=device)
        k = torch.randn(micro_batch, seq, m.n_kv_heads, d, dtype=BF16, device=device)
        cos = torch.randn(micro_batch, seq, d, dtype=BF16, device=device)
        sin = torch.randn(micro_batch, seq, d, dtype=BF16, device=device)
        run("rope", [q.transpose(1, 2), k.transpose(1, 2)],
            lambda a, b, c=cos, s=sin: apply_rotary_pos_emb(a, b, c, s),
            (m.n_heads + m.n_kv_heads) * d)
        act = ACT2FN["silu"]
        g, u = (torch.randn(micro_batch, seq, f, dtype=BF16, device=device) for _ in range(2))
        run("swiglu", [g, u], lambda a, b, silu=act: silu(a) * b, f)
        x, r = (torch.randn(micro_batch, seq, h, dtype=BF16, device=device) for _ in range(2))
        run("residual", [x, r], lambda a, b: a + b, h)
    return {k: round(statistics.median(v), 3) for k, v in out.items()}


def attention_rates(m, micro_batch, seq, device, warmup, repeats) -> dict:
    """backend -> (forward FLOP/s, backward FLOP/s) of causal GQA SDPA in HF's layout."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    d, nq, nkv = m.head_dim, m.n_heads, m.n_kv_heads
    q = torch.randn(micro_batch, seq, nq, d, dtype=BF16, device=device).transpose(1, 2)
    k = torch.randn(micro_batch, seq, nkv, d, dtype=BF16, device=device).transpose(1, 2)
    v = torch.randn_like(k)
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    flops = 2.0 * nq * d * seq * micro_batch * seq

    def fwd():
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)

    grad = torch.randn_like(fwd())
    choices = {"default": None}
    if device == "cuda":
        choices |= {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}
    out = {}
    for name, backend in choices.items():
        try:
            ctx = sdpa_kernel([backend]) if backend is not None else _null()
            with ctx:
                f_s = timed_s(fwd, device, warmup, repeats)
                fb_s = timed_s(lambda: fwd().backward(grad), device, warmup, repeats)
            out[name] = [round(flops / f_s / 1e12, 1), round(2.5 * flops / (fb_s - f_s) / 1e12, 1)]
        except RuntimeError as e:  # a backend that cannot run this call
            out[name] = f"unavailable: {str(e).splitlines()[0][:120]}"
    return out


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", help="JSON file to write")
    ap.add_argument("--model", nargs="+", default=["qwen3-4b", "qwen3-8b", "qwen3-14b"])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, nargs="+", default=[1, 4, 16])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--sustain-s", type=float, default=3.0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a CPU smoke test)")
    args = ap.parse_args(argv)
    dev, warm, rep = args.device, 2, args.repeats
    models = [load_model(n) for n in args.model]
    ref = 8192
    if args.quick:
        args.seq, args.micro_batch, ref, args.sustain_s = 64, [1], 128, 0.05
        models = [load_model("tiny-qwen3")]
    shapes = {}
    for m in models:
        for b in args.micro_batch:
            for op in layer_ops(m, args.seq, b):
                if op.kind == "gemm":
                    kind = "fwd" if op.phase == "fwd" else op.name.split()[-1]
                    shapes[op.shape] = kind
    gemm = [[*s, round(gemm_rate(s, dev, warm, rep, kind) / 1e12, 1)]
            for s, kind in sorted(shapes.items())]
    copy_bps = copy_rate(dev, 2**20 if args.quick else 2**30, warm, rep)
    out = {
        "command": " ".join(sys.argv), "date": datetime.date.today().isoformat(),
        "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu",
        "torch": torch.__version__,
        "cudnn": torch.backends.cudnn.version() if dev == "cuda" else None,
        "gemm_ref": [ref, ref, ref, round(gemm_rate((ref,) * 3, dev, warm, rep, "dX") / 1e12, 1)],
        "gemm_ref_sustained_tflops": round(sustained_rate(ref, dev, args.sustain_s) / 1e12, 1),
        "gemm_measured": gemm,
        "copy_gbps": round(copy_bps / 1e9, 1),
        "elementwise_fraction": elementwise_fractions(models, args.micro_batch[0], args.seq, dev,
                                                      warm, rep, copy_bps),
        "attention_tflops": {f"{m.name} b{b}": attention_rates(m, b, args.seq, dev, warm, rep)
                             for m in models for b in args.micro_batch[:2]},
    }
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=1)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
