#!/usr/bin/env bash
# Issue 7's DSpark accept length: the embedded SmolLM2's drafter trained further, then the GSM8K report. The
# shipped architecture stays (1 layer, block 16, Markov rank 16, taps 1,27; under 20 MB with the NEXTN head).
#
# MODE=ab (default): two drafters side by side, one GPU each:
#   A (first GPU):  from scratch, its layer initialised from the target's last layer (--init target; the init
#                   ablation at full length);
#   B (second GPU): the shipped drafter trained further (--init-from baton/drafts/smollm2-135m-instruct/dspark,
#                   a fresh schedule at LR_B).
#   A_INIT=grow: A is instead the shipped drafter grown to GROW (default 2) layers (`--grow-layers`: the new
#   layers start with zero output projections, so A starts as B does), saved in fp8 (`--save-dtype fp8`: a
#   2-layer drafter in fp8 is 9.3 MB, under the 20 MB the two shipped drafts may take) at LR_A (default 3e-4).
# MODE=a: A alone, on the first GPU. MODE=b: B alone, on the second GPU (the first when GPUS names one).
# MODE=dp: B alone over both GPUs (`baton train dspark --dp-size 2`: each GPU half of every batch, twice the
#   steps of one GPU in the same time); if the data-parallel run fails, B runs on the first GPU instead.
# NEW_DATA=1: first more data on both GPUs (GSM8K train prompts from SKIP, default 3000, which the 2026-11-29
#   data did not reach; 5-shot and chat, greedy; DATA_BUDGET seconds), appended to the training data.
# REPORT=0: stop after training (no STS calibration, no report).
# PROFILE_STEPS=N: each run profiles N steps after its first 10 (OUT/dspark_X/profile.{txt,json}: wall against GPU
#   kernel time per step, the top operators).
# Data: OUT/data/gsm8k.jsonl and its holdout, made by baton/train/recipe_smollm2.sh step 1 (reused, not remade).
# Each run: TRAIN_BUDGET seconds of optimiser steps; then STS calibration and benchmarks/bench_drafts.py (GSM8K
# test questions, gamma 4, 8, 16, greedy and T 0.7; B's report also runs the shipped NEXTN head at 3 steps). The
# one with the higher greedy accept length at gamma 8 is the one to ship (copy OUT/dspark_X/{config.json,
# model.safetensors,sts.json} to baton/drafts/.../dspark).
#
#   GPUS=cuda:0,cuda:1 TRAIN_BUDGET=1000 [MODE=dp] [NEW_DATA=1] [EXTRA_TRAIN_ARGS=--batched-loss] \
#       bash benchmarks/train_more_dspark.sh OUT
set -euo pipefail
OUT=${1:?usage: bash benchmarks/train_more_dspark.sh OUT (with OUT/data/gsm8k.jsonl)}
export OUT
GSM8K=${GSM8K:-../shared/data/gsm8k}
GPUS=${GPUS:-cuda:0,cuda:1}
G0=${GPUS%%,*}; G1=${GPUS##*,}
idx() { case $1 in cuda:*) echo "${1#cuda:}" ;; *) echo 0 ;; esac; }
D=cuda:0; [ "$GPUS" = cpu ] && D=cpu
DATA=$OUT/data/gsm8k.jsonl
HOLD=$OUT/data/gsm8k.holdout.jsonl
[ -s "$DATA" ] || { echo "no training data at $DATA: run baton/train/recipe_smollm2.sh step 1 first" >&2; exit 2; }
SHIPPED=${SHIPPED:-baton/drafts/smollm2-135m-instruct/dspark}
COMMON=(--train-data "$DATA" --epochs "${EPOCHS:-30}" --batch-size "${BATCH:-16}" --seed 0 --save-dtype bfloat16
        --time-budget "${TRAIN_BUDGET:-1000}" --holdout-data "$HOLD" --eval-prompts "${EVAL_PROMPTS:-32}"
        --eval-max-new-tokens "${MAX_NEW:-256}" --eval-every 0 --target-device "$D" --device "$D" --num-layers 1 --block-size 16
        --markov-rank 16 --target-layer-ids 1,27 --num-anchors "${ANCHORS:-256}" --profile-steps "${PROFILE_STEPS:-0}"
        ${EXTRA_TRAIN_ARGS:-})
t0=$SECONDS
if [ "${NEW_DATA:-0}" = 1 ]; then
  # GSM8K train has 7,473 questions: from SKIP on, half to each GPU
  SKIP=${SKIP:-3000}; HALF=$(( (7473 - SKIP + 1) / 2 ))
  for i in 0 1; do
    g=$G0; [ $i = 1 ] && g=$G1
    CUDA_VISIBLE_DEVICES=$(idx "$g") baton train data --data-path "$GSM8K" --skip-prompts $((SKIP + i * HALF)) \
        --num-prompts $HALF --prompt-formats fewshot,chat --temperatures 0 --max-new-tokens "${DATA_MAX_NEW:-320}" \
        --holdout-frac 0.02 --data-seed $((i + 1)) --backend hf --gen-batch-size "${GEN_BATCH:-1024}" --device "$D" \
        --time-budget "${DATA_BUDGET:-180}" --output "$OUT/data/more_$i.jsonl" > "$OUT/data_$i.log" 2>&1 &
  done
  wait || true
  ALL=$OUT/data/gsm8k_all.jsonl
  files=("$DATA"); for f in "$OUT"/data/more_0.jsonl "$OUT"/data/more_1.jsonl; do [ -s "$f" ] && files+=("$f"); done
  cat "${files[@]}" > "$ALL"
  echo "[more] data: $(wc -l < "$DATA") + $(( $(wc -l < "$ALL") - $(wc -l < "$DATA") )) records at $((SECONDS - t0)) s"
  DATA=$ALL; COMMON[1]=$DATA
fi
rc=0
B_ARGS=(--lr "${LR_B:-3e-4}" --init-from "$SHIPPED" --output "$OUT/dspark_B")
if [ "${MODE:-ab}" = dp ]; then
  CUDA_VISIBLE_DEVICES=$(idx "$G0"),$(idx "$G1") baton train dspark "${COMMON[@]}" "${B_ARGS[@]}" --dp-size 2 \
      > "$OUT/dspark_B.log" 2>&1 || {
    echo "[more] the data-parallel run failed:"; tr "\r" "\n" < "$OUT/dspark_B.log" | tail -20
    left=$(( ${TRAIN_BUDGET:-1000} - (SECONDS - t0) )); [ $left -lt 120 ] && left=120
    CUDA_VISIBLE_DEVICES=$(idx "$G0") baton train dspark "${COMMON[@]}" "${B_ARGS[@]}" --time-budget $left \
        > "$OUT/dspark_B.log" 2>&1 || rc=1; }
elif [ "${MODE:-ab}" = b ]; then
  CUDA_VISIBLE_DEVICES=$(idx "$G1") baton train dspark "${COMMON[@]}" "${B_ARGS[@]}" > "$OUT/dspark_B.log" 2>&1 \
      || { tr "\r" "\n" < "$OUT/dspark_B.log" | tail -20; rc=1; }
else
  if [ "${A_INIT:-scratch}" = grow ]; then  # the shipped drafter deepened (new layers start as the identity)
    A_ARGS=(--lr "${LR_A:-3e-4}" --init-from "$SHIPPED" --grow-layers "${GROW:-2}" --save-dtype fp8)
  else
    A_ARGS=(--lr "${LR_A:-6e-4}" --init target)
  fi
  CUDA_VISIBLE_DEVICES=$(idx "$G0") baton train dspark "${COMMON[@]}" "${A_ARGS[@]}" \
      --output "$OUT/dspark_A" > "$OUT/dspark_A.log" 2>&1 &
  pid_a=$!
  if [ "${MODE:-ab}" != a ]; then
    CUDA_VISIBLE_DEVICES=$(idx "$G1") baton train dspark "${COMMON[@]}" "${B_ARGS[@]}" > "$OUT/dspark_B.log" 2>&1 &
    pid_b=$!
  fi
  wait $pid_a || { echo "[more] A failed:"; tr "\r" "\n" < "$OUT/dspark_A.log" | tail -20; rc=1; }
  [ "${MODE:-ab}" = a ] || wait $pid_b || { echo "[more] B failed:"; tr "\r" "\n" < "$OUT/dspark_B.log" | tail -20; rc=1; }
fi
echo "[more] training done at $((SECONDS - t0)) s"
[ "${REPORT:-1}" = 1 ] || exit $rc  # REPORT=0: no calibration, no report (a stage of recipe_smollm2.sh)
for x in A B; do
  g=$G0; ref=(--nextn-steps "")
  # B's report also runs the shipped NEXTN head (3 steps): DSpark's TPOT against NEXTN's in one run (issue 7)
  [ $x = B ] && g=$G1 && ref=(--nextn "${NEXTN:-baton/drafts/smollm2-135m-instruct/nextn}" --nextn-steps 3)
  [ -f "$OUT/dspark_$x/model.safetensors" ] || continue
  ( CUDA_VISIBLE_DEVICES=$(idx "$g") baton train calibrate --draft "$OUT/dspark_$x" --holdout-data "$HOLD" \
        --output "$OUT/dspark_$x/sts.json" --target-device "$D" --device "$D" --mode greedy ${CAL_SEQS:+--max-seqs "$CAL_SEQS"} > "$OUT/calibrate_$x.log" 2>&1 \
        || echo "[more] calibration of $x failed (see calibrate_$x.log); its report runs without STS"
    CUDA_VISIBLE_DEVICES=$(idx "$g") python3 benchmarks/bench_drafts.py --dspark "$OUT/dspark_$x" --data-path "$GSM8K" \
        --num-questions "${REPORT_QUESTIONS:-32}" --max-new-tokens "${MAX_NEW:-256}" "${ref[@]}" --device "$D" \
        --output-name "drafts_gsm8k_dspark_$x" > "$OUT/report_$x.log" 2>&1 ) &
done
wait
echo "[more] report done at $((SECONDS - t0)) s"
exit $rc
