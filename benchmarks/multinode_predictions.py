"""Predicted and simulated steps of 2, 4 and 8 nodes of h200x8 and a800x8 over 400 and 100 Gb/s
NICs, for both inter-node reductions (slidedp/sim/internode_study.py): a markdown table.

    python benchmarks/multinode_predictions.py OUT.md

Each row equals `slidedp predict` / `slidedp simulate --hardware HW --model qwen3-8b
--micro-batch 4 --nodes K --nic-gbps G --internode-reduce R` (predicted_s, simulated_s). CPU only.
"""

from __future__ import annotations

import sys
from pathlib import Path

from slidedp.sim.internode_study import node_scaling
from slidedp.spec.hardware import load_hardware

HARDWARE = ("h200x8", "a800x8")
NODES = [2, 4, 8]
NIC_GBPS = [50.0, 12.5]  # 400 Gb/s and 100 Gb/s, per direction
MODEL, MICRO_BATCH = "qwen3-8b", 4


def main(out: Path) -> None:
    lines = ["| hardware | nodes | NIC | reduction | predicted s | simulated s | one node s | "
             "exposed s | NIC busy s | GB sent per NIC |", "|" + " --- |" * 10]
    for hw in HARDWARE:
        df = node_scaling(hw, MODEL, NODES, NIC_GBPS, micro_batch=MICRO_BATCH)
        for r in df.itertuples():
            lines.append(f"| {hw} | {r.nodes} | {r.nic_gbit_per_s:g} Gb/s | {r.reduce} | "
                         f"{r.predicted_s:.3f} | {r.simulated_s:.3f} | {r.one_node_s:.3f} | "
                         f"{r.exposed_s:+.3f} | {r.nic_busy_s:.3f} | {r.nic_bytes / 1e9:.1f} |")
    sources = [f"- {hw}: `[network]` of its preset: {load_hardware(hw).network.sources['nic_gbps']}"
               for hw in HARDWARE]
    out.write_text("\n".join(lines) + "\n\nNIC rates: 400 Gb/s = 50 GB/s and 100 Gb/s = 12.5 GB/s"
                   " per direction (`--nic-gbps`); the presets' defaults:\n" + "\n".join(sources)
                   + "\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
