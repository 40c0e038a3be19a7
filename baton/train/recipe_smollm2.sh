#!/usr/bin/env bash
# Retrain the shipped drafts of the embedded SmolLM2-135M-Instruct from scratch: data made by the target, a
# NEXTN head, a DSpark drafter (+ STS), and the GSM8K accept-length report. Every step is one `baton train`
# command (or one benchmark script); all seeds are fixed. Run from the repository root.
#
#   bash baton/train/recipe_smollm2.sh [OUT]                      # one GPU, time-shared
#   GPUS=cpu bash baton/train/recipe_smollm2.sh [OUT]             # no GPU (a smoke run with small NUM_PROMPTS etc.)
#   GPUS=cuda:0,cuda:1 bash baton/train/recipe_smollm2.sh [OUT]   # two GPUs: NEXTN and DSpark train side by side
#   SPLIT=1 GPUS=cuda:0,cuda:1 ...                                # SplitServe: target on the first, trainer on the second
#   ABLATE=1 [ABL_STEPS=400] ...                                  # also the Markov-rank, depth and init ablations
#   DSPARK_INIT=target ...                                        # DSpark layers start as the target's last layer
#   FROM_SHIPPED=1 ...                                            # both drafts start from the shipped ones (train further)
#   SAMPLES=2 ...                                                 # responses per prompt at each positive temperature
#   DATA_SEED=1 SKIP_PROMPTS=600 ...                              # a new round of data: fresh samples, later GSM8K
#                                                                 # prompts (the split keeps --holdout-seed 0)
#   SHIP=1 ...                                                    # copy the drafts into baton/drafts (the default)
#   DATA_BUDGET=270 TRAIN_BUDGET=300 ...                          # seconds: cut generation / each training run to fit
#   REUSE_DATA=1 ...                                              # keep an existing OUT/data/gsm8k.jsonl (no step 1)
#   EXTRA=none ...                                                # GSM8K only (default: + the general prompt set)
#   DOMAIN_PROMPTS=3 DOMAIN_TOKENS=128 ...                         # the domain report's size (step 4b)
#   DSPARK_MORE="b:850 b:800:data dp:800:data" ...                # DSpark trained further in stages (below)
#
# The shipped sizes (NEXTN one layer; DSpark one layer, block 16, Markov rank 16, taps 1,27; both bf16) keep
# the two drafts under 20 MB. Each training directory gets the checkpoint, metrics.json and train_curves.png;
# copy nextn/ and dspark/ into baton/drafts/smollm2-135m-instruct/ to ship them.
set -euo pipefail

OUT=${1:-runs/smollm2}
export OUT  # benchmarks/bench_drafts.py writes its report there (benchmarks.common.save)
GSM8K=${GSM8K:-../shared/data/gsm8k}
GPUS=${GPUS:-cuda:0}
G0=${GPUS%%,*}; G1=${GPUS##*,}
NUM_PROMPTS=${NUM_PROMPTS:-3000}
EPOCHS=${EPOCHS:-2}
GEN_BATCH=${GEN_BATCH:-1024}
REPORT_QUESTIONS=${REPORT_QUESTIONS:-32}
MAX_NEW=${MAX_NEW:-384}
# optional time budgets (seconds): generation stops starting batches, training cuts its step count (and its
# learning-rate schedule) to fit; unset = the full NUM_PROMPTS and EPOCHS
DATA_BUDGET=(${DATA_BUDGET:+--time-budget "$DATA_BUDGET"})
TRAIN_BUDGET=(${TRAIN_BUDGET:+--time-budget "$TRAIN_BUDGET"})
EXTRA=${EXTRA:-general}
EXTRA_PROMPTS=(); [ "$EXTRA" != none ] && EXTRA_PROMPTS=(--extra-prompts "$EXTRA")
SAMPLES=${SAMPLES:-1}
# FROM_SHIPPED=1: train the shipped drafts further (--init-from; DSpark's checkpoint also fixes its architecture)
SHIPPED_DIR=${SHIPPED_DIR:-baton/drafts/smollm2-135m-instruct}
INIT_N=(); INIT_D=(--init "${DSPARK_INIT:-random}")
if [ "${FROM_SHIPPED:-0}" = 1 ]; then
  SHIPPED_COPY=$OUT/shipped; rm -rf "$SHIPPED_COPY"; mkdir -p "$OUT"; cp -r "$SHIPPED_DIR" "$SHIPPED_COPY"  # SHIP=1 replaces it
  INIT_N=(--init-from "$SHIPPED_COPY/nextn"); INIT_D=(--init-from "$SHIPPED_COPY/dspark")
  LR=${LR:-3e-4}  # a fresh cosine schedule from trained weights, as benchmarks/train_more_dspark.sh
fi
LR=${LR:-6e-4}
DATA=$OUT/data/gsm8k.jsonl
HOLD=$OUT/data/gsm8k.holdout.jsonl
EVAL_PROMPTS=${EVAL_PROMPTS:-32}
EVAL_TOKENS=${EVAL_TOKENS:-256}  # also the report's --max-new-tokens
EVAL=(--holdout-data "$HOLD" --eval-prompts "$EVAL_PROMPTS" --eval-max-new-tokens "$EVAL_TOKENS" --eval-every 0)
COMMON=(--train-data "$DATA" --epochs "$EPOCHS" --batch-size 16 --lr "$LR" --seed 0 --save-dtype bfloat16
        "${TRAIN_BUDGET[@]}")
# Each command sees only the GPUs it uses (CUDA_VISIBLE_DEVICES), so inside it the first is always cuda:0.
idx() { case $1 in cuda:*) echo "${1#cuda:}" ;; *) echo 0 ;; esac; }
D=cuda:0; [ "$GPUS" = cpu ] && D=cpu  # the device every command names
if [ "${SPLIT:-0}" = 1 ]; then
  V0="$(idx "$G0"),$(idx "$G1")"; V1=$V0; DEV_N=(--target-device cuda:0 --device cuda:1); DEV_D=("${DEV_N[@]}")
else
  V0=$(idx "$G0"); V1=$(idx "$G1"); DEV_N=(--target-device "$D" --device "$D"); DEV_D=("${DEV_N[@]}")
fi
on() { local v=$1; shift; CUDA_VISIBLE_DEVICES=$v "$@"; }
t0=$SECONDS
stamp() { echo "[recipe] $1 done at $((SECONDS - t0)) s"; }

# 1. data: chat and 5-shot prompts (the format `baton eval gsm8k` sends), greedy + sampled at T 0.7; batched
#    generation through transformers with the target's own weights; plus the train split of the general prompt
#    set (baton/train/prompts.py: writing, explanation, code, summarisation, lists, translation, multi-turn chat;
#    EXTRA=none leaves it out), whose held-out split benchmarks/bench_domains.py measures on
if [ -s "$DATA" ] && [ "${REUSE_DATA:-0}" = 1 ]; then echo "[recipe] reusing $DATA"; else
on "$V0" baton train data --data-path "$GSM8K" --skip-prompts "${SKIP_PROMPTS:-0}" --num-prompts "$NUM_PROMPTS" \
    --prompt-formats chat,fewshot \
    "${EXTRA_PROMPTS[@]}" --temperatures 0,0.7 --samples-per-temperature "$SAMPLES" --top-p 0.95 --max-new-tokens "$MAX_NEW" --holdout-frac 0.02 --data-seed "${DATA_SEED:-0}" --holdout-seed 0 \
    --backend hf --gen-batch-size "$GEN_BATCH" --device "$D" --output "$DATA" "${DATA_BUDGET[@]}"
fi
stamp data

# 2. NEXTN head (Ling MTP structure, one Llama layer), 3 chain steps unrolled; 3. DSpark, one layer, block 16
on "$V0" baton train nextn "${COMMON[@]}" --output "$OUT/nextn" "${DEV_N[@]}" "${EVAL[@]}" --unroll-steps 3 \
    --eval-num-steps 3 "${INIT_N[@]}" > "$OUT/nextn.log" 2>&1 &
pid_n=$!
[ "$G0" = "$G1" ] && { wait $pid_n; stamp nextn; }
on "$V1" baton train dspark "${COMMON[@]}" --output "$OUT/dspark" "${DEV_D[@]}" "${EVAL[@]}" --num-layers 1 \
    --block-size 16 --markov-rank 16 --target-layer-ids 1,27 --num-anchors 256 "${INIT_D[@]}" \
    > "$OUT/dspark.log" 2>&1
stamp dspark
wait $pid_n || { tail -20 "$OUT/nextn.log"; exit 1; }
stamp nextn

# 3b. DSpark trained further, stage after stage (benchmarks/train_more_dspark.sh, each from the previous stage's
#     drafter with a fresh cosine schedule at lr 3e-4): MODE:SECONDS[:data], MODE b (one GPU), dp (both GPUs,
#     --dp-size 2) or grow (one GPU: the drafter grown by one layer, --grow-layers, saved in fp8); ":data" first
#     adds responses for the GSM8K prompts step 1 did not reach (STAGE_DATA_BUDGET seconds, default 150, as the
#     shipped drafter's stages had; every ":data" stage makes the same ones again: a
#     stage without it trains on step 1's data alone). The shipped drafter was trained with
#     DSPARK_MORE="b:850 b:800:data dp:800:data".
prev=$OUT/dspark; i=0
for stage in ${DSPARK_MORE:-}; do
  IFS=: read -r mode secs extra <<< "$stage"
  S=$OUT/more_$i; mkdir -p "$S"; ln -sfn ../data "$S/data"
  run=B; a_init=scratch
  if [ "$mode" = grow ]; then
    mode=a; run=A; a_init=grow
    GROW=$(( $(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['num_hidden_layers'])" \
                "$prev/config.json") + 1 ))
    export GROW
  fi
  SHIPPED=$prev MODE=$mode A_INIT=$a_init TRAIN_BUDGET=$secs NEW_DATA=$([ "$extra" = data ] && echo 1 || echo 0) \
      DATA_BUDGET=${STAGE_DATA_BUDGET:-150} REPORT=0 GPUS=$GPUS GSM8K=$GSM8K \
      bash benchmarks/train_more_dspark.sh "$S" > "$OUT/more_$i.log" 2>&1 \
      || { tail -20 "$OUT/more_$i.log"; exit 1; }
  prev=$S/dspark_$run; i=$((i + 1))
  stamp "dspark stage $stage"
done
if [ "$prev" != "$OUT/dspark" ]; then rm -rf "$OUT/dspark" && cp -r "$prev" "$OUT/dspark"; fi
on "$V1" baton train calibrate --draft "$OUT/dspark" --holdout-data "$HOLD" --output "$OUT/dspark/sts.json" \
    --target-device "$D" --device "$D" --mode greedy
stamp calibrate
# 3c. the drafts' hot vocabulary (--speculative-token-map) from the same responses: not shipped by default
baton train token-map --train-data "$DATA" --size "${TOKEN_MAP_SIZE:-8192}" --vocab-size 49152 \
    --output "$OUT/token_map.pt"

# 4. the report: accept length on GSM8K test (never trained on), greedy and T 0.7
on "$V0" python3 benchmarks/bench_drafts.py --nextn "$OUT/nextn" --data-path "$GSM8K" \
    --num-questions "$REPORT_QUESTIONS" --max-new-tokens "$EVAL_TOKENS" --dspark-gammas "" --device "$D" --output-name drafts_gsm8k_nextn > "$OUT/report_nextn.log" 2>&1 &
pid_r=$!
[ "$G0" = "$G1" ] && wait $pid_r
on "$V1" python3 benchmarks/bench_drafts.py --dspark "$OUT/dspark" --data-path "$GSM8K" \
    --num-questions "$REPORT_QUESTIONS" --max-new-tokens "$EVAL_TOKENS" --nextn-steps "" --device "$D" --output-name drafts_gsm8k_dspark > "$OUT/report_dspark.log" 2>&1
wait $pid_r
python3 benchmarks/plot_drafts.py "$OUT"/drafts_gsm8k_nextn.json "$OUT"/drafts_gsm8k_dspark.json \
    --output "$OUT/drafts_gsm8k.png" --title "accept length and TPOT on GSM8K test" || true
# 4b. beyond GSM8K: accept length and tok/s against plain on each domain of the general set's held-out split,
#     GSM8K and random ids, fixed and adaptive depth (benchmarks/bench_domains.py), for the new DSpark drafter
on "$V1" python3 benchmarks/bench_domains.py --speculative-algorithm DSPARK --speculative-draft-model-path "$OUT/dspark" \
    --speculative-num-draft-tokens 9 --per-domain "${DOMAIN_PROMPTS:-3}" --max-new-tokens "${DOMAIN_TOKENS:-128}" \
    --gsm8k "$GSM8K/test.jsonl" --device "$D" --name domains_dspark --plot "$OUT/domains_dspark.png" \
    > "$OUT/report_domains.log" 2>&1 || { tail -20 "$OUT/report_domains.log"; exit 1; }
stamp report

# 5. ablations (accept length of each choice, greedy, held-out prompts): Markov rank, draft depth, initialisation
if [ "${ABLATE:-0}" = 1 ]; then
  ABL=(--train-data "$DATA" "${DEV_D[@]}" --holdout-data "$HOLD" --eval-prompts 32 --eval-max-new-tokens 256
       --epochs 1 --batch-size 16 --lr 6e-4 --block-size 16 --num-anchors 256 --target-layer-ids 1,27 --seed 0
       ${ABL_STEPS:+--steps "$ABL_STEPS"})
  on "$V1" baton train ablate --algorithm dspark --vary markov_rank=0,16,64 --num-layers 1 \
      --output "$OUT/ablate-rank" "${ABL[@]}"
  on "$V1" baton train ablate --algorithm dspark --vary num_layers=1,2 --markov-rank 16 --output "$OUT/ablate-depth" \
      "${ABL[@]}"
  on "$V1" baton train ablate --algorithm dspark --vary init=random,target --num-layers 1 --markov-rank 16 \
      --output "$OUT/ablate-init" "${ABL[@]}"
  stamp ablate
fi

# 6. ship: the checkpoints (config, weights, STS) into the package, served by default on the embedded model
if [ "${SHIP:-0}" = 1 ]; then
  DEST=baton/drafts/smollm2-135m-instruct
  rm -rf "$DEST" && mkdir -p "$DEST/nextn" "$DEST/dspark"
  cp "$OUT/nextn/config.json" "$OUT/nextn/model.safetensors" "$DEST/nextn/"
  cp "$OUT/dspark/config.json" "$OUT/dspark/model.safetensors" "$OUT/dspark/sts.json" "$DEST/dspark/"
  echo '{"algorithm": "DSPARK", "num_draft_tokens": 9}' > "$DEST/defaults.json"
  du -sh "$DEST"
  stamp ship
fi
