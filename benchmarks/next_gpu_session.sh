#!/usr/bin/env bash
# What the 2026-11-30 sessions left unmeasured, as device calls that each fit the 10-minute limit
# (run from the repository root on the device, PYTHONPATH set as the device README says):
#   bash benchmarks/next_gpu_session.sh x2 OUT        # nvidia-h200-x2: profile, Qwen3-8B R=1 and R=2
#                                                      #   in one call, with the fixed per-agent
#                                                      #   OpenMP teams (engine.own_omp_team) against
#                                                      #   the split the earlier runs really had
#   bash benchmarks/next_gpu_session.sh 14b OUT       # nvidia-h200-x2: Qwen3-14B R=1 and R=2 (issue 5)
#   bash benchmarks/next_gpu_session.sh 8b-gb32 OUT   # nvidia-h200-x2: Qwen3-8B strong scaling at
#                                                      #   global batch 32, R=2 routes at 16:4
#   bash benchmarks/next_gpu_session.sh loss OUT      # any H200: 200-step BF16 loss vs resident
#   bash benchmarks/next_gpu_session.sh h200 OUT      # nvidia-h200: profile + the 4B GPU-bound cases
#                                                      #   with and without embedding_rows, then the
#                                                      #   validation cases of cases-h200-4b.toml
#   bash benchmarks/next_gpu_session.sh h200-rows OUT # nvidia-h200: 4B mb 4-8, embedding_rows with the
#                                                      #   tied bulk spread over the backward; loss run
#   [MODEL=qwen3-4b] bash benchmarks/next_gpu_session.sh x2-val OUT  # nvidia-h200-x2: profile,
#                                                      #   the cast under load, MODEL's validation
#                                                      #   cases, 1:1 with 12 + 18 teams
#   bash benchmarks/next_gpu_session.sh h200-ratio OUT # nvidia-h200: profile, issue 4's ratio at mb 5/6/8
#   bash benchmarks/next_gpu_session.sh h200-val OUT   # nvidia-h200, after h200-ratio: the 4B
#                                                      #   validation cases, the 8B selection time
#   bash benchmarks/next_gpu_session.sh h200-widen OUT # nvidia-h200: BF16 gradient downloads (GPU
#                                                      #   tests, profile, 4B ratio host vs gpu widen)
#   HW=PROFILE [MODEL=qwen3-8b] bash benchmarks/next_gpu_session.sh ap OUT [MB SEQ]  # AutoPolicy vs sweep
#   bash benchmarks/next_gpu_session.sh ap-confirm OUT DIR  # an `ap` result DIR's deciding rows
#                                                      #   again by the protocol (confirm_sweep.py)
#   bash benchmarks/next_gpu_session.sh probe-state OUT  # any H200: a probe's host state (a few
#                                                      #   layers of memory) against the whole one:
#                                                      #   build seconds, step time of 4B mb 1 and 4
#   bash benchmarks/next_gpu_session.sh adam-llc OUT  # any H200: Adam and the host sum on just-
#                                                      #   downloaded chunks against cold ones
#   bash benchmarks/next_gpu_session.sh mem-kind OUT  # any H200: the host kernels on /dev/shm
#                                                      #   against anonymous memory
#   bash benchmarks/next_gpu_session.sh chunk-cost OUT # the executor's per-chunk cast cost: a profile,
#                                                      #   the cast under each load, GIL switch interval
#   bash benchmarks/next_gpu_session.sh rows OUT      # nvidia-h200-x2: 8B, embedding_rows on / off
#   bash benchmarks/next_gpu_session.sh x4 OUT        # nvidia-h200-x4: profile (with dram_dma_gbps),
#                                                      #   the 8B routes at R = 4 again (the host.mem
#                                                      #   model on its own profile), 14B at R = 2
#   bash benchmarks/next_gpu_session.sh h200-drift OUT # nvidia-h200 (~8 min): two default profiles
#                                                      #   and the host-bound 4B cases between them
#   bash benchmarks/next_gpu_session.sh h200-update OUT # nvidia-h200 (~6 min): per-chunk AdamW on
#                                                      #   host-state memory by gradient source, around
#                                                      #   the worst host-bound 4B case
#   bash benchmarks/next_gpu_session.sh h200-threads OUT # nvidia-h200 (~4 min): per-chunk AdamW at
#                                                      #   8 / 12 / 16 threads against the executor's
#                                                      #   update at each team size (4B mb 2)
#   bash benchmarks/next_gpu_session.sh h200-matrix OUT GLOB [BUDGET_S] # nvidia-h200: the
#                                                      #   matrix cases matching GLOB by the protocol
#                                                      #   on this lease's profile, within BUDGET_S
# Left after the 2026-12-02 02:58-03:26 calls (the 12-configuration h200 matrix on one profile
# with the teams by chunk size: simulated 2.3% mean, 6.4% max; benchmarks/RESULTS.md), in order:
# `x2-val` when nvidia-h200-x2 is lent (issue 6: the x2 matrix on a profile with the DMA weight
# and the teams by chunk size; then `MODEL=qwen3-4b x2-val`), `MODEL=qwen3-8b ap 4` and
# `ap-confirm` on the x2 (issue 8 on the second kind); `x4` / x8 when lent (issue 7); on any
# H200, why a 64 MiB D2H takes ~2.5 ms against 1.2 ms alone (the widening and norm kernels queued
# on the copy stream behind the backward?). The GPU tasks' issue time is measured in the traces
# and left unmodelled (it hides under the update here: RESULTS.md).
# `slidedp validate` here keeps the 2026-11-30 step counts (6 steps, mean of 4-6, one run: the
# protocol's 15 / 8 / 2 runs, its defaults, would not fit a 10-minute call).
# Each writes JSONL / JSON / TOML under OUT: keep OUT to a few files (the device tool returns only
# a few; tar anything larger), then import with `slidedp validate --import-results`.
set -euo pipefail
what=$1
OUT=$2
mkdir -p "$OUT"
G="sharded:gpu:rank0"
case "$what" in
x2)  # nvidia-h200-x2, one call: profile, Qwen3-8B R = 1 (reference, weak/strong scaling points)
    # and R = 2 (the same global batches): scaling ratios from one run. The 16:21 call of
    # 2026-11-30 also ran the thread splits (cast_threads / update_threads plan fields).
    python3 -m slidedp.cli profile --out "$OUT/h200x2-profile.toml" --base h200x2 \
        --model qwen3-8b qwen3-14b --micro-batch 1 4 8 --quick --name "h200x2-profile-$(date +%H%M)"
    python3 benchmarks/multi_gpu.py "$OUT/8b-r1.jsonl" qwen3-8b ref:4 "4:4:$G:window_slots=36" \
        "8:4:$G:window_slots=36" "16:4:$G:window_slots=36" --iters 6 --discard 3
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/multi_gpu.py \
        "$OUT/8b-r2.jsonl" qwen3-8b "16:4:$G:window_slots=36" "8:4:$G:window_slots=36" \
        --iters 6 --discard 3 ;;
14b)  # nvidia-h200-x2, one call: Qwen3-14B R = 1 and R = 2 (issue 5): weak = R1 8:4 vs R2 16:4,
    # strong = R1 16:4 vs R2 16:4
    python3 benchmarks/multi_gpu.py "$OUT/14b-r1.jsonl" qwen3-14b ref:4 "8:4:$G:window_slots=40" \
        "16:4:$G:window_slots=40" --iters 5 --discard 2
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/multi_gpu.py \
        "$OUT/14b-r2.jsonl" qwen3-14b "16:4:$G:window_slots=40" --iters 5 --discard 2 ;;
8b-gb32)  # nvidia-h200-x2, one call: strong scaling of Qwen3-8B at global batch 32 (R = 1 and 2)
    # and the R = 2 routes at 16:4 with the current executor
    python3 benchmarks/multi_gpu.py "$OUT/8b-gb32-r1.jsonl" qwen3-8b "32:4:$G:window_slots=36" \
        --iters 5 --discard 2
    python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/multi_gpu.py \
        "$OUT/8b-gb32-r2.jsonl" qwen3-8b "32:4:$G:window_slots=36" \
        "16:4:replicated:gpu:rank0:window_slots=36" "16:4:sharded:cpu:rank0:window_slots=36" \
        "16:4:replicated:cpu:rank0:window_slots=36" --iters 5 --discard 2 ;;
loss)
    python3 benchmarks/loss_vs_resident.py "$OUT/loss-vs-resident.json" --model qwen3-0.6b \
        --steps 200 --seq 1024 --micro-batch 2 --accum 2 ;;
h200)  # nvidia-h200, one call: profile v3, the 4B GPU-bound batches with and without
    # embedding_rows beside the references (issue 4), then the host-bound / two-chunk validation
    # cases on the profile just measured (issue 6)
    python3 -m slidedp.cli profile --out "$OUT/h200-profile-v3.toml" --base h200x1 \
        --model qwen3-4b --micro-batch 1 2 4 6 8 --quick --name "h200-profile-$(date +%H%M)"
    # the same profile again: how far two profiles of one lease differ (host rates varied by up
    # to 31% between leases of this kind on 2026-11-30; 25 s)
    python3 -m slidedp.cli profile --out "$OUT/h200-profile-again.toml" --base h200x1 \
        --model qwen3-4b --micro-batch 4 --quick --name "h200-profile-again-$(date +%H%M)"
    python3 benchmarks/multi_gpu.py "$OUT/h200-4b.jsonl" qwen3-4b ref:6 ref:8 \
        "6:6:$G:window_slots=36" "6:6:$G:window_slots=36:embedding_rows=true" \
        "8:8:$G:window_slots=36" "8:8:$G:window_slots=36:embedding_rows=true" --iters 8 --discard 3
    python3 -m slidedp.cli validate --hardware "$OUT/h200-profile-v3.toml" \
        --cases validation/cases-h200-4b.toml --machine nvidia-h200 --out "$OUT/val" \
        --iters 6 --discard 3 --runs 1 ;;
x2-val)  # nvidia-h200-x2, one call: profile (the teams at once with the cast's share, the teams
    # with DMA), the cast of a chunk under each load (chunk_cost_probe.py), the
    # host-bound 1:1 case of MODEL (default qwen3-8b) with the default teams (24 + 24 on 32 cores:
    # oversubscribed while the backward's casts and updates run together) against 12 + 18, then
    # MODEL's validation cases (validation/cases-h200x2-{8b,4b}.toml: host-bound and GPU-bound,
    # both routes of each kind, 64 and 256 MiB chunks, 1 and 2 GPUs; issue 6)
    M=${MODEL:-qwen3-8b}
    python3 -m slidedp.cli profile --out "$OUT/h200x2-profile.toml" --base h200x2 \
        --model qwen3-4b qwen3-8b --micro-batch 1 4 --quick --name "h200x2-profile-$(date +%H%M)"
    python3 benchmarks/probes/chunk_cost_probe.py "$OUT/chunk-cost-probe.json"
    CUDA_VISIBLE_DEVICES=0 python3 benchmarks/multi_gpu.py "$OUT/teams-1-1.jsonl" "$M" "1:1:$G" \
        "1:1:$G:cast_threads=12:update_threads=18" --iters 6 --discard 3
    python3 -m slidedp.cli validate --hardware "$OUT/h200x2-profile.toml" \
        --cases "validation/cases-h200x2-${M#qwen3-}.toml" --machine nvidia-h200-x2 --out "$OUT/val" \
        --iters 6 --discard 3 --runs 1 ;;
h200-rows)  # nvidia-h200, one call: the 4B smallest GPU-bound micro-batch with the tied bulk
    # spread over the backward (embedding_rows), beside the references, and the 200-step loss run
    python3 benchmarks/multi_gpu.py "$OUT/h200-4b-rows.jsonl" qwen3-4b ref:4 ref:5 ref:6 ref:8 \
        "4:4:$G:window_slots=36:embedding_rows=true" "5:5:$G:window_slots=36" \
        "5:5:$G:window_slots=36:embedding_rows=true" "6:6:$G:window_slots=36" \
        "6:6:$G:window_slots=36:embedding_rows=true" "8:8:$G:window_slots=36:embedding_rows=true" \
        --iters 8 --discard 3
    python3 benchmarks/loss_vs_resident.py "$OUT/loss-vs-resident.json" --model qwen3-0.6b \
        --steps 200 --seq 1024 --micro-batch 2 --accum 2 ;;
h200-ratio)  # nvidia-h200, one call (~9 min): a profile of this lease (Qwen3-4B and -8B layers;
    # kept in .devkeep/ for the next call on the same machine), then issue 4's ratio by the
    # protocol (10 steps, mean of 6-10, two runs in alternating order) at micro-batches 5, 6 and 8
    # with embedding_rows: on a slow-host lease mb 5 is still host-bound (2026-12-01 04:21), and the
    # issue asks for the ratio at the smallest GPU-bound micro-batch of the machine at hand
    mkdir -p .devkeep
    timeout 200 python3 -m slidedp.cli profile --out "$OUT/h200-profile.toml" --base h200x1 \
        --model qwen3-4b qwen3-8b --micro-batch 1 2 4 5 6 8 --quick --name "h200-profile-$(date +%H%M)" \
        && cp "$OUT/h200-profile.toml" .devkeep/
    R="$G:window_slots=36:embedding_rows=true"
    timeout 380 python3 benchmarks/multi_gpu.py "$OUT/h200-4b-ratio.jsonl" qwen3-4b ref:5 "5:5:$R" \
        ref:6 "6:6:$R" ref:8 "8:8:$R" "8:8:$R" ref:8 "6:6:$R" ref:6 "5:5:$R" ref:5 \
        --iters 10 --discard 5 || echo "ratio runs stopped at the time limit" ;;
h200-val)  # nvidia-h200 (~8 min): the h200 4B validation cases on the profile h200-ratio kept on
    # this lease, or on a fresh one (issue 6: the first GPU check of the modelled dispatch gaps),
    # then AutoPolicy's selection time at 8B with the probes' shared-layer host state (issue 8;
    # `slidedp plan --probe` only, no sweep)
    P=.devkeep/h200-profile.toml
    [ -f "$P" ] || { mkdir -p .devkeep; python3 -m slidedp.cli profile --out "$P" --base h200x1 \
        --model qwen3-4b qwen3-8b --micro-batch 1 2 4 --quick --name "h200-profile-$(date +%H%M)" \
        || { echo "profile failed: the stored 02:05 profile instead"; rm -f "$P"; \
             cp benchmarks/results/2026-12-01-h200-profile-0205.toml "$P"; }; }
    cp "$P" "$OUT/h200-profile-used.toml"
    timeout 200 python3 -m slidedp.cli validate --hardware "$P" --cases validation/cases-h200-4b.toml \
        --machine nvidia-h200 --out "$OUT/val" --iters 6 --discard 3 --runs 1 || echo "validate stopped"
    /usr/bin/time -f "selection wall %e s" timeout 150 python3 -m slidedp.cli plan --hardware "$P" \
        --model qwen3-8b --gpus 1 --seq 4096 --micro-batch 4 --probe --device cuda \
        --out "$OUT/plan-8b-mb4.toml" 2>&1 | tee "$OUT/plan-8b-mb4.txt" || true ;;
h200-widen)  # nvidia-h200, one call: the GPU tests of BF16 gradient downloads (plan.grad_widen),
    # a profile (Adam timed on a BF16 gradient), then issue 4's ratio at mb 4 and 5 with the
    # gradients widened on the host (default) against on the GPU, by the protocol (10 steps, mean
    # of 6-10)
    timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_exec_engine.py \
        -k "widen or bf16" 2>&1 | tail -5
    python3 -m slidedp.cli profile --out "$OUT/h200-profile.toml" --base h200x1 \
        --model qwen3-4b --micro-batch 4 5 --quick --name "h200-profile-$(date +%H%M)"
    GPU_WIDEN='grad_widen="gpu"'
    python3 benchmarks/multi_gpu.py "$OUT/h200-4b-widen.jsonl" qwen3-4b ref:4 ref:5 \
        "4:4:$G:window_slots=36:embedding_rows=true" "4:4:$G:window_slots=36:embedding_rows=true:$GPU_WIDEN" \
        "4:4:$G:window_slots=36" "5:5:$G:window_slots=36:embedding_rows=true" \
        "5:5:$G:window_slots=36:embedding_rows=true:$GPU_WIDEN" --iters 10 --discard 5 \
        --traces "$OUT/h200-4b-widen.traces" ;;
chunk-cost)  # nvidia-h200-x2 (one GPU), one call: why the executor's cast of a chunk takes ~1 ms
    # longer than the profile's (issue 6, the 4B host-bound cases of 2026-12-01 00:09): a profile
    # of this lease, the cast of a chunk under each load the executor adds (chunk_cost_probe.py:
    # idle gaps, a kernel-launching thread holding the GIL, Adam beside it), then Qwen3-4B 1:1 at
    # 64 and 256 MiB with Python's thread switch interval at 5 ms (default) and 0.5 ms, with traces
    python3 -m slidedp.cli profile --out "$OUT/h200x2-profile.toml" --base h200x2 \
        --model qwen3-4b --micro-batch 1 4 --quick --name "h200x2-profile-$(date +%H%M)"
    python3 benchmarks/probes/chunk_cost_probe.py "$OUT/chunk-cost-probe.json"
    for v in "default|" "switch|--switch-interval-s 0.0005"; do
        name=${v%%|*}; opt=${v#*|}
        python3 benchmarks/multi_gpu.py "$OUT/chunk-cost-$name.jsonl" qwen3-4b "1:1:$G" \
            "1:1:$G:h2d_chunk_mib=256.0:d2h_chunk_mib=256.0" --iters 6 --discard 3 \
            --traces "$OUT/chunk-cost-$name.traces" $opt
    done ;;
ap)  # nvidia-h200, one call: AutoPolicy (probes within its 60 s limit) against the real sweep,
    # Qwen3-4B at a GPU-bound micro-batch (issue 8); `ap MB SEQ` for other shapes, e.g. the
    # long-sequence case `ap 1 16384`; the profile of the h200-ratio call via HW=...; CAP=GiB for
    # AutoPolicy's --gpu-memory-cap-gib
    HW=${HW:?set HW to a profile TOML of this machine} bash benchmarks/autopolicy_vs_sweep.sh \
        "$OUT/ap" "${MODEL:-qwen3-4b}" "${3:-6}" "${4:-4096}" ;;
probe-state)  # any H200, ~4 min (its tests import hypothesis: carry its wheels, e.g.
    # `../shared/tools/device-wheels.sh hypothesis sortedcontainers attrs`; pytest was there on
    # 2026-12-01): the GPU tests of the code since 2026-12-01 04:41 (the probe's
    # shared and subset states, the profile's sac fraction), then: does AutoPolicy's probe state
    # (policy/probe.py DISTINCT_LAYERS) time the executor as the whole state does? Qwen3-4B
    # host-bound (mb 1, window 3: casts can meet updates of layers sharing their memory) and
    # GPU-bound (mb 4, window 36: they cannot)
    python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_policy_probe.py \
        tests/test_profile_gpu.py tests/test_exec_policy_profile.py 2>&1 | tail -15 | tee "$OUT/gpu-tests.txt" || true
    python3 benchmarks/probes/probe_state_check.py "$OUT/probe-state-4b-mb1.json" --model qwen3-4b \
        --micro-batch 1 --iters 6 --discard 2 --runs 2
    python3 benchmarks/probes/probe_state_check.py "$OUT/probe-state-4b-mb4.json" --model qwen3-4b \
        --micro-batch 4 --window-slots 36 --iters 6 --discard 2 --runs 2 ;;
ap-confirm)  # any H200: the rows that decide an `ap` comparison measured again by the protocol
    # (15 steps, mean of the last 7, two interleaved runs; benchmarks/confirm_sweep.py), e.g.
    # `ap-confirm OUT benchmarks/results/2026-12-01-h200-autopolicy-4b-seq16384-0428` (~6 min)
    python3 benchmarks/confirm_sweep.py "$3/sweep.jsonl" "$OUT/confirm.jsonl" --plan "$3/plan.toml" \
        | tee "$OUT/confirm.txt" ;;
adam-llc)  # any H200 (~2 min): do the update and the cpu reduction's host sum read what the D2H
    # has just written from the CPU's cache? (the 8B update channel on nvidia-h200 ran at 125 GB/s
    # of state traffic with 64 MiB chunks, above the profile's DRAM peak; the x4's host sum of 4
    # ranks at ~217 GB/s counted; benchmarks/probes/adam_after_d2h_probe.py: Adam cold / after a D2H, the
    # sum of 2 and 4 chunks cold / after D2Hs, Adam after the sum), at the update team's thread
    # count of each kind (12 on nvidia-h200, 24 on the x2, 48 on the x4)
    python3 benchmarks/probes/adam_after_d2h_probe.py "$OUT/adam-after-d2h.json" \
        --update-threads "${THREADS:-12}" ;;
h200-drift)  # nvidia-h200 (~8 min): do two default quick profiles (7 rounds, each on fresh
    # buffers: a host rate depends on where its buffers land) agree, and predict the matrix's
    # three host-bound 4B cases measured between them by the protocol (15 steps, mean of the last
    # 7, two runs)? (2026-12-01 17:57: two 9-round profiles on one allocation each still read
    # AdamW at 12 threads 3.70 and 4.34 Gparam/s; 18:07, benchmarks/probes/host_placement_probe.py: 34%
    # between allocations, in two groups, 9% within one)
    for k in a b; do
        python3 -m slidedp.cli profile --out "$OUT/h200-profile-$k.toml" --base h200x1 \
            --model qwen3-4b --micro-batch 1 2 6 --quick \
            --name "h200-profile-$k-$(date +%H%M)" > "$OUT/profile-$k.log" 2>&1
        grep -a "host rates:" "$OUT/profile-$k.log" | tr '\r' '\n' | grep -a "^host rates: " || true
        if [ "$k" = a ]; then
            python3 -m slidedp.cli validate --hardware "$OUT/h200-profile-a.toml" \
                --cases validation/cases-h200-matrix.toml --select 'h200m-4b-r1-gb[12]-*' \
                --machine nvidia-h200 --out "$OUT/val" --iters 15 --discard 8 --runs 2 \
                2>&1 | grep -av "it/s\|step/s" | tail -20 || echo "validate failed"
            tar czf "$OUT/val.tgz" -C "$OUT" val && rm -rf "$OUT/val"
        fi
    done ;;
h200-update)  # nvidia-h200 (~6 min): why the executor's update ran slower than its own state's
    # AdamW pass (19:52: the host check 0.95-1.01 and the state check 0.95-1.02 of the profile,
    # the executor's dense 64 MiB Adam chunks of 4B mb 2 a median 5.5 ms, 0.88 of the state
    # check's rate, with or without a D2H or GPU compute beside them): per-chunk AdamW on
    # host-state memory with the state check's reused gradient, a cold pinned slot, a slot just
    # downloaded, and a cold slot with Python kernel launches beside (the GIL), before and after
    # the worst host-bound case by the protocol
    probe() {
        python3 benchmarks/probes/adam_after_d2h_probe.py "$OUT/adam-probe-$1.json" --chunk-mib 64 \
            --adam-only --state-memory shm --state-gib 2 --chunks 48 --repeats 3 \
            | python3 -c "import json,sys; [print(r['condition'], round(r['median_ms'], 2), round(r['counted_gbps'])) for r in map(json.loads, sys.stdin)]"
    }
    probe 1
    python3 -m slidedp.cli profile --out "$OUT/h200-profile.toml" --base h200x1 --model qwen3-4b \
        --micro-batch 2 --quick --name "h200-profile-$(date +%H%M)" > "$OUT/profile.log" 2>&1
    python3 -m slidedp.cli validate --hardware "$OUT/h200-profile.toml" \
        --cases validation/cases-h200-matrix.toml --select 'h200m-4b-r1-gb2-*' \
        --machine nvidia-h200 --out "$OUT/val" --iters 15 --discard 8 --runs 1 \
        2>&1 | grep -av "it/s\|step/s" | tail -8 || echo "validate failed"
    tar czf "$OUT/val.tgz" -C "$OUT" val && rm -rf "$OUT/val"
    probe 2 ;;
h200-threads)  # nvidia-h200 (~4 min): is the executor's slow update CPU-side (threads beside
    # its team) or memory-side? (20:11: the state check read 1.01 of the profile right after a run
    # whose update ran 25% slower than simulated.) Per-chunk AdamW on host-state memory at 8, 12
    # and 16 threads, then the worst host-bound 4B case at each update team size (traces: the
    # executor's chunks at that size), twice, then the probes again
    probes() {
        for t in 8 12 16; do
            python3 benchmarks/probes/adam_after_d2h_probe.py "$OUT/adam-probe-$1-t$t.json" \
                --chunk-mib 64 --adam-only --state-memory shm --state-gib 2 --chunks 48 \
                --repeats 2 --update-threads "$t" | python3 -c "import json,sys; [print($t, r['condition'], round(r['median_ms'], 2)) for r in map(json.loads, sys.stdin) if r['condition'] in ('cold', 'after_d2h')]"
        done
    }
    probes before
    C="2:2:sharded:cpu:rank0:window_slots=36"
    python3 benchmarks/multi_gpu.py "$OUT/4b-update-threads.jsonl" qwen3-4b "$C:update_threads=8" \
        "$C:update_threads=12" "$C:update_threads=16" "$C:update_threads=8" "$C:update_threads=12" \
        "$C:update_threads=16" --iters 10 --discard 5 --traces "$OUT/traces"
    tar czf "$OUT/traces.tgz" -C "$OUT" traces && rm -rf "$OUT/traces"
    probes after ;;
h200-matrix)  # nvidia-h200: the cases of validation/cases-h200-matrix.toml whose names match
    # GLOB, by the protocol (10 steps, mean of 6-10, two runs, each on a host state of its own),
    # predicted on this lease's profile: made on the first call of a lease (Qwen3-4B and -8B
    # layers at every micro-batch of the matrix) and kept in .devkeep/ for the next call on the
    # same machine; validate stops at BUDGET_S (default 540) seconds of the call, keeping the
    # cases measured by then
    start=$SECONDS
    P=.devkeep/h200-profile.toml
    if [ ! -f "$P" ]; then
        mkdir -p .devkeep
        python3 -m slidedp.cli profile --out "$P" --base h200x1 --model qwen3-4b qwen3-8b \
            --micro-batch 1 2 4 6 8 --quick --name "h200-profile-$(date +%H%M)" \
            > "$OUT/profile.log" 2>&1 || { tail -5 "$OUT/profile.log"; rm -f "$P"; exit 1; }
        cp "$P" "$OUT/h200-profile.toml"
        cp "${P%.toml}.rounds.json" "$OUT/h200-profile.rounds.json" 2>/dev/null || true
    fi
    grep -a "^name = " "$P"
    timeout $(( ${4:-540} - (SECONDS - start) )) python3 -m slidedp.cli validate --hardware "$P" \
        --cases validation/cases-h200-matrix.toml --select "$3" --machine nvidia-h200 \
        --out "$OUT/val" --iters 10 --discard 5 --runs 2 2>&1 | grep -av "it/s\|step/s" | tail -25 \
        || echo "validate stopped"
    tar czf "$OUT/val.tgz" -C "$OUT" val && rm -rf "$OUT/val" ;;
mem-kind)  # any H200 (~1 min): AdamW, cast and copy on /dev/shm mappings (the host state's and,
    # since 2026-12-01 13:40, the profile's memory) against anonymous memory (earlier profiles'),
    # alternating; with the huge-page modes (the 13:09 lease's profile measured AdamW 44% faster
    # than the 08:29 lease's while the executor ran the 8B update alike on both)
    python3 benchmarks/probes/memory_kind_probe.py "$OUT/memory-kind.json" ;;
rows)  # nvidia-h200-x2, one GPU: the split embedding update (plan.embedding_rows) against the
    # whole one, Qwen3-8B (untied), the host-bound and GPU-bound batches
    python3 benchmarks/multi_gpu.py "$OUT/8b-rows.jsonl" qwen3-8b ref:4 "4:4:$G:window_slots=36" \
        "4:4:$G:window_slots=36:embedding_rows=true" "16:4:$G:window_slots=36" \
        "16:4:$G:window_slots=36:embedding_rows=true" --iters 6 --discard 3 ;;
x4)  # nvidia-h200-x4, one call: profile (teams with every GPU's DMA: the host.mem cap), the 8B
    # routes at R = 4 (host- and GPU-bound), Qwen3-14B at R = 2 (weak scaling's middle point)
    python3 -m slidedp.cli profile --out "$OUT/h200x4-profile.toml" --base h200x4 \
        --model qwen3-8b qwen3-14b --micro-batch 1 4 --quick --name "h200x4-profile-$(date +%H%M)"
    STAGES=routes MODELS=qwen3-8b bash benchmarks/scaling_x4x8.sh 4 "$OUT"
    STAGES=scale RANKS=2 MODELS=qwen3-14b bash benchmarks/scaling_x4x8.sh 4 "$OUT" ;;
*)
    echo "usage: $0 x2|14b|8b-gb32|loss|h200|h200-rows|x2-val|h200-ratio|h200-widen|chunk-cost|probe-state|ap|h200-val|adam-llc|ap-confirm|mem-kind|h200-drift|h200-update|h200-threads|h200-matrix|rows|x4 OUT" >&2
    exit 2 ;;
esac
