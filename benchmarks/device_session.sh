#!/usr/bin/env bash
# One H200 x2 session in back-to-back calls (the machine stays warm ~30 s between them); everything each call
# measures is packed into $OUT/<phase>.tgz (the device returns at most 8 files). Each of the first three calls
# also carries one third of the GGUF (.carry0/1/2, see below); the GGUF is rebuilt when the last arrives, so a
# phase that needs it (r, e) comes third or later. A training session: a (+.carry0), p (+.carry1), r (+.carry2),
# w (repeat until the report is done), e.
#
#   a  (no GGUF needed)       GPU 0: the attention / graph GPU tests, SmolLM2 censuses on dummy weights at its
#                             config (plain, NEXTN, DSpark; fused attention on and off); GPU 1: the linear tune at
#                             M=6 for SmolLM2's shapes, then the fp8 MoE tile sweep
#   b  (no GGUF needed)       the speculative SmolLM2 censuses, the sampled-graph tests, the 42-layer fp8 model on
#                             one GPU, then fp8 NEXTN at TP2
#   g  (no GGUF needed)       exclusive censuses: SmolLM2 plain / NEXTN / DSpark (GPU 0), 42-layer fp8 (GPU 1)
#   n  (no GGUF needed)       the argmax / RMSNorm / few-row linear kernels' GPU tests and bench, the SmolLM2 tune at
#                             M = 4, 9 merged into the table, SmolLM2 censuses with all of it; Ling tune at M = 6
#   p                         GPU 0: the Ling 18-layer bench; GPU 1: the whole Ling-3.0-flash with fp8 experts
#   r  (the GGUF)             with carried data: a 30-step DSpark A/B of TF32 (GPU 0 on, GPU 1 off), the faster
#                             setting kept; then the draft recipe in the background (NEXTN on GPU 0, DSpark on
#                             GPU 1, TRAIN_BUDGET s each), or, without data, generation first and the linear
#                             tuning sweep on GPU 1
#   w                         while the recipe trains: the TP2 GPU tests once (correctness only: they share the
#                             GPUs with training); then wait for the recipe's report, pack drafts and report
#   e  (the GGUF)             after training: the fused-attention kernel tests, the SmolLM2 plain-decode bench with
#                             the fused-attention A/B, censuses of plain and NEXTN SmolLM2 steps (GPU 0); the whole
#                             Ling-3.0-flash bf16 at TP2 (one-shot all-reduce, plain and NEXTN, with the TP census);
#                             fp8 NEXTN at TP2 if time is left
#   d                         TP2 only: the tests (TP_TESTS=0 skips them), all-reduce latency, bf16 and fp8 plain /
#                             NEXTN benches, each with rank 0's exclusive census
#   s                         baton serve + baton bench at TP2, the whole Ling-3.0-flash shape (MODES, TP)
#   m                         the fp8 MoE tile sweep (GPU 0) and the linear tune at M=6 (GPU 1)
#   c                         carries a GGUF part (a training session's first calls); C_TUNE=1 also the SmolLM2 M=9
#                             tune and step censuses; C_FP8=tp2|one also issue 9's fp8 NEXTN at TP2 / on one GPU
#   x  (the GGUF)             issue 7: two DSpark drafters trained side by side in the background, then their reports
#                             (benchmarks/train_more_dspark.sh); y waits for them and packs dspark_A/B + the reports.
#                             A training session: C_TUNE=1 c (+.carry0), c (+.carry1), x (+.carry2), y, y ...
#                             MODE=dp NEW_DATA=1: more data first, then B alone over both GPUs (--dp-size 2);
#                             A_INIT=grow: A is the shipped drafter grown to 2 layers (saved fp8) instead of scratch
#   f, f1                     issue 9's close-out in two calls: f: the MoE kernel tests and fp8 sweeps (one GPU's and a
#                             TP2 rank's experts), the TP2 linear shapes tuned, then fp8 plain / NEXTN at TP2; f1: fp8 on
#                             one GPU, then bf16 NEXTN at TP2 with the TP2 linear entries
#   t                         tune the linear kernels' configs; the table comes back as nvidia-h200.json
# Every call carries .whl (the wheels the image lacks: fla-core, gguf, fastapi, starlette, uvicorn, pydantic and
# their own needs; and commit.txt: `git rev-parse --short HEAD > .whl/commit.txt`).
#
# The GGUF (98 MB) does not fit one call beside the 23 MB tree: .carry0, .carry1, .carry2 each hold a third
# ({part, index, nparts, sha256}; `split -n 3 -d -a 2 <gguf> p.`), so the first three calls of a session carry
# one each, in any order (a cold restart loses the parts already sent). GSM8K travels beside them, split to keep
# each call under 64 MiB: .carry0/gsm8k/test.jsonl, .carry1/gsm8k/train.jsonl.gz (merged into /tmp/gsm8k). .carry2
# also holds traindata.tgz (an earlier session's data/gsm8k{,.holdout}.jsonl: phases r and x then skip generation;
# since 2026-11-30f its gsm8k.jsonl holds the 13,060 records the shipped drafter last trained on, so NEW_DATA=0 trains
# on all of them).
set -uo pipefail
phase=${1:?phase a|b|c|d}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT" /tmp/parts /tmp/res /tmp/train
# The GGUF travels in parts, one per call (.carryI/{part, index, nparts, sha256}); once all have arrived on
# this (warm) machine it is rebuilt and checked.
for c in .carry0 .carry1 .carry2 .carry3; do
  [ -f $c/part ] && cp $c/part "/tmp/parts/$(cat $c/index)"
  [ -d $c/gsm8k ] && mkdir -p /tmp/gsm8k && cp $c/gsm8k/* /tmp/gsm8k/  # the files may come in different calls
  ls /tmp/gsm8k/*.gz > /dev/null 2>&1 && gunzip -f /tmp/gsm8k/*.gz  # (train.jsonl travels gzipped)
  [ -f $c/traindata.tgz ] && cp $c/traindata.tgz /tmp/traindata.tgz
  [ -f $c/sha256 ] && cp $c/sha256 /tmp/parts.sha256 && cp $c/nparts /tmp/parts.n 2>/dev/null
done
if [ -f /tmp/parts.sha256 ] && [ ! -f /tmp/SmolLM2-135M-Instruct.Q4_1.gguf ] \
    && [ "$(ls /tmp/parts | wc -l)" -ge "$(cat /tmp/parts.n 2>/dev/null || echo 2)" ]; then
  cat /tmp/parts/* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf && sha256sum -c /tmp/parts.sha256
fi
source benchmarks/device_setup.sh
export BATON_COMMIT=$(cat .whl/commit.txt 2>/dev/null || echo unknown)
R=/tmp/res/$phase; mkdir -p "$R"
GPU_TESTS="tests/ops/test_linear_triton.py tests/ops/test_attention_triton.py tests/ops/test_mla_triton.py
  tests/ops/test_kda_triton.py tests/ops/test_kda_fla.py tests/ops/test_moe_triton.py tests/ops/test_moe_fp8.py
  tests/engine/test_cuda_graphs.py tests/ops/test_linear_table.py tests/ops/test_attention_fused.py"
nvidia-smi --query-gpu=index,name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv > "$R/gpu.txt"
t0=$SECONDS
py() { PYTHONUNBUFFERED=1 python3 "$@"; }
# The TP2 GPU tests (phases w and d). SIGINT first, so pytest prints its failures (an ABRT lost them on
# 2026-11-29), KILL 20 s later. 420 s: each TP2 graph test compiles fp32 Triton kernels at TP1 and TP2 shapes in
# fresh processes (one did not finish in 166 s on 2026-11-30: slow compiles or a stall, not separated);
# --durations tells which. A hang dumps the ranks' Python stacks (PYTHONFAULTHANDLER).
tp_gpu_tests() {
  PYTHONFAULTHANDLER=1 BATON_TP_TIMEOUT=120 BATON_TEST_REPORT=$R/figures.jsonl timeout -s INT -k 20 420 \
      python3 -m pytest -q -m gpu tests/dist/test_tp_gpu.py -p no:cacheprovider -rfEs --durations=0 \
      > "$R/tp_gpu_tests.log" 2>&1
  echo "tp tests rc=$? at $((SECONDS - t0)) s" >> "$R/tp_gpu_tests.log"
}
# One census of a SmolLM2 step on dummy weights at its config (a replay's time does not depend on the weights'
# values; speculation at the GSM8K accept lengths, simulated): smol_census ALG NAME [TIMEOUT_S], ALG none, NEXTN
# (the shipped head, (3, 1, 4)) or DSPARK (the shipped drafter, gamma 8); writes $R/census_smollm2_NAME.{jsonl,log}.
smol_census() {
  local alg=$1 name=$2 d=baton/drafts/smollm2-135m-instruct spec
  case $alg in
    none) spec=(--speculative-algorithm none) ;;
    NEXTN) spec=(--speculative-algorithm NEXTN --speculative-draft-model-path $d/nextn --speculative-num-steps 3
                 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4 --speculative-simulate-accept-len 2.97) ;;
    DSPARK) spec=(--speculative-algorithm DSPARK --speculative-draft-model-path $d/dspark
                  --speculative-num-draft-tokens 9 --speculative-simulate-accept-len 2.90) ;;
  esac
  timeout "${3:-60}" python3 -m baton census --model-path benchmarks/configs/smollm2-135m-instruct --load-format dummy \
      "${spec[@]}" --input-len 512 --num-steps 200 --output-file "$R/census_smollm2_$name.jsonl" \
      > "$R/census_smollm2_$name.log" 2>&1
  echo "census rc=$? at $((SECONDS - t0)) s" >> "$R/census_smollm2_$name.log"
}
# merge_table FILE [TABLE]: a tuned table's entries (a phase's own tune) join TABLE (default: this copy's
# baton/ops/linear/tuned/nvidia-h200.json), replacing entries of the same keys; the merged table is kept in $R.
# A missing FILE changes nothing.
merge_table() {
  local table=${2:-baton/ops/linear/tuned/nvidia-h200.json}
  python3 - "$1" "$table" <<'PY'
import json, sys
new, path = sys.argv[1], sys.argv[2]
try:
    extra = json.load(open(new))["entries"]
except (OSError, ValueError):
    sys.exit(0)
table = json.load(open(path))
keys = {(e["kind"], e["n_out"], e["k"], e["swiglu"]) for e in extra}
table["entries"] = [e for e in table["entries"] if (e["kind"], e["n_out"], e["k"], e["swiglu"]) not in keys] + extra
json.dump(table, open(path, "w"), indent=1)
print(f"merged {len(extra)} tuned entries from {new}")
PY
  cp "$table" "$R/nvidia-h200.json"
}
# per_step LOG: seconds per step between steps 10 and 30 of a `baton train ... --steps 30 --log-every 10` log (nan
# when it did not get there); faster NEW OLD: 1 when NEW is a number and at least 10% under OLD (or OLD is nan)
per_step() { python3 - "$1" <<'PY'
import re, sys
t = {int(m.group(1)): float(m.group(2)) for m in re.finditer(r"step (\d+): .*'elapsed_s': ([0-9.]+)", open(sys.argv[1]).read())}
print(f"{(t[30] - t[10]) / 20:.3f}" if 10 in t and 30 in t else "nan")
PY
}
faster() { python3 -c "import math; b, a = float('$1'), float('$2'); print(int(not math.isnan(b) and (math.isnan(a) or b < 0.9 * a)))"; }
case $phase in
p)
  ( export CUDA_VISIBLE_DEVICES=0
    OUT=$R timeout 200 python3 benchmarks/bench_ling_flash.py --num-layers 18 --num-requests 1 > "$R/ling18.log" 2>&1
    echo "ling18 rc=$? at $((SECONDS - t0)) s" >> "$R/ling18.log" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    OUT=$R timeout 290 python3 benchmarks/bench_ling_flash.py --num-layers 42 --quantization fp8 --num-requests 1 \
        > "$R/ling42_fp8.log" 2>&1
    echo "ling42 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/ling42_fp8.log" ) &
  wait ;;
r)
  ls -la /tmp/SmolLM2-135M-Instruct.Q4_1.gguf > "$R/gguf.txt" 2>&1
  # training data made by an earlier session (.carry1/traindata.tgz holds data/gsm8k{,.holdout}.jsonl): reused
  [ -f /tmp/traindata.tgz ] && tar xzf /tmp/traindata.tgz -C /tmp/train && export REUSE_DATA=1
  if [ "${REUSE_DATA:-0}" = 1 ] && [ -z "${BATON_TRAIN_TF32:-}" ]; then
    # DSpark's step went from 0.72 to 2.1 s between two commits (2026-11-29); TF32 is one suspect: A/B it
    for tf in 1 0; do
      CUDA_VISIBLE_DEVICES=$((1 - tf)) BATON_TRAIN_TF32=$tf timeout 100 baton train dspark \
          --train-data /tmp/train/data/gsm8k.jsonl --output /tmp/ab$tf --steps 30 --batch-size 16 --lr 6e-4 \
          --log-every 10 --num-layers 1 --block-size 16 --markov-rank 16 --target-layer-ids 1,27 \
          --num-anchors 256 --eval-prompts 0 --device cuda:0 --target-device cuda:0 > "$R/ab_tf32_$tf.log" 2>&1 &
    done
    wait
    on=$(per_step "$R/ab_tf32_1.log"); off=$(per_step "$R/ab_tf32_0.log")
    keep=$((1 - $(faster "$off" "$on")))
    echo "dspark s/step: tf32 on $on, off $off -> BATON_TRAIN_TF32=$keep" | tee "$R/ab_tf32.txt"
    export BATON_TRAIN_TF32=$keep
  fi
  # the report's T 0.7 rows on the sampled graphs (a failure there errors those rows only: bench_drafts goes on)
  setsid nohup env OUT=/tmp/train GSM8K=/tmp/gsm8k GPUS=cuda:0,cuda:1 NUM_PROMPTS=${NUM_PROMPTS:-3000} \
      EPOCHS=${EPOCHS:-2} DATA_BUDGET=${DATA_BUDGET:-240} TRAIN_BUDGET=${TRAIN_BUDGET:-300} MAX_NEW=${MAX_NEW:-320} \
      bash baton/train/recipe_smollm2.sh /tmp/train > /tmp/train/recipe.log 2>&1 < /dev/null &
  if [ "${REUSE_DATA:-0}" != 1 ]; then  # GPU 1 is free while GPU 0 generates the data
    CUDA_VISIBLE_DEVICES=1 timeout ${TUNE_S:-230} python3 -m baton.ops.linear.bench --tune --m 1 6 16 \
        --json "$R/linear_tune.json" --write-table "$R/nvidia-h200.json" > "$R/linear_tune.log" 2>&1
    echo "tune rc=$? at $((SECONDS - t0)) s" >> "$R/linear_tune.log"
  else
    sleep 20
  fi
  cp /tmp/train/recipe.log "$R/" ;;
w)
  [ -f /tmp/res/w/tp_gpu_tests.log ] || tp_gpu_tests  # correctness only (training shares the GPUs): once
  end=$((t0 + ${WAIT_S:-540}))  # counted from the phase's start (the tests above included): keep it under 560
  while [ $SECONDS -lt $end ] && ! grep -q "report done" /tmp/train/recipe.log; do sleep 10; done
  cp /tmp/train/recipe.log /tmp/train/*.log "$R/" 2>/dev/null
  for d in nextn dspark; do
    [ -f /tmp/train/$d/model.safetensors ] && tar czf "$OUT/$d.tgz" -C /tmp/train $d
  done
  cp /tmp/train/data/*.summary.json "$R/" 2>/dev/null
  cp /tmp/res/drafts_* "$R/" 2>/dev/null; cp /tmp/train/drafts_* "$R/" 2>/dev/null; cp -r /tmp/train/results "$R/" 2>/dev/null ;;
e)
  ( export CUDA_VISIBLE_DEVICES=0
    # the one-kernel decode attention: its kernel tests compiled, then the A/B of the whole decode in one run
    timeout 120 python3 -m pytest -q tests/ops/test_attention_fused.py -p no:cacheprovider -rfEs \
        > "$R/fused_attention_tests.log" 2>&1
    OUT=$R timeout 150 python3 benchmarks/bench_smollm2_decode.py --fused-attention ab > "$R/smollm2.log" 2>&1
    echo "smollm2 rc=$? at $((SECONDS - t0)) s" >> "$R/smollm2.log"
    # census: plain and the shipped NEXTN (3 steps), unfused and fused attention
    for alg in none NEXTN; do for f in 0 1; do
      BATON_FUSED_ATTENTION=$f timeout 60 python3 -m baton census --speculative-algorithm $alg --input-len 512 \
          --num-steps 200 --output-file "$R/census_smollm2_${alg}_fused$f.jsonl" > "$R/census_smollm2_${alg}_fused$f.log" 2>&1
    done; done
    echo "census rc=$? at $((SECONDS - t0)) s" >> "$R/census_smollm2_NEXTN_fused1.log" )
  export PYTHONFAULTHANDLER=1 BATON_TP_TIMEOUT=120 BATON_TP_ALLREDUCE=${BATON_TP_ALLREDUCE:-auto}
  OUT=$R timeout -s ABRT ${TP_S:-250} python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 \
      --modes plain,nextn --num-requests 1 > "$R/tp2.log" 2>&1
  echo "tp2 rc=$? at $((SECONDS - t0)) s" >> "$R/tp2.log"
  left=$((540 - (SECONDS - t0)))
  if [ $left -gt 120 ]; then
    OUT=$R timeout -s ABRT $left python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 --quantization fp8 \
        --modes nextn --num-requests 1 > "$R/tp2_fp8_nextn.log" 2>&1
    echo "tp2 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/tp2_fp8_nextn.log"
  fi ;;
a)  # no GGUF needed: SmolLM2's step times on dummy weights at its config (timing does not depend on the values;
    # speculation at the GSM8K accept lengths, simulated). GPU 0: the new kernels' tests and graph tests, then the
    # censuses; GPU 1: the linear tune at M=6 for SmolLM2's shapes, then the fp8 MoE tile sweep.
  ( export CUDA_VISIBLE_DEVICES=0
    timeout -s INT -k 10 150 python3 -m pytest -q tests/ops/test_attention_triton.py tests/ops/test_attention_fused.py \
        -p no:cacheprovider -rfEs --durations=5 > "$R/attention_tests.log" 2>&1
    echo "attention tests rc=$? at $((SECONDS - t0)) s" >> "$R/attention_tests.log"
    timeout -s INT -k 10 170 python3 -m pytest -q tests/engine/test_cuda_graphs.py -k "llama_nextn or sampled or no_blocking" \
        -p no:cacheprovider -rfEs --durations=10 > "$R/graph_tests.log" 2>&1
    echo "graph tests rc=$? at $((SECONDS - t0)) s" >> "$R/graph_tests.log"
    for run in none:0 none:1 NEXTN:0 NEXTN:1 DSPARK:1 DSPARK:0; do
      [ $((SECONDS - t0)) -gt 480 ] && break
      BATON_FUSED_ATTENTION=${run##*:} smol_census "${run%%:*}" "${run%%:*}_fused${run##*:}" 50
    done ) &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 200 python3 -m baton.ops.linear.bench --tune --m 6 --only smol --json "$R/linear_tune_smol_m6.json" \
        --write-table "$R/nvidia-h200-smol-m6.json" > "$R/linear_tune_smol_m6.log" 2>&1
    echo "tune rc=$? at $((SECONDS - t0)) s" >> "$R/linear_tune_smol_m6.log"
    PYTHONUNBUFFERED=1 timeout $((500 - (SECONDS - t0))) python3 -m baton.ops.moe.bench --fp8 --sweep --tokens 1 6 \
        --routes uniform --no-torch --json "$R/moe_fp8_sweep.jsonl" > "$R/moe_fp8_sweep.log" 2>&1
    echo "moe sweep rc=$? at $((SECONDS - t0)) s" >> "$R/moe_fp8_sweep.log" ) &
  wait ;;
b)  # after phase a's tunings landed (the smol M=6 linear entries, FP8_CONFIGS): GPU 0: the speculative SmolLM2
    # censuses again (dummy weights; DSpark's needed the simulated-accept fix) and the sampled-graph tests; GPU 1:
    # the whole Ling-3.0-flash with fp8 experts on one GPU; then fp8 NEXTN at TP2
  ( export CUDA_VISIBLE_DEVICES=0
    for alg in NEXTN DSPARK; do smol_census $alg $alg; done
    timeout -s INT -k 10 200 python3 -m pytest -q tests/engine/test_cuda_graphs.py -k "sampled" \
        -p no:cacheprovider -rfEs --durations=10 > "$R/sampled_graph_tests.log" 2>&1
    echo "sampled graph tests rc=$? at $((SECONDS - t0)) s" >> "$R/sampled_graph_tests.log" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    OUT=$R timeout 290 python3 benchmarks/bench_ling_flash.py --num-layers 42 --quantization fp8 --num-requests 1 \
        > "$R/ling42_fp8.log" 2>&1
    echo "ling42 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/ling42_fp8.log" ) &
  wait
  export PYTHONFAULTHANDLER=1 BATON_TP_TIMEOUT=120 BATON_TP_ALLREDUCE=auto
  OUT=$R timeout -s ABRT $((540 - (SECONDS - t0))) python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 \
      --quantization fp8 --modes nextn --num-requests 1 > "$R/tp2_fp8_nextn.log" 2>&1
  echo "tp2 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/tp2_fp8_nextn.log" ;;
g)  # the censuses again with exclusive attribution (PDL overlap given to the kernel that started first) and the top
    # kernels: SmolLM2 plain / NEXTN / DSpark on dummy weights (GPU 0), the 42-layer fp8 model on one GPU (GPU 1)
  ( export CUDA_VISIBLE_DEVICES=0
    for alg in none NEXTN DSPARK; do smol_census $alg $alg; done ) &
  ( export CUDA_VISIBLE_DEVICES=1
    OUT=$R timeout ${G_S:-220} python3 benchmarks/bench_ling_flash.py --num-layers 42 --quantization fp8 --num-requests 1 \
        > "$R/ling42_fp8.log" 2>&1
    echo "ling42 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/ling42_fp8.log" ) &
  wait ;;
n)  # the code of 2026-11-30's CPU half, on the GPU (no GGUF needed): GPU 0: the compiled tests of the argmax /
    # Markov-chain and RMSNorm kernels and of the linear GEMV form over a few rows, the graph-vs-eager tests that
    # now run them, the argmax bench, the linear tune of SmolLM2's shapes at M = 4 and 9 (merged into this copy's
    # table, which the censuses then read; it comes back in n.tgz), the SmolLM2 censuses; GPU 1: the Ling shapes
    # at M = 6 (their m8 entries)
  TABLE=baton/ops/linear/tuned/nvidia-h200.json
  ( export CUDA_VISIBLE_DEVICES=0
    timeout -s INT -k 10 200 python3 -m pytest -q tests/ops/test_argmax_triton.py tests/ops/test_rmsnorm_triton.py \
        tests/ops/test_linear_table.py tests/ops/test_linear_triton.py -p no:cacheprovider -rfEs --durations=5 \
        > "$R/kernel_tests.log" 2>&1
    echo "kernel tests rc=$? at $((SECONDS - t0)) s" >> "$R/kernel_tests.log"
    timeout -s INT -k 10 150 python3 -m pytest -q tests/engine/test_cuda_graphs.py -k "dspark or llama_nextn" \
        -p no:cacheprovider -rfEs --durations=5 > "$R/graph_tests.log" 2>&1
    echo "graph tests rc=$? at $((SECONDS - t0)) s" >> "$R/graph_tests.log"
    timeout 60 python3 -m baton.ops.argmax.bench --json "$R/argmax_bench.json" > "$R/argmax_bench.log" 2>&1
    timeout 120 python3 -m baton.ops.linear.bench --tune --m 4 9 --only smol --json "$R/linear_tune_smol.json" \
        --write-table "$TABLE" > "$R/linear_tune_smol.log" 2>&1
    cp "$TABLE" "$R/nvidia-h200.json"
    for alg in none NEXTN DSPARK; do smol_census $alg $alg; done ) &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout ${TUNE_S:-450} python3 -m baton.ops.linear.bench --tune --m 6 --only ling --json "$R/linear_tune_ling6.json" \
        --write-table "$R/nvidia-h200-ling-m6.json" > "$R/linear_tune_ling6.log" 2>&1 ) &
  wait ;;
s)  # the serving path at TP2 (issue 6 asks for `baton bench`): baton serve + baton bench on the whole
    # Ling-3.0-flash shape, dummy weights, 8192 in / 1024 out, concurrency 1 (fastapi / uvicorn travel in .whl).
    # MODES="plain nextn dspark-shaped", TP=4 on a 4-GPU machine for issue 8.
  for mode in ${MODES:-plain nextn}; do
    MODEL=ling-3.0-flash TP=${TP:-2} MODE=$mode NUM_PROMPTS=${NUM_PROMPTS:-2} PORT=$((30000 + RANDOM % 1000)) \
        timeout ${S_S:-270} bash benchmarks/serve_bench.sh "$R" > "$R/serve_bench_$mode.log" 2>&1
    echo "serve bench $mode rc=$? at $((SECONDS - t0)) s" >> "$R/serve_bench_$mode.log"
    pkill -f "baton serve" 2>/dev/null; sleep 3  # a server left by a timeout (its ranks follow it)
  done ;;
m)  # the fp8 MoE tiles (issue 9's largest loss at T=1): sweep at T=1 and 6 on GPU 0; the winners go into
    # FP8_CONFIGS in baton/ops/moe/triton.py; GPU 1 meanwhile: the rest of the linear tune at M=6 (verify shapes)
  CUDA_VISIBLE_DEVICES=0 timeout ${MOE_S:-400} python3 -m baton.ops.moe.bench --fp8 --sweep --tokens 1 6 \
      --routes uniform --no-torch --json "$R/moe_fp8_sweep.jsonl" > "$R/moe_fp8_sweep.log" 2>&1 &
  CUDA_VISIBLE_DEVICES=1 timeout ${TUNE_S:-400} python3 -m baton.ops.linear.bench --tune --m 6 \
      --json "$R/linear_tune_m6.json" --write-table "$R/nvidia-h200-m6.json" > "$R/linear_tune_m6.log" 2>&1
  wait ;;
t)  # tune the decode-shape linear kernels (the census's largest loss): commit the table as
    # baton/ops/linear/tuned/nvidia-h200.json, then rerun the Ling / SmolLM2 benches
  # first the kernels against their floors, with and without PDL (the A/B issue 5 asks for), then the sweep
  CUDA_VISIBLE_DEVICES=0 timeout 150 python3 -m baton.ops.linear.bench --json "$R/linear.json" > "$R/linear.log" 2>&1
  CUDA_VISIBLE_DEVICES=0 timeout 420 python3 -m baton.ops.linear.bench --tune --m 1 6 16 --json "$R/linear_tune.json" \
      --write-table "$R/nvidia-h200.json" > "$R/linear_tune.log" 2>&1 ;;
c)  # a call that carries a part of the GGUF (a training session's first two calls); C_TUNE=1 also tunes SmolLM2's
    # shapes at M = 9 (the m16 bucket: DSpark's gamma-8 verify and its 16-row draft; GPU 0), for phase x to merge,
    # and takes the SmolLM2 step censuses (GPU 1)
  ls /tmp/parts > "$R/parts.txt"
  if [ "${C_TUNE:-0}" = 1 ]; then
    CUDA_VISIBLE_DEVICES=0 timeout ${TUNE_S:-200} python3 -m baton.ops.linear.bench --tune --m 9 --only smol \
        --json "$R/linear_tune_smol_m9.json" --write-table /tmp/res/tuned-smol-m9.json > "$R/linear_tune_smol_m9.log" 2>&1 &
    # GPU 1 meanwhile: the SmolLM2 step censuses (dummy weights), DSpark now drafting its whole 16-slot block
    ( export CUDA_VISIBLE_DEVICES=1; for alg in none NEXTN DSPARK; do smol_census $alg $alg 60; done ) &
    wait; cp /tmp/res/tuned-smol-m9.json "$R/" 2>/dev/null
  fi
  # C_FP8=tp2 | one: issue 9's fp8 NEXTN (5,1,6) at simulated accept 3.25 and plain (FP8_MODES; at TP2 NEXTN
  # alone by default: plain was measured on 2026-11-30d), the whole
  # 42-layer shape: at TP2 (both GPUs), or on one GPU (peak memory in the JSON); census each. Since 2026-11-30e fp8
  # prefill runs the aligned kernels (it dequantised every expert before: 20 s TTFT, and a cold TP2 first request
  # passed the 120 s no-progress limit); the fp8 MoE GPU tests, the prefill shape among them, run first
  export PYTHONFAULTHANDLER=1 BATON_TP_TIMEOUT=${BATON_TP_TIMEOUT:-300}
  fp8_tests() {  # once a machine (the second c call on a warm machine reads the first one's log)
    if [ ! -f "$R/moe_fp8_tests.log" ]; then
      CUDA_VISIBLE_DEVICES=0 timeout -s INT -k 10 ${FP8_TEST_S:-120} python3 -m pytest -q tests/ops/test_moe_fp8.py \
          -p no:cacheprovider -rfEs --durations=5 > "$R/moe_fp8_tests.log" 2>&1
      echo "fp8 moe tests rc=$? at $((SECONDS - t0)) s" >> "$R/moe_fp8_tests.log"
    fi
    # the aligned fp8 kernels (new, first compiled here) failing their tests: the benches take the old prefill
    if grep -q "FAILED.*aligned_experts_match\|FAILED.*ling_shapes\[300" "$R/moe_fp8_tests.log"; then
      export BATON_FP8_ALIGNED=0; echo "aligned fp8 tests failed: BATON_FP8_ALIGNED=0" >> "$R/moe_fp8_tests.log"
    fi
  }
  case ${C_FP8:-} in
    tp2) fp8_tests
         OUT=$R timeout -s ABRT ${FP8_S:-330} python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 \
             --quantization fp8 --modes ${FP8_MODES:-nextn} --num-requests 1 > "$R/tp2_fp8.log" 2>&1
         echo "tp2 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/tp2_fp8.log" ;;
    one) # the whole model on one GPU, the A/B of the drafts' fp8 lm_head in one run (a GPU each): GPU 0 with it
         # (plain at the current kernels first, which the flag does not touch; then NEXTN with the new kernel),
         # GPU 1 without it (NEXTN), then the fp8_linear kernel's GPU
         # tests and bench (its tile sweep at the Ling lm_head); C_TUNE_TP2=1 also the TP2 M=6 linear shapes the
         # table lacks (--skip-tuned: dense_gate_up, dense_down, lm_head)
         fp8_tests
         ( export CUDA_VISIBLE_DEVICES=1
           OUT=$R timeout ${FP8_S:-330} python3 benchmarks/bench_ling_flash.py --num-layers 42 --quantization fp8 \
               --modes nextn --num-requests 1 > "$R/ling42_fp8_nextn_bf16head.log" 2>&1
           echo "ling42 fp8 nextn (bf16 draft head) rc=$? at $((SECONDS - t0)) s" >> "$R/ling42_fp8_nextn_bf16head.log"
           timeout -s INT -k 10 90 python3 -m pytest -q tests/ops/test_fp8_linear.py -p no:cacheprovider -rfEs \
               > "$R/fp8_linear_tests.log" 2>&1
           timeout 120 python3 -m baton.ops.fp8_linear.bench --shapes 157184x2560 78592x2560 --rows 1 --sweep \
               --json "$R/fp8_linear_bench.json" > "$R/fp8_linear_bench.log" 2>&1
           if [ "${C_TUNE_TP2:-0}" = 1 ]; then
             timeout ${TUNE_S:-200} python3 -m baton.ops.linear.bench --tune --tp-size 2 --only ling --m 6 \
                 --skip-tuned --json "$R/linear_tune_tp2_m6.json" --write-table "$R/nvidia-h200-tp2-m6.json" \
                 > "$R/linear_tune_tp2_m6.log" 2>&1
           fi ) &
         CUDA_VISIBLE_DEVICES=0 OUT=$R timeout ${FP8_S:-330} python3 benchmarks/bench_ling_flash.py --num-layers 42 \
             --quantization fp8 --modes ${FP8_MODES:-plain,nextn} --num-requests 1 --enable-fp8-draft-lm-head \
             > "$R/ling42_fp8.log" 2>&1
         echo "ling42 fp8 (fp8 draft head) rc=$? at $((SECONDS - t0)) s" >> "$R/ling42_fp8.log"
         wait ;;
  esac ;;
x)  # (the GGUF, carried data) issue 7: with ASYNC_AB=1 an A/B of the async host-to-device copies (30 steps a GPU;
    # off by default: no gain on 2026-11-30e); BATCHED_AB=1 also the --batched-loss A/B; then two
    # DSpark drafters trained side by side in the background
    # (benchmarks/train_more_dspark.sh: A from scratch with --init target on GPU 0, B the shipped drafter trained
    # further on GPU 1, TRAIN_BUDGET s each), then STS and the GSM8K report of each; phase y waits for it
  ls -la /tmp/SmolLM2-135M-Instruct.Q4_1.gguf > "$R/gguf.txt" 2>&1
  mkdir -p /tmp/train && tar xzf /tmp/traindata.tgz -C /tmp/train
  # a private copy of the tree: later calls overwrite this one (and its tuned table) while the runs go on
  rm -rf /tmp/repo_x && mkdir /tmp/repo_x && tar cf - --exclude='./.carry*' --exclude=./.whl . | tar xf - -C /tmp/repo_x
  merge_table /tmp/res/tuned-smol-m9.json /tmp/repo_x/baton/ops/linear/tuned/nvidia-h200.json  # phase c's, if any
  BATCHED=${BATCHED:-0}  # --batched-loss: 0.255 against 0.259 s/step on 2026-11-30d; BATCHED_AB=1 measures again
  # ab_steps NAME GPU [ENV=V ...] [-- ARGS]: 30 DSpark steps of the shipped shape on GPU, log $R/ab_NAME_GPU.log
  ab_steps() {
    local name=$1 gpu=$2; shift 2
    local envs=(); while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done; [ $# -gt 0 ] && shift
    ( cd /tmp/repo_x && env CUDA_VISIBLE_DEVICES=$gpu PYTHONPATH=/tmp/site:/tmp/repo_x "${envs[@]}" timeout 110 \
        python3 -m baton train dspark --train-data /tmp/train/data/gsm8k.jsonl --output /tmp/ab_$name$gpu --steps 30 \
        --batch-size 16 --lr 6e-4 --log-every 10 --num-layers 1 --block-size 16 --markov-rank 16 \
        --target-layer-ids 1,27 --num-anchors 256 --eval-prompts 0 --device cuda:0 --target-device cuda:0 "$@" \
        > "$R/ab_${name}_$gpu.log" 2>&1 )
  }
  if [ "${ASYNC_AB:-0}" = 1 ]; then  # measured on 2026-11-30e: 0.354 s/step blocking, 0.351 async (no gain)
    # A/B of the sync-free host-to-device copies (BATON_TRAIN_ASYNC_H2D): 30 steps each, GPU 0 off, GPU 1 on
    ab_steps async 0 BATON_TRAIN_ASYNC_H2D=0 & ab_steps async 1 BATON_TRAIN_ASYNC_H2D=1 & wait
    echo "dspark s/step: blocking copies $(per_step "$R/ab_async_0.log"), async $(per_step "$R/ab_async_1.log")" \
        | tee "$R/ab_async.txt"
  fi
  # where a 0.24 s step goes: the runs below profile steps 11..15 (PROFILE_STEPS, torch.profiler; profile.json in
  # each drafter's directory); PROFILE=1 also profiles 30 steps of one GPU alone first
  if [ "${PROFILE:-0}" = 1 ]; then
    ab_steps profile 0 -- --profile-steps 5
    cp /tmp/ab_profile0/profile.txt /tmp/ab_profile0/profile.json "$R/" 2>/dev/null
  fi
  if [ "${BATCHED_AB:-0}" = 1 ]; then  # A/B of --batched-loss: 30 steps each, GPU 0 per sequence, GPU 1 batched
    ab_steps batched 0 & ab_steps batched 1 -- --batched-loss & wait
    off=$(per_step "$R/ab_batched_0.log"); on=$(per_step "$R/ab_batched_1.log")
    BATCHED=$(faster "$on" "$off")
    echo "dspark s/step: per sequence $off, batched $on -> BATCHED=$BATCHED" | tee "$R/ab_batched.txt"
  fi
  EXTRA=""; [ "$BATCHED" = 1 ] && EXTRA="--batched-loss"
  # `cd || exit;` not `cd &&`: `cd && cmd > log &` backgrounds a subshell that keeps the call's stdout open until
  # cmd ends (a piped call of this phase then waited to its limit, 2026-11-30f)
  ( cd /tmp/repo_x || exit; setsid nohup env PYTHONPATH=/tmp/site:/tmp/repo_x GSM8K=/tmp/gsm8k GPUS=cuda:0,cuda:1 \
      EXTRA_TRAIN_ARGS="$EXTRA" TRAIN_BUDGET=${TRAIN_BUDGET:-700} MODE=${MODE:-ab} NEW_DATA=${NEW_DATA:-0} \
      PROFILE_STEPS=${PROFILE_STEPS:-5} \
      A_INIT=${A_INIT:-scratch} \
      DATA_BUDGET=${DATA_BUDGET:-150} bash benchmarks/train_more_dspark.sh /tmp/train \
      > /tmp/train/more.log 2>&1 < /dev/null & )
  sleep 30; cp /tmp/train/more.log "$R/"; tail -3 /tmp/train/dspark_A.log /tmp/train/dspark_B.log > "$R/start.txt" 2>&1 ;;
y)  # wait for phase x's runs (up to WAIT_S s from this call's start), then pack what exists
  # A drafter is packed into $OUT as soon as it is saved (a call cut short by the device budget still returns
  # what $OUT holds), and again at the end (its sts.json comes later)
  pack() { for x in A B; do [ -f /tmp/train/dspark_$x/model.safetensors ] && \
             tar czf "$OUT/dspark_$x.tgz" -C /tmp/train dspark_$x; done
           # NEW_DATA's records, for a later session to carry (beside traindata.tgz) instead of generating again
           ls /tmp/train/data/more_*.jsonl > /dev/null 2>&1 && tar czf "$OUT/moredata.tgz" -C /tmp/train \
               $(cd /tmp/train && ls data/more_*.jsonl); }
  end=$((t0 + ${WAIT_S:-540}))
  packed=0
  while [ $SECONDS -lt $end ] && ! grep -q "report done" /tmp/train/more.log; do
    [ $packed = 0 ] && ls /tmp/train/dspark_*/model.safetensors > /dev/null 2>&1 && { sleep 5; pack; packed=1; }
    sleep 10
  done
  cp /tmp/train/more.log /tmp/train/*.log "$R/" 2>/dev/null
  pack
  cp /tmp/train/results/* /tmp/train/drafts_* "$R/" 2>/dev/null; ls -R /tmp/train | head -50 > "$R/ls.txt" ;;
f)  # issue 9's close-out, first call (~500 s). GPU 0: the fp8 / bf16 MoE kernel tests compiled, then the fp8 tile
    # sweep (the scalar-scale kernel of 7ee2719); GPU 1: the fp8 sweep at one TP2 rank's experts (I = 384) with bf16
    # direct beside it, then the linear tune of one TP2 rank's Ling shapes at M = 1 and 6 (merged into this copy's
    # table). Then fp8 plain and NEXTN at TP2 with rank 0's census. Phase f1 follows.
  ( export CUDA_VISIBLE_DEVICES=0
    timeout -s INT -k 10 150 python3 -m pytest -q tests/ops/test_moe_fp8.py tests/ops/test_moe_triton.py \
        -p no:cacheprovider -rfEs --durations=5 > "$R/moe_tests.log" 2>&1
    echo "moe tests rc=$? at $((SECONDS - t0)) s" >> "$R/moe_tests.log"
    timeout 110 python3 -m baton.ops.moe.bench --fp8 --sweep --tokens 1 6 --routes uniform --no-torch \
        --json "$R/moe_fp8_sweep.jsonl" > "$R/moe_fp8_sweep.log" 2>&1
    echo "moe sweep rc=$? at $((SECONDS - t0)) s" >> "$R/moe_fp8_sweep.log" ) &
  ( export CUDA_VISIBLE_DEVICES=1
    timeout 100 python3 -m baton.ops.moe.bench --fp8 --sweep --tokens 1 6 --routes uniform --no-torch --tp-size 2 \
        --json "$R/moe_fp8_sweep_tp2.jsonl" > "$R/moe_fp8_sweep_tp2.log" 2>&1
    timeout 40 python3 -m baton.ops.moe.bench --modes direct --tokens 1 6 --routes uniform --no-torch --tp-size 2 \
        --json "$R/moe_bf16_tp2.jsonl" > "$R/moe_bf16_tp2.log" 2>&1
    echo "moe tp2 rc=$? at $((SECONDS - t0)) s" >> "$R/moe_bf16_tp2.log"
    timeout ${TUNE_S:-150} python3 -m baton.ops.linear.bench --tune --tp-size 2 --only ling --m 1 6 \
        --json "$R/linear_tune_tp2.json" --write-table /tmp/res/nvidia-h200-tp2.json > "$R/linear_tune_tp2.log" 2>&1
    echo "tune rc=$? at $((SECONDS - t0)) s" >> "$R/linear_tune_tp2.log"; cp /tmp/res/nvidia-h200-tp2.json "$R/" ) &
  wait
  merge_table /tmp/res/nvidia-h200-tp2.json
  export PYTHONFAULTHANDLER=1 BATON_TP_TIMEOUT=120
  OUT=$R timeout -s ABRT ${FP8_S:-200} python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 --quantization fp8 \
      --modes plain,nextn --num-requests 1 > "$R/tp2_fp8.log" 2>&1
  echo "tp2 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/tp2_fp8.log" ;;
f1) # issue 9's close-out, second call (~400 s): the 42-layer fp8 model on one GPU (plain and NEXTN, census, peak
    # memory); then bf16 NEXTN at TP2 with phase f's TP2 linear entries (merged again: this call's tree is fresh)
  merge_table /tmp/res/nvidia-h200-tp2.json
  CUDA_VISIBLE_DEVICES=0 OUT=$R timeout 230 python3 benchmarks/bench_ling_flash.py --num-layers 42 --quantization fp8 \
      --num-requests 1 > "$R/ling42_fp8.log" 2>&1
  echo "ling42 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/ling42_fp8.log"
  export PYTHONFAULTHANDLER=1 BATON_TP_TIMEOUT=120
  OUT=$R timeout -s ABRT 150 python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 --modes nextn \
      --num-requests 1 > "$R/tp2_nextn_tuned.log" 2>&1
  echo "tp2 nextn rc=$? at $((SECONDS - t0)) s" >> "$R/tp2_nextn_tuned.log" ;;
d)
  [ "${TP_TESTS:-1}" = 1 ] && tp_gpu_tests  # TP_TESTS=0: the benches (and their exclusive censuses) only
  export PYTHONFAULTHANDLER=1 BATON_TP_TIMEOUT=120  # a hang dumps rank 0's Python stacks (timeout -s ABRT)
  BATON_TP_ALLREDUCE=auto timeout -s ABRT 50 python3 -m baton.ops.allreduce.bench --tp-size 2 \
      --json "$R/allreduce.json" > "$R/allreduce.log" 2>&1
  for m in plain nextn; do
    OUT=$R timeout -s ABRT 140 python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 --modes $m --num-requests 1 \
        > "$R/tp2_$m.log" 2>&1
    echo "tp2 $m rc=$? at $((SECONDS - t0)) s" >> "$R/tp2_$m.log"
  done
  # fp8 experts at TP2, plain and NEXTN (issue 9 asks for both)
  OUT=$R timeout -s ABRT ${FP8_S:-220} python3 benchmarks/bench_ling_flash.py --num-layers 42 --tp-size 2 --quantization fp8 \
      --modes plain,nextn --num-requests 1 > "$R/tp2_fp8.log" 2>&1
  echo "tp2 fp8 rc=$? at $((SECONDS - t0)) s" >> "$R/tp2_fp8.log" ;;
esac
nvidia-smi --query-gpu=index,memory.used --format=csv >> "$R/gpu.txt"
tar czf "$OUT/$phase.tgz" -C /tmp/res "$phase"
for f in "$R"/*.log; do echo "== $f"; tail -6 "$f"; done
echo "phase $phase: $((SECONDS - t0)) s"
