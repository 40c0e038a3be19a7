#!/usr/bin/env bash
# fp8 dense weights for Ling (issue 22) on one H200, about 7-8 minutes:
#   1. the GPU tests of the fp8 dense kernel at the Ling-3.0-flash dense shapes, the fp8 lm_head kernel's and the
#      fp8 checkpoint / engine tests (pytest -m gpu);
#   2. the fp8 dense projections at every Ling dense decode shape, M = 1, 6, 17 (the Triton kernel takes up to 32
#      rows), cold weights, in CUDA graphs, against the bf16 projection with the same fusion and the floor
#      (bytes / 4.2 TB/s): $OUT/fp8_dense_linear.json (SWEEP=1 adds a tile sweep: several more minutes);
#   3. bench_ling_flash, 42 layers + MTP, NEXTN (5,1,6) sim 3.25, fp8 draft lm_head, for --quantization fp8
#      (experts + dense) and fp8-experts (today's mode): TPOT, step, census, floor, memory.
#
#     OUT=DIR bash benchmarks/gpu_fp8_dense.sh          # OUT defaults to ./out
#
# Every stage logs to $OUT/<stage>.log; a failing stage does not stop the next (the exit status is the first failure).
set -u
cd "$(dirname "$0")/.."
# the device machine's environment (carried wheels, PYTHONPATH with the checkout) when there is one
[ -f benchmarks/device_setup.sh ] && . benchmarks/device_setup.sh
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} BATON_NO_PROGRESS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-./out}
mkdir -p "$OUT"
export OUT
status=0
run() {  # run NAME TIMEOUT_S CMD...: one stage, its output in $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" | tee -a "$OUT/summary.txt"
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc=$rc, $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
    tail -n 5 "$OUT/$name.log"
    [ $rc -ne 0 ] && [ $status -eq 0 ] && status=$rc
    return 0
}
git rev-parse --short HEAD > "$OUT/commit.txt" 2>/dev/null || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv > "$OUT/gpu.txt" 2>&1 || true

export BATON_TEST_REPORT="$OUT/gpu_test_figures.jsonl"
run gpu_tests 150 python3 -m pytest -q -m gpu tests/ops/test_fp8_dense.py tests/ops/test_fp8_linear.py \
    tests/models/test_fp8_dense.py -p no:cacheprovider --junitxml="$OUT/gpu_tests.xml"

SWEEP_FLAG=()
BENCH_LIMIT=150
[ "${SWEEP:-0}" = 1 ] && SWEEP_FLAG=(--sweep) && BENCH_LIMIT=900
run fp8_dense_linear "$BENCH_LIMIT" python3 -m baton.ops.fp8_linear.bench --dense --rows 1 6 17 "${SWEEP_FLAG[@]}" \
    --json "$OUT/fp8_dense_linear.json"

for q in fp8 fp8-experts; do
    run "ling_flash_42l_nextn_$q" 210 python3 benchmarks/bench_ling_flash.py --num-layers 42 --quantization "$q" \
        --modes nextn --num-requests 1 --enable-fp8-draft-lm-head
done
ls -la "$OUT" >> "$OUT/summary.txt"
exit $status
