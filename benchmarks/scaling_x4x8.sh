#!/usr/bin/env bash
# Issue 7, ready to run on a lent nvidia-h200-x4 or nvidia-h200-x8 (not lent so far): profile the
# machine, then weak and strong scaling of Qwen3-8B and Qwen3-14B at sequence 4096 over 1, 2, 4
# (and 8) GPUs, and the four routes at a host-bound and a GPU-bound batch, each launch writing a
# JSONL that `slidedp validate --import-results` turns into validation cases (add a [[source]]
# per file to validation/imports.toml, hardware = the profile written here, traces = the
# file's .traces folder: each case's last step, measured).
#
#   usage (from the repository root, on the device): bash benchmarks/scaling_x4x8.sh 4|8 OUTDIR
#   device budget: ~6 min per model at R = 4 (8 steps per case); split the calls by model
#   (MODELS=qwen3-8b ...). A CPU dry run of the plumbing (gloo ranks, no profile):
#   DEVICE=cpu SEQ=32 MODELS=tiny-qwen3 bash benchmarks/scaling_x4x8.sh 4 /tmp/x
# Window = every layer (36 for 8B, 40 for 14B): the fastest measured setting on the 2x machine.
# Projections for the same cases: benchmarks/RESULTS.md ("Projected: 4 and 8 GPUs").
set -euo pipefail
R=$1
OUT=$2
MODELS=${MODELS:-"qwen3-8b qwen3-14b"}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-4096}
RANKS="2 4"
[ "$R" = 8 ] && RANKS="2 4 8"
export PYTHONPATH=${PYTHONPATH:-}:$PWD
mkdir -p "$OUT"
[ "$DEVICE" = cpu ] || python3 -m slidedp.cli profile --out "$OUT/h200x$R-profile.toml" \
    --base "h200x$R" --model qwen3-8b qwen3-14b --micro-batch 1 4 --quick
run=(benchmarks/multi_gpu.py --device "$DEVICE" --seq "$SEQ")
for model in $MODELS; do
    W=window_slots=$(python3 -c "from slidedp.spec.model import load_model as m; print(m('$model').n_layers)")
    G="sharded:gpu:rank0:$W"
    # one GPU: the reference, weak-scaling base (per-GPU batch 8) and strong-scaling base (global 32)
    ref=(ref:4)
    [ "$DEVICE" = cpu ] && ref=()  # the resident reference needs CUDA
    python3 "${run[@]}" "$OUT/$model-r1.jsonl" "$model" "${ref[@]}" "8:4:$G" "32:4:$G" \
        --iters 6 --discard 2 --traces "$OUT/$model-r1.traces"
    for r in $RANKS; do
        cases=("$((8 * r)):4:$G" "32:4:$G")
        if [ "$r" = "$R" ]; then  # the four routes, host-bound (mb 1) and GPU-bound (per-GPU 8)
            for route in sharded:gpu replicated:gpu sharded:cpu replicated:cpu; do
                cases+=("$r:1:$route:rank0:$W")
                [ "$route" = sharded:gpu ] || cases+=("$((8 * r)):4:$route:rank0:$W")
            done
        fi
        python3 -m torch.distributed.run --standalone --nproc-per-node "$r" "${run[@]}" \
            "$OUT/$model-r$r.jsonl" "$model" "${cases[@]}" --iters 8 --discard 4 \
            --traces "$OUT/$model-r$r.traces"
    done
done
