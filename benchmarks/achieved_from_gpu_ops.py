"""Write the `achieved` table of hardware presets whose GPU nobody profiled from gpu_ops.

A preset without measured layers (no [[gpu.layer_time]] rows of its own) prices a layer, the LM
head and a recompute's matmuls by its [gpu] achieved table (graph/rates.py). For such a preset
this script replaces that table by spec/gpu_ops.reference_achieved_rows of the file's own
[gpu.ops] (the REFERENCE_MODELS layers at REFERENCE_SEQ, eager kernels) and the [gpu] source by
one saying so; every other line of the file is kept. The rows are data in the file, so
`slidedp hardware show` and a diff show them, and tests/test_hardware_presets.py fails when
gpu_ops moves them until this script is run again.

usage: python3 benchmarks/achieved_from_gpu_ops.py [PRESET ...]   (default: every preset with a
       [gpu.ops] table and no measured layer times)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from slidedp.spec.gpu_ops import (  # noqa: E402
    REFERENCE_MICRO_BATCHES,
    REFERENCE_MODELS,
    REFERENCE_SEQ,
    reference_achieved_rows,
)
from slidedp.spec.hardware import hardware_presets, load_hardware, preset_dir  # noqa: E402

SOURCE = (f"derived: spec/gpu_ops.py from this file's [gpu.ops] (benchmarks/achieved_from_gpu_ops"
          f".py): one decoder layer's fwd + bwd by kind of operation, eager kernels, the layers of "
          f"{', '.join(REFERENCE_MODELS)} at seq {REFERENCE_SEQ} and micro-batches "
          f"{', '.join(map(str, REFERENCE_MICRO_BATCHES))}; counted FLOPs "
          f"(ModelSpec.layer_flops_per_token) / that time")
COMMENT = ("# [hidden, tokens per micro-batch, achieved TFLOP/s] of one decoder layer fwd + bwd "
           "(seq 4096),\n# computed by spec/gpu_ops.py (see the [gpu] source)\n")
SOURCED = ("count", "hbm_gib", "hbm_gbps", "peak_bf16_tflops")  # the rest of [gpu]'s numbers


def unprofiled_presets() -> list[str]:
    """Presets with a [gpu.ops] table and no measured layer time."""
    return [p for p in hardware_presets()
            if (hw := load_hardware(p)).gpu.ops is not None and not hw.gpu.layer_times]


def rewritten(text: str, name: str) -> str:
    """The preset's text with its achieved table, the comment above it and the [gpu] source
    replaced (module docstring)."""
    hw = load_hardware(name)
    missing = [k for k in SOURCED if hw.gpu.sources[k] == hw.gpu.sources["achieved"]]
    if missing or hw.gpu.layer_times:
        raise SystemExit(f"{name}: [gpu] {', '.join(missing) or 'layer_time'} would take the "
                         f"achieved table's source; give them sources of their own first")
    rows = reference_achieved_rows(hw.gpu)
    by_hidden: dict[int, list[str]] = {}
    for h, tokens, tflops in rows:
        by_hidden.setdefault(h, []).append(f"[{h}, {tokens}, {tflops:g}]")
    table = "achieved = [\n" + "".join(f"  {', '.join(r)},\n" for r in by_hidden.values()) + "]\n"
    gpu = re.search(r"^\[gpu\]\n(.*?)(?=^\[)", text, flags=re.M | re.S)
    block = gpu.group(1)
    block, n1 = re.subn(r"^source = \".*\"\n", lambda _: f'source = "{SOURCE}"\n', block,
                        flags=re.M)
    block, n2 = re.subn(r"^(#[^\n]*\n)*achieved = \[\n.*?^\]\n", lambda _: COMMENT + table, block,
                        flags=re.M | re.S)
    if (n1, n2) != (1, 1):
        raise SystemExit(f"{name}: expected one [gpu] source and one achieved table")
    return text[:gpu.start(1)] + block + text[gpu.end(1):]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("presets", nargs="*", help="preset names (default: every unprofiled one)")
    names = ap.parse_args(argv).presets or unprofiled_presets()
    for name in names:
        path = preset_dir() / f"{name}.toml"
        path.write_text(rewritten(path.read_text(), name))
        print(f"{path}: {len(load_hardware(name).gpu.achieved)} achieved rows from gpu_ops")


if __name__ == "__main__":
    main()
