"""`slidedp hardware list`, `slidedp hardware show` and `slidedp model list`: the built-in presets."""

from __future__ import annotations

import argparse

from slidedp.commands import hardware_show
from slidedp.spec.hardware import hardware_presets, load_hardware
from slidedp.spec.model import load_model, model_presets
from slidedp.spec.units import GIB


def register(sub) -> None:
    for noun, fn in (("hardware", list_hardware), ("model", list_models)):
        p = sub.add_parser(noun, help=f"{noun} presets")
        verbs = p.add_subparsers(dest="verb", required=True)
        verbs.add_parser("list", help=f"list the {noun} presets").set_defaults(func=fn)
        if noun == "hardware":
            hardware_show.register(verbs)


def list_hardware(args: argparse.Namespace) -> int:
    print(f"{'name':<18}{'GPUs':>5}  {'GPU':<22}{'HBM GiB':>8}{'H2D GB/s':>9}{'fabric':>14}"
          f"{'cores':>6}{'RAM GiB':>8}{'sockets':>8}{'switches':>9}")
    for n in hardware_presets():
        h = load_hardware(n)
        t = h.topology
        print(f"{n:<18}{h.gpu.count:>5}  {h.gpu.model:<22}{h.gpu.hbm_bytes / GIB:>8.0f}"
              f"{h.pcie.h2d_bps / 1e9:>9.1f}{h.fabric.kind:>14}{h.host.cores:>6}"
              f"{h.host.ram_bytes / GIB:>8.0f}{len(t.sockets):>8}{len(t.switches):>9}")
    return 0


def list_models(args: argparse.Namespace) -> int:
    print(f"{'name':<20}{'family':<11}{'layers':>7}{'hidden':>7}{'params':>10}{'per layer':>11}{'tied':>6}")
    for n in model_presets():
        m = load_model(n)
        print(f"{n:<20}{m.family:<11}{m.n_layers:>7}{m.hidden:>7}{m.total_params() / 1e9:>9.2f}B"
              f"{m.layer_params() / 1e6:>10.0f}M{'yes' if m.tie_embeddings else 'no':>6}")
    return 0
