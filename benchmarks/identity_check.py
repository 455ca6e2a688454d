"""Refactoring check: a commit must leave the model's figures and the CPU training bit-identical.

Snapshots (1) the analytic and simulated step times of a fixed set of stored validation cases on
their own profiles and of preset what-ifs that exercise every plan feature, and (2) the losses and a
hash of the final parameters of short CPU training runs, one per plan feature (1 and 2 ranks), as
exact hex floats. `--base REV` checks out REV in a temporary worktree, snapshots both trees with
the same Python and compares them; any difference is printed and the exit code is 1.

    python benchmarks/identity_check.py --base HEAD~1        # this tree against its parent
    python benchmarks/identity_check.py --snapshot out.json  # one tree only
    python benchmarks/identity_check.py --quick ...          # the simulations only (about a minute)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# stored cases: the first (by name) of each (GPUs, plan, profile) signature in the archive


# preset what-ifs: (hardware, model, seq, gpus, global batch, micro-batch, plan overrides)
WHAT_IFS = [
    ("h200x1", "qwen3-4b", 4096, 1, 4, 4, {}),
    ("h200x1", "qwen3-4b", 4096, 1, 4, 4, {"defer_update": True}),
    ("h200x1", "qwen3-4b", 4096, 1, 4, 4, {"embedding_rows": True}),
    ("h200x1", "qwen3-4b", 4096, 1, 4, 4, {"grad_widen": "host"}),
    ("h200x1", "qwen3-4b", 4096, 1, 4, 4, {"host_bf16_copy": True}),
    ("h200x1", "qwen3-8b", 4096, 1, 4, 2, {"layer_policies": ("sac",) * 36, "offload_ratio": 0.5}),
    ("h200x2", "qwen3-8b", 4096, 2, 8, 4, {}),
    ("h200x2", "qwen3-8b", 4096, 2, 8, 4, {"param_route": "replicated", "grad_route": "cpu"}),
    ("h200x2", "qwen3-8b", 4096, 2, 8, 4, {"update_sharding": "sharded", "update_workers": 2}),
    ("a800x4-nobridge", "qwen3-14b", 1024, 4, 64, 16, {"param_route": "replicated"}),
    ("a800x4-nobridge", "qwen3-14b", 1024, 4, 64, 16, {"param_route": "sharded"}),
    ("a800x8", "qwen3-14b", 1024, 8, 256, 32, {"h2d_chunk_mib": 64, "d2h_chunk_mib": 64}),
    ("h100x8", "qwen3-14b", 4096, 8, 16, 2, {"embedding_rows": True, "window_slots": 4}),
    ("rtx4090x4", "qwen3-8b", 2048, 4, 8, 2, {"param_route": "replicated", "grad_route": "cpu"}),
]

# CPU training runs: extra `slidedp train` options (tiny preset, 4 steps)
TRAIN_RUNS = [
    [], ["--grad-clip", "0.05"], ["--embedding-rows"], ["--grad-widen", "host"],
    ["--plan", "{policies}", "--offload-ratio", "0.5"], ["--host-bf16-copy"],
    ["--nproc", "2"], ["--nproc", "2", "--param-route", "replicated", "--grad-route", "cpu"],
    ["--nproc", "2", "--update-sharding", "sharded", "--grad-clip", "0.05"],
]
# per-layer activation policies for the tiny preset's layers, with offload (`{policies}` above)
POLICIES_PLAN = '[plan]\nlayer_policies = ["sac", "seg:0b1010101"]\n'
TRAIN_BASE = ["--steps", "4", "--global-batch", "8", "--micro-batch", "2", "--device", "cpu",
              "--warmup-steps", "1"]


def stored_case_dirs() -> list[Path]:
    """The first stored case (by name) of each signature: GPUs, plan fields but the chunk
    sizes, and the hardware file it was predicted on."""
    from slidedp.spec.plan import plan_dict
    from slidedp.validate import store

    seen, out = set(), []
    for d in sorted((ROOT / "validation").iterdir()):
        if not (d / "predicted.json").is_file():
            continue
        case = store.read_case(d)
        plan = {k: v for k, v in plan_dict(case.plan).items() if not k.endswith("chunk_mib")}
        ref = store.read_json(d / "predicted.json")["hardware"]
        sig = json.dumps([case.gpus, plan, ref.get("file")], sort_keys=True)
        if sig not in seen:
            seen.add(sig)
            out.append(d)
    return out


def plan_fields(plan) -> dict:
    from dataclasses import fields

    return {f.name: getattr(plan, f.name) for f in fields(plan)}


def sim_figures() -> dict:
    from slidedp.model.predict import predict
    from slidedp.sim.simulator import simulate
    from slidedp.spec.errors import InfeasiblePlan, SpecError
    from slidedp.spec.hardware import load_hardware
    from slidedp.spec.model import load_model
    from slidedp.spec.plan import Plan, default_plan
    from slidedp.spec.workload import Workload
    from slidedp.validate import store

    out = {}

    def both(key, hw, wl, plan):
        try:
            p = predict(hw, wl, plan)
            s = simulate(hw, wl, plan, check_memory=False)
            out[key] = [p.step_time_s.hex(), p.lower_bound_s.hex(), s.step_time_s.hex(),
                        float(s.exposed_s).hex()]
        except (SpecError, InfeasiblePlan) as e:
            out[key] = f"error: {e}"

    for d in stored_case_dirs():
        ref = store.read_json(d / "predicted.json")["hardware"]
        hw, _ = store.hardware_ref(store.hardware_arg(ref, d), d)
        case = store.read_case(d)
        both(f"case {d.name}", hw, case.workload(), case.plan)
    for hw_name, model, seq, gpus, gb, mb, over in WHAT_IFS:
        hw = load_hardware(hw_name)
        wl = Workload(load_model(model), seq, gb, mb, gpus)
        plan = Plan(**{**plan_fields(default_plan(hw.fabric.kind)), **over})
        both(f"what-if {hw_name} {model} {seq} {gpus} {gb} {mb} {sorted(over.items())}", hw, wl,
             plan)
    return out


def train_figures(work: Path) -> dict:
    out = {}
    for i, extra in enumerate(TRAIN_RUNS):
        d = work / f"run{i}"
        plan = work / "policies.toml"
        plan.write_text(POLICIES_PLAN)
        args = [a.replace("{policies}", str(plan)) for a in extra]
        cmd = [sys.executable, "-m", "slidedp.cli", "train", "--out", str(d), *TRAIN_BASE, *args]
        r = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        key = " ".join(extra) or "default"
        if r.returncode != 0:
            out[key] = f"exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}"
            continue
        rows = [json.loads(x) for x in (d / "metrics.jsonl").read_text().splitlines()]
        h = hashlib.blake2b(digest_size=16)
        for f in sorted((d / "final").glob("*.safetensors")):
            h.update(f.read_bytes())
        out[key] = {"loss": [float(r["loss"]).hex() for r in rows],
                    "grad_norm": [float(r["grad_norm"]).hex() for r in rows],
                    "final": h.hexdigest()}
    return out


def snapshot(quick: bool) -> dict:
    data = {"sim": sim_figures()}
    if not quick:
        with tempfile.TemporaryDirectory() as tmp:
            data["train"] = train_figures(Path(tmp))
    return data


def compare(a: dict, b: dict, names=("base", "this")) -> list[str]:
    diffs = []
    for section in sorted(set(a) | set(b)):
        x, y = a.get(section, {}), b.get(section, {})
        for key in sorted(set(x) | set(y)):
            if x.get(key) != y.get(key):
                diffs.append(f"{section} | {key}\n  {names[0]}: {x.get(key)}\n"
                             f"  {names[1]}: {y.get(key)}")
    return diffs


def snapshot_of(tree: Path, quick: bool) -> dict:
    """Snapshot `tree` in a subprocess that imports slidedp from it."""
    env = dict(os.environ, PYTHONPATH=str(tree), SLIDEDP_SIM_WORKERS="0")
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--snapshot", f.name]
        subprocess.run(cmd + (["--quick"] if quick else []), check=True, env=env, cwd=tree)
        return json.loads(Path(f.name).read_text())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", help="a git revision to compare this tree against")
    ap.add_argument("--snapshot", help="write this tree's snapshot (JSON) here and stop")
    ap.add_argument("--quick", action="store_true", help="the simulations only")
    args = ap.parse_args(argv)
    if args.snapshot:
        Path(args.snapshot).write_text(json.dumps(snapshot(args.quick), indent=1, sort_keys=True))
        return 0
    if not args.base:
        ap.error("give --base REV or --snapshot FILE")
    with tempfile.TemporaryDirectory() as tmp:
        base_tree = Path(tmp) / "base"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach",
                        str(base_tree), args.base], check=True)
        try:
            a = snapshot_of(base_tree, args.quick)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(base_tree)], check=False)
    b = snapshot_of(ROOT, args.quick)
    diffs = compare(a, b, (args.base, "this tree"))
    n = sum(len(v) for v in b.values())
    for d in diffs:
        print(d)
    print(f"{len(diffs)} of {n} figures differ from {args.base}" if diffs
          else f"identical: {n} figures equal to {args.base}'s")
    return 1 if diffs else 0


if __name__ == "__main__":
    sys.exit(main())
