"""One decoder layer per activation policy, timed by the executor's own code.

For a model (a preset name or a config.json), a micro-batch and a sequence length, runs
slidedp.exec.policy_profile.profile_layer_policy for every policy asked for (forward, recompute,
backward of layer 1 as the engine runs it, what it keeps in a KeptActivations with the offload
ratio given) and prints, per policy: ms of forward, recompute, backward and their sum, retained
GiB, the difference to 'layer' (ms; negative = faster than 'layer'), the recompute fraction the
analytic model predicts (slidedp.spec.segments.recompute_fraction with FLOPs and HBM bytes weighted
alike: a rough order, not a GPU figure) and, on CUDA, the allocated retained / transient peak GiB.
Writes everything as JSON to OUT.

CUDA runs in BF16, the CPU in FP32 (unless --dtype). --set KEY=VALUE overrides config.json
fields (e.g. --set hidden_size=1024 --set intermediate_size=3072 to cut a preset).

usage: PYTHONPATH=$PWD python benchmarks/policy_layers.py OUT.json [--model qwen3-0.6b]
         [--micro-batch 1] [--seq 512] [--device cpu|cuda] [--dtype float32|bfloat16]
         [--repeats 3] [--offload-ratio 0] [--policies layer,none,sac,seg:0b0000000,...]
         [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import torch

from slidedp.exec.policy_profile import profile_layer_policy
from slidedp.spec.model import parse_hf_config, preset_dir
from slidedp.spec.segments import parse_policy, recompute_fraction

GIB = 2**30
DEFAULT_POLICIES = ("layer", "none", "sac", "seg:0b0000000", "seg:0b0000001", "seg:0b0100000",
                    "seg:0b0100100", "seg:0b0001101", "seg:0b0101110", "seg:0b0111111",
                    "seg:0b1111111")


def load_config(model: str, sets: list[str]) -> dict:
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        p = preset_dir() / f"{model}.json"
    cfg = json.loads(p.read_text())
    for kv in sets:
        key, _, value = kv.partition("=")
        try:
            cfg[key] = json.loads(value)
        except json.JSONDecodeError:
            cfg[key] = value  # a bare string
    cfg["num_hidden_layers"] = 1  # only layer 1 is built for real (the rest stays on meta)
    return cfg


def _code_sha256() -> str:
    """SHA-256 over slidedp's sources and presets and this script (path and content, sorted):
    which code measured, where the device's copy of the tree carries stale git metadata (a
    `git rev-parse` there named an older commit on 2026-12-01)."""
    h = hashlib.sha256()
    root = Path(__file__).resolve().parents[1]
    files = [f for f in (root / "slidedp").rglob("*")
             if f.is_file() and f.suffix in (".py", ".json", ".toml")]
    for f in sorted([*files, Path(__file__).resolve()]):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--offload-ratio", type=float, default=0.0)
    ap.add_argument("--policies", default=",".join(DEFAULT_POLICIES))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    dtype = getattr(torch, a.dtype or ("bfloat16" if dev.type == "cuda" else "float32"))
    cfg = load_config(a.model, a.set)
    spec = parse_hf_config(cfg, a.model)
    policies = [parse_policy(p.strip(), "--policies", "policy").name
                for p in a.policies.split(",") if p.strip()]
    if "layer" not in policies:
        policies.insert(0, "layer")
    rows, t_start = {}, time.perf_counter()
    for name in policies:
        prof = profile_layer_policy(cfg, name, a.micro_batch, a.seq, device=dev, dtype=dtype,
                                    offload_ratio=a.offload_ratio, repeats=a.repeats)
        rows[name] = {
            "fwd_ms": prof.fwd_s * 1e3, "recompute_ms": prof.recompute_s * 1e3,
            "bwd_ms": prof.bwd_s * 1e3, "total_ms": prof.compute_s * 1e3,
            "retained_gib": prof.retained_bytes / GIB,
            "retained_alloc_gib": (None if prof.retained_alloc_bytes is None
                                   else prof.retained_alloc_bytes / GIB),
            "transient_peak_gib": (None if prof.transient_peak_bytes is None
                                   else prof.transient_peak_bytes / GIB),
            "offload_gib": prof.offload_bytes / GIB,
            "model_recompute_fraction": recompute_fraction(spec, name, a.seq, 1.0),
        }
    ref = rows["layer"]["total_ms"]
    for r in rows.values():
        r["vs_layer_ms"] = r["total_ms"] - ref
    head = (f"{a.model} {' '.join(a.set)} | hidden {spec.hidden} ffn {spec.ffn} | micro-batch "
            f"{a.micro_batch} x seq {a.seq} | {dev} {str(dtype).removeprefix('torch.')} | "
            f"offload r={a.offload_ratio} | median of {a.repeats}")
    print(head)
    print(f"{'policy':15s} {'fwd':>8s} {'recomp':>8s} {'bwd':>8s} {'total':>8s} {'vs layer':>9s} "
          f"{'retained':>9s} {'model':>6s}" + (f" {'alloc':>7s} {'transient':>9s}"
                                                 if dev.type == "cuda" else ""))
    print(f"{'':15s} {'ms':>8s} {'ms':>8s} {'ms':>8s} {'ms':>8s} {'ms':>9s} {'GiB':>9s} "
          f"{'recomp':>6s}" + (f" {'GiB':>7s} {'GiB':>9s}" if dev.type == "cuda" else ""))
    for name, r in rows.items():
        line = (f"{name:15s} {r['fwd_ms']:8.2f} {r['recompute_ms']:8.2f} {r['bwd_ms']:8.2f} "
                f"{r['total_ms']:8.2f} {r['vs_layer_ms']:+9.2f} {r['retained_gib']:9.4f} "
                f"{r['model_recompute_fraction']:6.2f}")
        if dev.type == "cuda":
            line += f" {r['retained_alloc_gib']:7.3f} {r['transient_peak_gib']:9.3f}"
        print(line)
    result = {
        "date": date.today().isoformat(), "code_sha256": _code_sha256(), "host": platform.node(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor(),
        "torch": torch.__version__, "threads": torch.get_num_threads(),
        "command": " ".join(sys.argv), "model": a.model, "overrides": a.set,
        "micro_batch": a.micro_batch, "seq": a.seq, "dtype": str(dtype),
        "offload_ratio": a.offload_ratio, "repeats": a.repeats,
        "wall_s": time.perf_counter() - t_start, "policies": rows,
    }
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out} ({result['wall_s']:.1f} s)")
    return result


if __name__ == "__main__":
    main()
