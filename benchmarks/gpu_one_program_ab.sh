#!/usr/bin/env bash
# One H200 call for the one-step-program redesign (issue 21): the GPU tests of captured == uncaptured (plain,
# NEXTN, DSpark with and without an SPS table, sampled), then the fast path before and after, side by side:
# SmolLM2 plain, SmolLM2 NEXTN (a random head, simulated accept 3.0) and the 18-layer Ling NEXTN benchmark.
#
#   OLD=.old NEW=.new PARTS="tests smol" bash benchmarks/gpu_one_program_ab.sh   # on the device, from the repo root
#   OLD=.old NEW=.new PARTS="ling" bash benchmarks/gpu_one_program_ab.sh          # (each call under 10 minutes)
#
# OLD and NEW are source trees (git archive of the two commits, without baton/drafts: dummy weights only), each
# with commit.txt. Results, packed into $OUT/one_program_ab.tgz (and $OUT/summary.txt): ab.jsonl (one line per
# run), gpu_tests.txt, ling_*.log, ab_ling.txt, smollm2_decode.json (with the in-run HF compiled peer).
set -uo pipefail
FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
OUT=/tmp/res/one_program; mkdir -p "$OUT"; export OUT
OLD=${OLD:-.old}; NEW=${NEW:-.new}
source benchmarks/device_setup.sh
ROOT=$PWD
SITE=/tmp/site
nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv > "$OUT/gpu.txt"

in_tree() {  # in_tree TREE CMD...: run CMD inside TREE with only that tree's baton importable
  local tree=$1; shift
  (cd "$ROOT/$tree" && BATON_COMMIT=$(cat commit.txt) PYTHONPATH=$SITE:$ROOT/$tree "$@")
}

PARTS=${PARTS:-tests smol ling}
has() { case " $PARTS " in *" $1 "*) return 0;; esac; return 1; }

# 1. GPU tests of the new tree (the captured program against the uncaptured one)
has tests && in_tree "$NEW" timeout 300 python3 -m pytest -q --timeout 240 tests/engine/test_cuda_graphs.py \
    -k "not gate_embedded" 2>&1 | tail -25 > "$OUT/gpu_tests.txt"

# 2. a random NEXTN head for the SmolLM2 shapes (the new tree's converter; both trees read the same format)
has smol && in_tree "$NEW" python3 -m baton convert random-draft --target benchmarks/configs/smollm2-135m-instruct \
    --algorithm NEXTN --output /tmp/smol_nextn > /dev/null

SMOL="--model-path benchmarks/configs/smollm2-135m-instruct --load-format dummy --input-len 512 --output-len 256"
SMOL_NEXTN="--speculative-algorithm NEXTN --speculative-draft-model-path /tmp/smol_nextn --speculative-num-steps 3
  --speculative-simulate-accept-len 3.0"
has smol && for round in 1 2; do  # alternate the trees, twice, so drift shows up as a difference between rounds
  for tree in "$OLD" "$NEW"; do
    in_tree "$tree" timeout 240 python3 "$ROOT/benchmarks/bench_tpot.py" $SMOL --label "smollm2_plain_$tree" \
        --json "$OUT/ab.jsonl" > /dev/null 2>> "$OUT/errors.txt"
    in_tree "$tree" timeout 240 python3 "$ROOT/benchmarks/bench_tpot.py" $SMOL $SMOL_NEXTN \
        --label "smollm2_nextn_$tree" --json "$OUT/ab.jsonl" > /dev/null 2>> "$OUT/errors.txt"
  done
done

# 3. the 18-layer Ling NEXTN (5, 1, 6) benchmark, each tree's own script (TPOT at simulated accept 3.25)
has ling && for tree in "$OLD" "$NEW"; do
  in_tree "$tree" timeout 200 python3 benchmarks/bench_ling_flash.py --num-layers 18 --modes nextn \
      --num-requests 1 --output-len 256 > "$OUT/ling_$(basename $tree).log" 2>&1
  grep -E '^nextn ' "$OUT/ling_$(basename $tree).log" | sed "s/^/$(basename $tree) /" >> "$OUT/ab_ling.txt"
  mv "$OUT"/ling_flash_18l*.json "$OUT/ling_flash_18l_nextn_$(basename $tree).json" 2>/dev/null
done

# 4. SmolLM2 plain decode against the HF StaticCache + torch.compile peer, in the same run (the new tree)
has smol && in_tree "$NEW" timeout 200 python3 benchmarks/bench_smollm2_decode.py --model-path \
    benchmarks/configs/smollm2-135m-instruct --load-format dummy --skip-hf --repeats 3 > "$OUT/smollm2_decode.log" 2>&1

{ cat "$OUT/gpu_tests.txt" "$OUT/ab_ling.txt" 2>/dev/null; [ -f "$OUT/ab.jsonl" ] && python3 - "$OUT/ab.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(r["label"], r["commit"], "TPOT ms median %.4f min %.4f max %.4f" % tuple(r["tpot_ms"][k] for k in ("median", "min", "max")), "accept", r["accept_length"])
PY
  tail -3 "$OUT/smollm2_decode.log" 2>/dev/null; } > "$FINAL/summary_${PARTS// /_}.txt" 2>&1
tar -czf "$FINAL/one_program_ab_${PARTS// /_}.tgz" -C /tmp/res one_program
echo done
