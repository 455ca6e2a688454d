#!/usr/bin/env bash
# Compact Adam moments (plan.moments, issue 32) on one H200 (16 cores, 125 GiB host RAM), each
# case one device call within the 10-minute limit, from the repository root, PYTHONPATH=$PWD:
#   bash benchmarks/moments_gpu.sh rate OUT     # ~3 min: the CPU update with FP32 / BF16 / int8
#                                               #   moments at 4-16 threads, 256M parameters,
#                                               #   and int8 by block size at 12 threads
#   bash benchmarks/moments_gpu.sh 8b OUT       # ~6 min: Qwen3-8B mb 4 seq 4096, FP32 against
#                                               #   int8 moments (the same run), and the
#                                               #   compute-only reference
#   bash benchmarks/moments_gpu.sh 14b OUT      # ~8 min: Qwen3-14B mb 4 seq 4096 with int8
#                                               #   moments (FP32 moments do not fit 125 GiB):
#                                               #   tokens/s, host PSS per B params, the ratio to
#                                               #   the compute-only reference
#   bash benchmarks/moments_gpu.sh profile OUT  # ~5 min: `slidedp profile --quick` (with the
#                                               #   new host.adam_{bf16,int8}_moments rows), then
#                                               #   `slidedp predict` of the 14B case on it
# ITERS=N (default 8; the mean of the steps after the first half) shortens 8b and 14b where the
# `rate` case shows a slow int8 update (a step of 14B updates 14.8G parameters). Each prints a table; the JSON files under OUT hold every figure. single_gpu.py runs the
# executor on a random-weight host state (no checkpoint, no export: what `slidedp train
# --no-checkpoint` runs between its start and final/), the steady-state step = mean of the steps
# after --discard.
set -euo pipefail
what=$1
OUT=$2
mkdir -p "$OUT"
ITERS=${ITERS:-8}
DISCARD=$((ITERS / 2))
case "$what" in
rate)
    python3 benchmarks/moments_rate.py --params 256e6 --threads 4,8,12,16 --repeats 3 \
        --json "$OUT/moments-rate.json"
    for block in 262144 1048576 4194304; do
        python3 benchmarks/moments_rate.py --params 256e6 --threads 12 --repeats 3 \
            --formats fp32,int8 --compact-block "$block" --json "$OUT/moments-rate-$block.json"
    done ;;
8b)
    python3 benchmarks/single_gpu.py "$OUT/8b-moments.json" qwen3-8b:4 --bf16-copy off \
        --moments fp32,int8 --iters "$ITERS" --discard "$DISCARD" ;;
14b)
    python3 benchmarks/single_gpu.py "$OUT/14b-int8.json" qwen3-14b:4 --bf16-copy off \
        --moments int8 --iters "$ITERS" --discard "$DISCARD" ;;
profile)
    python3 -m slidedp.cli profile --out "$OUT/h200-moments-profile.toml" --base h200x1 \
        --model qwen3-14b --micro-batch 4 --quick --name "h200-moments-$(date +%H%M)"
    python3 -m slidedp.cli predict --hardware "$OUT/h200-moments-profile.toml" \
        --model qwen3-14b --seq 4096 --micro-batch 4 --moments int8 ;;
*)
    echo "usage: $0 rate|8b|14b|profile OUT" >&2
    exit 2 ;;
esac
