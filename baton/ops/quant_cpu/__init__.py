"""Matmuls and embedding lookups on GGUF-quantized weights kept in their file format, for the CPU (``naive.py``
holds the formats and the plain-PyTorch references; ``cpu.py`` the fast path).

Everything computes in fp32 from the exact dequantised values (``d * q + m`` of Q4_1, ``d * q`` of Q8_0), so a
quantized model's logits equal the dequantised fp32 model's to fp32 rounding (tests/ops/test_quant_cpu.py,
tests/models/test_gguf_quant.py). CPU tensors take ``cpu.py`` (TorchInductor-compiled kernels); if Inductor cannot
compile here (no C++ compiler), or for other devices, the references run instead (slow, but the same numbers).
"""

from __future__ import annotations

import logging

import torch

from baton.ops.quant_cpu import naive
from baton.ops.quant_cpu.naive import (
    GROUP,
    dequantize_q4_1,
    dequantize_q8_0,
    unpack_q4_1,
    unpack_q8_0,
)

__all__ = ["GROUP", "dequantize_q4_1", "dequantize_q8_0", "q4_1_embedding", "q4_1_linear", "q8_0_embedding",
           "q8_0_linear", "unpack_q4_1", "unpack_q8_0"]

log = logging.getLogger(__name__)
_fast_ok = True  # cleared when Inductor fails once (then every call takes the reference)


def fast_path_ok() -> bool:
    """False once Inductor has failed in this process (then callers take the references)."""
    return _fast_ok


def _fast(x: torch.Tensor):
    if not (_fast_ok and x.device.type == "cpu") or torch.is_grad_enabled() and x.requires_grad:
        return None
    from baton.ops.quant_cpu import cpu

    return cpu


def _call(name: str, x: torch.Tensor, *args: torch.Tensor) -> torch.Tensor:
    global _fast_ok
    impl = _fast(x)
    if impl is not None:
        try:
            return getattr(impl, name)(x, *args)
        except Exception as e:  # noqa: BLE001 - e.g. no C++ compiler for Inductor: fall back for good
            _fast_ok = False
            log.warning("quantized CPU kernels unavailable (%s: %s); using the PyTorch reference",
                        type(e).__name__, str(e).splitlines()[0] if str(e) else "")
    return getattr(naive, name)(x, *args)


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N] = x @ dequantize_q4_1(packed, d, m).T; packed uint8 [K/32, 16, N]."""
    return _call("q4_1_linear", x, packed, d, m)


def q8_0_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N] = x @ dequantize_q8_0(codes, d).T; codes int8 [N, K/32, 32]."""
    return _call("q8_0_linear", x, codes, d)


def q8_0_embedding(ids: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Dequantised rows ``ids`` (any shape) of a Q8_0 matrix -> fp32 [*ids.shape, K] (a gather: eager is enough)."""
    return naive.q8_0_embedding(ids, codes, d)


def q4_1_embedding(ids: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Dequantised rows ``ids`` (any shape) of a Q4_1 matrix -> fp32 [*ids.shape, K]."""
    return naive.q4_1_embedding(ids, packed, d, m)
