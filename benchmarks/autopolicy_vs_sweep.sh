#!/usr/bin/env bash
# Issue 8 on one GPU: AutoPolicy's choice (with real probes) against an exhaustive real sweep of a
# small candidate grid, in one device call, plus the per-policy layer timings.
#   usage (repository root, on nvidia-h200): bash benchmarks/autopolicy_vs_sweep.sh OUTDIR [MODEL MB SEQ]
# Writes OUTDIR/plan.toml + plan.txt (the choice, its report and selection time),
# OUTDIR/sweep.jsonl (benchmarks/multi_gpu.py rows: the grid, the default plan and the chosen one),
# OUTDIR/policy_layers.json (one decoder layer per policy: ms and retained GiB).
set -euo pipefail
OUT=$1
MODEL=${2:-qwen3-4b}
MB=${3:-4}
SEQ=${4:-4096}
HW=${HW:-benchmarks/results/2026-11-30-h200-profile.toml}
DEVICE=${DEVICE:-cuda}  # cpu: a dry run of the plumbing (e.g. MODEL tiny-qwen3, SEQ 32)
CAP=${CAP:-}  # GiB: AutoPolicy's --gpu-memory-cap-gib (default: the whole GPU); the sweep's grid
              # is not capped: compare the choice with the swept plans whose GPU peak fits the cap
export PYTHONPATH=${PYTHONPATH:-}:$PWD
mkdir -p "$OUT" && rm -f "$OUT/sweep.jsonl"
L=$(python3 -c "from slidedp.spec.model import load_model as m; print(m('$MODEL').n_layers)")
python3 benchmarks/policy_layers.py "$OUT/policy_layers.json" --model "$MODEL" --micro-batch "$MB" \
    --seq "$SEQ" --device "$DEVICE" || echo "policy_layers failed"
/usr/bin/time -f "selection wall %e s" python3 -m slidedp.cli plan --hardware "$HW" --model "$MODEL" \
    --gpus 1 --seq "$SEQ" --micro-batch "$MB" --probe --device "$DEVICE" --out "$OUT/plan.toml" \
    ${CAP:+--gpu-memory-cap-gib "$CAP"} \
    2>&1 | tee "$OUT/plan.txt"
SAC=$(python3 -c "print('layer_policies=' + str(['sac'] * $L).replace(' ', '').replace(\"'\", '\"'))")
grid=()
for w in 3 "$L"; do
    for c in 64.0 256.0; do
        for act in activation_policy=\"layer\" "$SAC"; do
            grid+=("$MB:$MB:sharded:gpu:rank0:window_slots=$w:h2d_chunk_mib=$c:d2h_chunk_mib=$c:$act")
        done
    done
done
python3 benchmarks/multi_gpu.py "$OUT/sweep.jsonl" "$MODEL" --seq "$SEQ" --device "$DEVICE" "$MB:$MB:plan=$OUT/plan.toml" \
    "${grid[@]}" --iters 6 --discard 2
