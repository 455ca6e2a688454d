#!/usr/bin/env bash
# The device command of benchmarks/peers.py (issue 27 item 4), run from the repository root on the
# GPU machine with the wheels carried in .whl (liger-kernel, deepspeed and what they need; made by
# ../shared/tools/device-wheels.sh --peers):
#   bash benchmarks/peers_gpu.sh MODEL MICRO_BATCHES TOTAL_S [peers.py run options ...]
#     e.g. bash benchmarks/peers_gpu.sh qwen3-4b 4 560
#          bash benchmarks/peers_gpu.sh qwen3-8b 4 560
# 1. installs the wheels into /tmp/site (PYTHONPATH=/tmp/site:$PWD);
# 2. checks liger-kernel against eager transformers on this GPU: a decoder layer of each family
#    through the executor (policies layer and sac) and HEAD_LOSS, against an FP32 reference
#    (tests/test_fused_kernels_gpu.py); its output goes to $OUT/kernels-check.txt (CHECK=0 skips it,
#    e.g. on a later call of the same lease);
# 3. runs peers.py for MODEL at the comma-separated MICRO_BATCHES with what is left of TOTAL_S
#    (seconds from the start of this script) as its budget; $OUT/peers.json, peers.md, peers.log.
set -uo pipefail
if (( $# < 3 )); then
  echo "usage: bash benchmarks/peers_gpu.sh MODEL MICRO_BATCHES TOTAL_S [peers.py run options]" >&2
  exit 2
fi
model=$1; mbs=${2//,/ }; total=$3; shift 3
out=${OUT:?set OUT to the output folder}
start=$SECONDS
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
echo "wheels installed in $((SECONDS - start)) s"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
if [[ ${CHECK:-1} != 0 ]]; then
  python3 -m pytest -q -m gpu -o addopts="" -p no:cacheprovider tests/test_fused_kernels_gpu.py \
    2>&1 | tee "$out/kernels-check.txt"
  echo "kernel check done at $((SECONDS - start)) s"
fi
left=$((total - (SECONDS - start)))
# shellcheck disable=SC2086  # the micro-batches are separate arguments
python3 benchmarks/peers.py run --model "$model" --micro-batch $mbs --out "$out" \
  --budget-s "$left" "$@" 2>&1 | tee "$out/peers.log"
echo "done at $((SECONDS - start)) s"
