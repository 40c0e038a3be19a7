"""The only module that reads ``os.environ``: every ``BATON_*`` variable, typed, with its default."""

from __future__ import annotations

import os
from pathlib import Path


def _get(name: str, default: str | None = None) -> str | None:
    return os.environ.get(name, default)


def cache_dir() -> Path:
    """Where converted tokenizers and other derived files live (``BATON_CACHE_DIR``)."""
    base = _get("BATON_CACHE_DIR") or os.path.join(
        _get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "baton"
    )
    return Path(base)


def log_level() -> str:
    return (_get("BATON_LOG_LEVEL") or "info").lower()


def pin_cpu_core() -> int | None:
    """Core to pin the engine thread to (``BATON_PIN_CORE``); unset leaves scheduling to the OS."""
    v = _get("BATON_PIN_CORE")
    return int(v) if v not in (None, "") else None


def disable_progress() -> bool:
    return _get("BATON_NO_PROGRESS", "0") not in ("0", "", "false", "False")


def gguf_cpu_quantized() -> bool:
    """``BATON_GGUF_QUANT`` (default on; ``0`` turns it off): on the CPU a GGUF with ``--dtype auto`` runs on its own
    Q4_1 / Q8_0 weights (baton.ops.quant_cpu: C kernels built once per machine, a few seconds, then cached) instead
    of weights dequantised to fp32 (what ``--dtype float32`` loads)."""
    return _get("BATON_GGUF_QUANT", "1") not in ("0", "", "false", "False")


def num_threads() -> int:
    """Intra-op threads for CPU compute (``BATON_NUM_THREADS``); default: the cores this process may run on (its
    affinity mask, which taskset / cgroups cpusets narrow), not the host's count."""
    v = _get("BATON_NUM_THREADS")
    if v:
        return max(1, int(v))
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # no sched_getaffinity (macOS)
        return max(1, os.cpu_count() or 1)


def openai_api_key() -> str | None:
    """``OPENAI_API_KEY``: the bench client sends it as ``Authorization: Bearer <key>``."""
    return _get("OPENAI_API_KEY") or None


def api_key() -> str | None:
    """``API_KEY``: the bench client's fallback, sent as a raw ``Authorization`` header (SGLang's rule)."""
    return _get("API_KEY") or None


def sync_debug() -> bool:
    """``BATON_SYNC_DEBUG=1`` runs the CUDA-graph decode loop under ``torch.cuda.set_sync_debug_mode("error")``:
    any blocking device-to-host read in the loop raises."""
    return _get("BATON_SYNC_DEBUG", "0") not in ("0", "", "false", "False")


def use_triton() -> bool:
    """``BATON_TRITON`` (default on): CUDA tensors take the Triton kernels; ``0`` forces the PyTorch fallbacks."""
    return _get("BATON_TRITON", "1") not in ("0", "", "false", "False")


def use_fla() -> bool:
    """``BATON_FLA`` (default on; ``0`` turns it off): CUDA prefill takes fla-core's ``chunk_kda`` instead of the
    PyTorch chunked form where fla-core is installed (tests/ops/test_kda_fla.py compares the two on CUDA)."""
    return _get("BATON_FLA", "1") not in ("0", "", "false", "False")


def train_tf32() -> bool:
    """``BATON_TRAIN_TF32`` (default on): draft training runs its fp32 matmuls (the frozen lm_head) in TF32 on CUDA;
    ``0`` keeps full fp32."""
    return _get("BATON_TRAIN_TF32", "1") not in ("0", "", "false", "False")


def train_async_h2d() -> bool:
    """``BATON_TRAIN_ASYNC_H2D`` (default on): draft training copies its per-sequence host tensors (token ids,
    anchors, slot weights) to the GPU through pinned memory without a stream sync; ``0`` takes the plain blocking
    copies (an A/B switch)."""
    return _get("BATON_TRAIN_ASYNC_H2D", "1") not in ("0", "", "false", "False")


def train_hf_features() -> bool:
    """``BATON_TRAIN_HF_FEATURES`` (default on): draft training computes a batch's target features in one padded
    transformers forward (llama targets); ``0`` takes baton's forward one sequence at a time."""
    return _get("BATON_TRAIN_HF_FEATURES", "1") not in ("0", "", "false", "False")


def fp8_aligned_prefill() -> bool:
    """``BATON_FP8_ALIGNED`` (default on): fp8 experts past the decode shapes (prefill) run the aligned Triton
    kernels with the block scales applied per tile; ``0`` dequantises every expert and runs the reference instead
    (slow: a dequantised copy of every expert; kept as a fallback)."""
    return _get("BATON_FP8_ALIGNED", "1") not in ("0", "", "false", "False")


def use_pdl() -> bool:
    """``BATON_PDL`` (default on): launch Triton kernels with programmatic dependent launch where the GPU supports it
    (compute capability >= 9); ``0`` turns it off."""
    return _get("BATON_PDL", "1") not in ("0", "", "false", "False")


def use_fused_attention() -> bool:
    """``BATON_FUSED_ATTENTION`` (default off): decode / verify attention of Llama layers in one Triton kernel
    (RoPE, cache write, split attention and merge; ops/attention/fused_decode.py) instead of three. Off by default
    because it measured slower than the three kernels in the SmolLM2 step census (docs/performance.md)."""
    return _get("BATON_FUSED_ATTENTION", "0") not in ("0", "", "false", "False")


def triton_interpret() -> bool:
    """``TRITON_INTERPRET``: Triton kernels run in its CPU interpreter, where PDL instructions do not exist."""
    return _get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")


def tp_allreduce() -> str:
    """``BATON_TP_ALLREDUCE``: ``auto`` (default: the one-shot symmetric-memory kernel for small messages on
    CUDA, NCCL for the rest) or ``nccl`` (NCCL for every all-reduce). ``auto`` is the default because it gave the
    lower TP2 TPOT (docs/performance.md); the TP2 graph tests cover both."""
    return (_get("BATON_TP_ALLREDUCE") or "auto").lower()


def tp_timeout_s() -> float | None:
    """``BATON_TP_TIMEOUT``: seconds before a collective, or a rank inside a request, counts as hung (default
    300)."""
    v = _get("BATON_TP_TIMEOUT")
    return float(v) if v else None


def configure_tp_environment() -> None:
    """Defaults every tensor-parallel rank runs with (set before any process group exists; children inherit
    them): NVLink multicast off for NCCL (NVLS) and for torch symmetric memory, as on the project's machines."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
