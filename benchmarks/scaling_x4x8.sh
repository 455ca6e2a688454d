#!/usr/bin/env bash
# Issue 7 on a lent nvidia-h200-x4 or nvidia-h200-x8: weak and strong scaling of Qwen3-8B and
# Qwen3-14B at sequence 4096 over 1, 2, 4 (and 8) GPUs, and the four routes at a host-bound and a
# GPU-bound batch; each launch writes a JSONL that `slidedp validate --import-results` turns into
# validation cases (a [[source]] per file in validation/imports.toml, hardware = the profile
# written here, traces = the file's .traces folder: each case's last step, measured).
#
#   usage (repository root, on the device): bash benchmarks/scaling_x4x8.sh 4|8 OUTDIR
#   STAGES (default "profile scale routes"), MODELS (default "qwen3-8b qwen3-14b") and RANKS
#   (default "1 2 4", with 8 on x8) pick what one device call runs (each call has 10 minutes):
#     STAGES="profile scale" MODELS=qwen3-8b ...   # profile; weak 1 -> 2 -> R, strong 2 -> R
#     STAGES=routes MODELS=qwen3-8b ...            # the four routes at R, host- and GPU-bound
#   A CPU dry run of the plumbing (gloo ranks, no profile, no reference):
#   DEVICE=cpu SEQ=32 MODELS=tiny-qwen3 bash benchmarks/scaling_x4x8.sh 4 /tmp/x
# Weak scaling: 8 sequences per GPU (global batch 8R, micro-batch 4); strong scaling: global
# batch 32 at R = 2, 4 (and 8) (R = 1 would take ~20 s a step: its point comes from weak scaling's
# per-GPU rate). Window = every layer (36 for 8B, 40 for 14B): the fastest measured setting on the
# 2x machine. Projections for the same cases: benchmarks/results/2026-11-30-projected-x4-x8.md.
set -euo pipefail
R=$1
OUT=$2
MODELS=${MODELS:-"qwen3-8b qwen3-14b"}
STAGES=${STAGES:-"profile scale routes"}
DEVICE=${DEVICE:-cuda}
SEQ=${SEQ:-4096}
ALL_RANKS="1 2 4"
[ "$R" != 8 ] || ALL_RANKS="1 2 4 8"
RANKS=${RANKS:-$ALL_RANKS}
ITERS=${ITERS:-"--iters 7 --discard 3"}
export PYTHONPATH=${PYTHONPATH:-}:$PWD
mkdir -p "$OUT"
has() { [[ " $STAGES " == *" $1 "* ]]; }
if has profile && [ "$DEVICE" != cpu ]; then
    python3 -m slidedp.cli profile --out "$OUT/h200x$R-profile.toml" --base "h200x$R" \
        --model $MODELS --micro-batch 1 4 --quick --name "h200x$R-profile-$(date +%H%M)"
fi
launch() {  # launch RANKS OUTFILE MODEL CASE... : one process (R = 1) or torchrun
    local r=$1 out=$2 model=$3
    shift 3
    local run=(benchmarks/multi_gpu.py --device "$DEVICE" --seq "$SEQ" $ITERS --traces "$out.traces")
    if [ "$r" = 1 ]; then
        python3 "${run[@]}" "$out.jsonl" "$model" "$@"
    else
        python3 -m torch.distributed.run --standalone --nproc-per-node "$r" "${run[@]}" \
            "$out.jsonl" "$model" "$@"
    fi
}
for model in $MODELS; do
    W=window_slots=$(python3 -c "from slidedp.spec.model import load_model as m; print(m('$model').n_layers)")
    G="sharded:gpu:rank0:$W"
    if has scale; then
        for r in $RANKS; do
            cases=("$((8 * r)):4:$G")
            if [ "$r" = 1 ]; then
                [ "$DEVICE" = cpu ] || cases=(ref:4 "${cases[@]}")  # the reference needs CUDA
            elif [ $((8 * r)) != 32 ]; then
                cases+=("32:4:$G")
            fi
            launch "$r" "$OUT/$model-r$r" "$model" "${cases[@]}"
        done
    fi
    if has routes; then  # the four routes at R: host-bound (mb 1) and GPU-bound (8 per GPU)
        cases=()
        for route in sharded:gpu replicated:gpu sharded:cpu replicated:cpu; do
            cases+=("$R:1:$route:rank0:$W")
            [ "$route" = sharded:gpu ] && has scale || cases+=("$((8 * R)):4:$route:rank0:$W")
        done
        launch "$R" "$OUT/$model-routes-r$R" "$model" "${cases[@]}"
    fi
done
