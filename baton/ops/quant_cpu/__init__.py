"""Matmuls and embedding lookups on GGUF-quantized weights kept in their file format, for the CPU (``naive.py``
holds the formats, the x4 layout they are kept in, and the plain-PyTorch references; ``cpu.py`` the fast path, C
kernels built once per machine by ``native.py``; ``kernels.c`` also holds the decode step of a Llama layer, which
baton.models.llama calls).

Everything computes in fp32 from the exact dequantised values (``d * q + m`` of Q4_1, ``d * q`` of Q8_0), so a
quantized model's logits equal the dequantised fp32 model's to fp32 rounding (tests/ops/test_quant_cpu*.py,
tests/models/test_gguf_quant.py). CPU tensors take ``cpu.py``; where the kernels cannot be built (no C compiler),
for other devices, or under autograd, the references run instead (slow, but the same numbers).
"""

from __future__ import annotations

import torch

from baton.ops.quant_cpu import naive, native
from baton.ops.quant_cpu.naive import FORMATS, GROUP, pack, unpack_q4_1, unpack_q8_0, unpack_x4

__all__ = ["FORMATS", "GROUP", "dequantize", "embedding", "fast_path_ok", "linear", "pack", "unpack_q4_1",
           "unpack_q8_0", "unpack_x4"]


def fast_path_ok() -> bool:
    """Whether the C kernels are available in this process (built or loaded; baton.ops.quant_cpu.native)."""
    return native.lib() is not None


def _impl(x: torch.Tensor):
    if x.device.type != "cpu" or (torch.is_grad_enabled() and x.requires_grad) or not fast_path_ok():
        return naive
    from baton.ops.quant_cpu import cpu

    return cpu


def linear(fmt: str, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] -> fp32 [M, n] = x @ dequantize(fmt, packed, n).T."""
    return _impl(x).linear(fmt, x, packed, n)


def embedding(fmt: str, ids: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Dequantised rows ``ids`` (any shape) -> fp32 [*ids.shape, K] (the embedding lookup)."""
    return _impl(packed).embedding(fmt, ids, packed, n)


def dequantize(fmt: str, packed: torch.Tensor, n: int) -> torch.Tensor:
    """-> fp32 [n, K]."""
    if packed.device.type == "cpu" and fast_path_ok():
        from baton.ops.quant_cpu import cpu

        return cpu.dequantize_into(fmt, packed, n, torch.empty(n, naive.in_features(fmt, packed)))
    return naive.dequantize(fmt, packed, n)
