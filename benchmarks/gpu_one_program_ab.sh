#!/usr/bin/env bash
# One H200 call for the one-step-program redesign (issue 21): the GPU tests of captured == uncaptured (plain,
# NEXTN, DSpark with and without an SPS table, sampled), then the fast path before and after, side by side:
# SmolLM2 plain, SmolLM2 NEXTN (a random head, simulated accept 3.0) and the 18-layer Ling NEXTN benchmark.
#
#   OLD=.old NEW=.new bash benchmarks/gpu_one_program_ab.sh      # on the device, from the repo root
#
# OLD and NEW are source trees (git archive of the two commits, without baton/drafts: dummy weights only), each
# with commit.txt. Results: $OUT/ab.jsonl (one line per run), $OUT/gpu_tests.txt, $OUT/ling_*.log.
set -uo pipefail
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
OLD=${OLD:-.old}; NEW=${NEW:-.new}
source benchmarks/device_setup.sh
ROOT=$PWD
SITE=/tmp/site
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"

in_tree() {  # in_tree TREE CMD...: run CMD inside TREE with only that tree's baton importable
  local tree=$1; shift
  (cd "$ROOT/$tree" && BATON_COMMIT=$(cat commit.txt) PYTHONPATH=$SITE:$ROOT/$tree "$@")
}

# 1. GPU tests of the new tree (the captured program against the uncaptured one)
in_tree "$NEW" timeout 420 python3 -m pytest -q -x --timeout 300 tests/engine/test_cuda_graphs.py \
    -k "not gate_embedded" 2>&1 | tail -25 > "$OUT/gpu_tests.txt"

# 2. a random NEXTN head for the SmolLM2 shapes (the new tree's converter; both trees read the same format)
in_tree "$NEW" python3 -m baton convert random-draft --target benchmarks/configs/smollm2-135m-instruct \
    --algorithm NEXTN --output /tmp/smol_nextn > /dev/null

SMOL="--model-path benchmarks/configs/smollm2-135m-instruct --load-format dummy --input-len 512 --output-len 256"
SMOL_NEXTN="--speculative-algorithm NEXTN --speculative-draft-model-path /tmp/smol_nextn --speculative-num-steps 3
  --speculative-simulate-accept-len 3.0"
for round in 1 2; do  # alternate the trees, twice, so drift shows up as a difference between rounds
  for tree in "$OLD" "$NEW"; do
    in_tree "$tree" timeout 240 python3 "$ROOT/benchmarks/bench_tpot.py" $SMOL --label "smollm2_plain_$tree" \
        --json "$OUT/ab.jsonl" > /dev/null 2>> "$OUT/errors.txt"
    in_tree "$tree" timeout 240 python3 "$ROOT/benchmarks/bench_tpot.py" $SMOL $SMOL_NEXTN \
        --label "smollm2_nextn_$tree" --json "$OUT/ab.jsonl" > /dev/null 2>> "$OUT/errors.txt"
  done
done

# 3. the 18-layer Ling NEXTN (5, 1, 6) benchmark, each tree's own script (TPOT at simulated accept 3.25)
for tree in "$OLD" "$NEW"; do
  in_tree "$tree" timeout 420 python3 benchmarks/bench_ling_flash.py --num-layers 18 --modes nextn \
      --num-requests 2 --output-len 512 > "$OUT/ling_$(basename $tree).log" 2>&1
  grep -E '^nextn ' "$OUT/ling_$(basename $tree).log" | sed "s/^/$(basename $tree) /" >> "$OUT/ab_ling.txt"
done
echo done
