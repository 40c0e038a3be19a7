#!/usr/bin/env bash
# Retrain the shipped drafts of the embedded SmolLM2-135M-Instruct from scratch: data made by the target, a
# NEXTN head, a DSpark draft (+ STS), a DFlash baseline, and two short ablations. Every step is one
# `baton train` command; all seeds are fixed. Run from the repository root (GSM8K at ../shared/data/gsm8k).
#
#   bash baton/train/recipe_smollm2.sh [OUT]            # one GPU, time-shared (target and trainer on cuda:0)
#   TRAINER=cuda:1 bash baton/train/recipe_smollm2.sh   # two GPUs: target forwards on cuda:0 (SplitServe)
#
# Each training directory gets the checkpoint, metrics.json and train_curves.png; serve one with e.g.
#   baton serve --speculative-algorithm DSPARK --speculative-draft-model-path $OUT/dspark \
#       --speculative-dspark-confidence-sts-path $OUT/dspark/sts.json
set -euo pipefail

OUT=${1:-runs/smollm2}
GSM8K=${GSM8K:-../shared/data/gsm8k}
TARGET=${TARGET:-cuda:0}
TRAINER=${TRAINER:-$TARGET}
WORKERS=${WORKERS:-8}          # data-generation processes sharing the GPU
NUM_PROMPTS=${NUM_PROMPTS:-4000}
EPOCHS=${EPOCHS:-2}
DATA=$OUT/data/gsm8k.jsonl
HOLD=$OUT/data/gsm8k.holdout.jsonl
DEV=(--target-device "$TARGET" --device "$TRAINER")
EVAL=(--holdout-data "$HOLD" --eval-prompts 64 --eval-max-new-tokens 256 --eval-every 500)

# 1. data: chat and 5-shot prompts (the format `baton eval gsm8k` sends), greedy + two sampled settings
baton train data --data-path "$GSM8K" --num-prompts "$NUM_PROMPTS" --prompt-formats chat,fewshot \
    --temperatures 0,0.7,1.0 --top-p 0.95 --max-new-tokens 512 --holdout-frac 0.02 --data-seed 0 \
    --num-workers "$WORKERS" --device "$TARGET" --output "$DATA"

# 2. NEXTN head (Ling MTP structure, one Llama layer), 3 chain steps unrolled in training
baton train nextn --train-data "$DATA" --output "$OUT/nextn" "${DEV[@]}" "${EVAL[@]}" \
    --epochs "$EPOCHS" --batch-size 16 --lr 6e-4 --unroll-steps 3 --eval-num-steps 3 --seed 0

# 3. DSpark: 2 layers, gamma 7, Markov rank 256; then STS on the held-out records
baton train dspark --train-data "$DATA" --output "$OUT/dspark" "${DEV[@]}" "${EVAL[@]}" \
    --epochs "$EPOCHS" --batch-size 16 --lr 6e-4 --num-layers 2 --block-size 7 --markov-rank 256 \
    --num-anchors 512 --seed 0
baton train calibrate --draft "$OUT/dspark" --holdout-data "$HOLD" --output "$OUT/dspark/sts.json" \
    "${DEV[@]}" --mode greedy

# 4. DFlash baseline (same backbone, no Markov / confidence head, CE loss)
baton train dspark --algorithm dflash --train-data "$DATA" --output "$OUT/dflash" "${DEV[@]}" "${EVAL[@]}" \
    --epochs "$EPOCHS" --batch-size 16 --lr 6e-4 --num-layers 2 --block-size 7 --seed 0

# 5. ablations (accept length of each choice, greedy, held-out prompts): Markov rank and draft depth
ABL=(--train-data "$DATA" "${DEV[@]}" --holdout-data "$HOLD" --eval-prompts 64 --eval-max-new-tokens 256
     --epochs 1 --batch-size 16 --lr 6e-4 --block-size 7 --seed 0)
baton train ablate --algorithm dspark --vary markov_rank=0,32,128 --num-layers 2 --output "$OUT/ablate-rank" \
    --tv-weight 0.9 --ce-weight 0.1 "${ABL[@]}"
baton train ablate --algorithm dspark --vary num_layers=1,2 --markov-rank 256 --output "$OUT/ablate-depth" \
    "${ABL[@]}"
