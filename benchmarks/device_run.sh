#!/usr/bin/env bash
# One call on the H200 that checks and times the fast path; everything lands in $OUT.
#   stage:   ../shared/tools/device-parts.sh split <SmolLM2 GGUF> 48   (then `stage 0`, a run that copies the part,
#            `stage 1`, this script) -- see benchmarks/README.md
#   run:     bash benchmarks/device_run.sh [all|tests|kernels|e2e]   with carry [".whl", ".carry"]
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
if [ -f .carry/part ]; then mkdir -p /tmp/parts && cp .carry/part "/tmp/parts/$(cat .carry/index)"; fi
if [ -f .carry/sha256 ] && [ ! -f /tmp/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ "$(ls /tmp/parts 2>/dev/null | wc -l)" -ge 2 ]; then
  cat /tmp/parts/* > /tmp/SmolLM2-135M-Instruct.Q4_1.gguf && sha256sum -c .carry/sha256
fi
source benchmarks/device_setup.sh
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print(torch.__version__, triton.__version__)" | tee -a "$OUT/gpu.txt"
t0=$SECONDS
if [ "$what" = all ] || [ "$what" = tests ]; then
  timeout 300 python3 -m pytest -q -m gpu tests -x -p no:cacheprovider 2>&1 | tail -40 > "$OUT/gpu_tests.log"
  tail -3 "$OUT/gpu_tests.log"
fi
if [ "$what" = all ] || [ "$what" = kernels ]; then
  timeout 240 python3 -m baton.ops.linear.bench --json "$OUT/linear.json" > "$OUT/linear.log" 2>&1; tail -25 "$OUT/linear.log"
fi
if [ "$what" = all ] || [ "$what" = e2e ]; then
  timeout 240 python3 benchmarks/bench_smollm2_decode.py > "$OUT/smollm2.log" 2>&1; tail -3 "$OUT/smollm2.log"
  timeout 400 python3 benchmarks/bench_ling_flash.py --num-layers 18 > "$OUT/ling.log" 2>&1; tail -30 "$OUT/ling.log"
fi
echo "elapsed $((SECONDS - t0)) s"
