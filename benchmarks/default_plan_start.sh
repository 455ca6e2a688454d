#!/usr/bin/env bash
# What the default plan of `slidedp train` costs at start on a GPU machine (docs/autopolicy.md,
# section 6): the same run twice on an empty cache, then with `--plan auto` for the step it
# should match. Run from the repository root, PYTHONPATH set:
#   [MODEL=qwen3-4b SEQ=4096 MB=4 STEPS=12 RUNS="cold warm auto"] bash benchmarks/default_plan_start.sh OUT
# RUNS: which of the three to run, in order (cold empties the cache first; warm and auto without
# cold keep OUT/cache from an earlier call on the same machine).
# OUT/cold.log, OUT/warm.log, OUT/auto.log: each run's output; OUT/summary.txt: the plan lines,
# each run's wall seconds from start to end, and the mean step of
# steps 6 to STEPS (metrics.jsonl step_time_s) of the three runs.
# The cold run's "chosen in X s (profile measured in P s ...; plan simulated in S s)" line is
# the cold start (<= 60 s wanted); the warm run's "chosen in" (a few seconds wanted) says
# "profile cached" and "plan cached".
set -euo pipefail
out=${1:?usage: default_plan_start.sh OUT}
model=${MODEL:-qwen3-4b} seq=${SEQ:-4096} mb=${MB:-4} steps=${STEPS:-12}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export XDG_CACHE_HOME="$out/cache"  # an empty cache of this run's own
runs=${RUNS:-cold warm auto}
for name in $runs; do rm -rf "$out/run-$name"; done
[[ " $runs " == *" cold "* ]] && rm -rf "$XDG_CACHE_HOME"
python - "$out/tok.npy" "$model" "$seq" "$((mb * steps))" <<'EOF'
import sys

import numpy as np

from slidedp.spec.model import load_model

path, model, seq, rows = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
rng = np.random.default_rng(0)
np.save(path, rng.integers(0, load_model(model).vocab_size, (rows, seq), dtype=np.int32))
EOF
run() {  # run NAME [extra options]: time the run, keep its output
  local name=$1; shift
  local t0; t0=$(date +%s.%N)
  python -m slidedp.cli train --model "$model" --data "$out/tok.npy" --seq "$seq" \
    --global-batch "$mb" --micro-batch "$mb" --steps "$steps" --lr 1e-5 \
    --out "$out/run-$name" "$@" > "$out/$name.log" 2>&1 && rc=0 || rc=$?
  echo "$name: $(python -c "import time; print(f'{time.time() - $t0:.1f}')") s wall, exit $rc" \
    >> "$out/summary.txt"
}
: > "$out/summary.txt"
for name in $runs; do
  if [[ $name == auto ]]; then run auto --plan auto; else run "$name"; fi
done
for name in $runs; do
  {
    echo "== $name"
    grep -E '^plan|^  (simulated|chosen in|GPU-bound|host-bound|kept as given)' "$out/$name.log" || true
    python - "$out/run-$name/metrics.jsonl" <<'EOF'
import json
import sys
from pathlib import Path

path = Path(sys.argv[1])
rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] if path.exists() else []
rows = [r for r in rows if "step_time_s" in r and r.get("step", 0) >= 6]
if rows:
    print(f"mean step of steps {rows[0]['step']}-{rows[-1]['step']}: "
          f"{sum(r['step_time_s'] for r in rows) / len(rows):.3f} s")
EOF
  } >> "$out/summary.txt"
done
cat "$out/summary.txt"
