#!/usr/bin/env bash
# The serving path end to end: `baton serve` on a dummy-weight model, then `baton bench` (SGLang bench_serving's
# flags and metrics) against it, at concurrency 1. The figures of issues 6 / 8 (8192 in / 1024 out) come from here
# when the GPU machine has fastapi / uvicorn (carried as wheels in .whl); bench_ling_flash.py measures the same
# requests on the engine alone.
#
#   MODEL=DIR TP=2 MODE=nextn NUM_PROMPTS=3 bash benchmarks/serve_bench.sh OUT_DIR
#   MODEL=ling-3.0-flash ...   the whole Ling-3.0-flash config (baton/data), written to a temporary directory
#
# MODE: plain, nextn (NEXTN (5, 1, 6) at simulated accept ACCEPT=3.25), or dspark-shaped (a random DSpark draft of
# block 16, DSPARK_LAYERS=2 layers, at simulated accept ACCEPT=9.95: the shape of the seed's DSpark runs). INPUT_LEN / OUTPUT_LEN: prompt and output
# lengths (8192 / 1024); EXTRA_SERVE_ARGS goes to `baton serve` (e.g. "--quantization fp8"). Writes
# OUT_DIR/serve_MODE.log and OUT_DIR/bench_MODE.jsonl; the server is stopped at the end.
set -euo pipefail
out=${1:?usage: MODEL=DIR [TP=N MODE=plain|nextn|dspark-shaped ...] bash benchmarks/serve_bench.sh OUT_DIR}
mkdir -p "$out"
model=${MODEL:?MODEL: a model directory with config.json, or ling-3.0-flash}
if [ "$model" = ling-3.0-flash ]; then
  model=$(mktemp -d)
  python3 -c "from importlib import resources; print(resources.files('baton.data').joinpath('ling-3.0-flash.config.json').read_text())" \
      > "$model/config.json"
fi
mode=${MODE:-plain}
case $mode in
  plain) spec=() ;;
  nextn) spec=(--speculative-algorithm NEXTN --speculative-num-steps 5 --speculative-eagle-topk 1
               --speculative-num-draft-tokens 6 --speculative-simulate-accept-len "${ACCEPT:-3.25}") ;;
  dspark-shaped)  # a random DSpark draft of block 16 (DSPARK_LAYERS layers) for the target, at ACCEPT=9.95
    baton convert random-draft --target "$model" --algorithm DSPARK --output "$model/dspark-draft" --block-size 16 \
        --num-layers "${DSPARK_LAYERS:-2}" > /dev/null
    spec=(--speculative-algorithm DSPARK --speculative-draft-model-path "$model/dspark-draft"
          --speculative-simulate-accept-len "${ACCEPT:-9.95}") ;;
  *) echo "MODE: plain, nextn or dspark-shaped" >&2; exit 2 ;;
esac
port=${PORT:-30000}
# shellcheck disable=SC2086
baton serve --model-path "$model" --load-format dummy --tp-size "${TP:-1}" --host 127.0.0.1 --port "$port" \
    --context-length $(( ${INPUT_LEN:-8192} + ${OUTPUT_LEN:-1024} + 64 )) ${EXTRA_SERVE_ARGS:-} "${spec[@]}" \
    > "$out/serve_$mode.log" 2>&1 &
server=$!
trap 'kill "$server" 2>/dev/null; wait "$server" 2>/dev/null || true' EXIT
baton bench --backend sglang --port "$port" --dataset-name random-ids --random-input-len "${INPUT_LEN:-8192}" \
    --random-output-len "${OUTPUT_LEN:-1024}" --random-range-ratio 1 --num-prompts "${NUM_PROMPTS:-3}" --max-concurrency 1 \
    --warmup-requests 1 --ready-check-timeout-sec "${READY_S:-900}" --output-file "$out/bench_$mode.jsonl" \
    --tag "$mode tp${TP:-1}" --disable-tqdm &
bench=$!
# a server that dies (a bad flag, an out-of-memory load) ends the run now, not at the ready-check timeout
while kill -0 "$bench" 2>/dev/null; do
  if ! kill -0 "$server" 2>/dev/null; then
    echo "baton serve exited before the benchmark ended; its log ($out/serve_$mode.log) ends with:" >&2
    tail -n 20 "$out/serve_$mode.log" >&2
    kill "$bench" 2>/dev/null
    exit 1
  fi
  sleep 2
done
wait "$bench"
