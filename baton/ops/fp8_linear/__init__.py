"""``x @ W.T`` for a weight stored in fp8 (e4m3) with 128 x 128 block scales (``baton.ops.quant``), fp32 out: the
drafts' lm_head under ``--enable-fp8-draft-lm-head`` (half the bytes of a bf16 lm_head pass, the largest read of a
NEXTN draft step).

CUDA tensors take the Triton kernel (``triton.py``: the block scales applied in registers, one fp32 sum) when triton
imports and ``baton.env.use_triton()`` allows; everything else the dequantise-then-matmul reference (``naive.py``).
Triton is imported on the first CUDA call, never by importing this package.
"""

from __future__ import annotations

import torch

from baton.ops.attention import triton_module
from baton.ops.fp8_linear import naive

__all__ = ["fp8_linear"]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16 / fp32), weight [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] fp32 -> fp32
    [M, N] = x @ dequantise(weight).T."""
    impl = triton_module("baton.ops.fp8_linear.triton", x)
    if impl is not None and impl.supports(x, weight, scale_inv):
        return impl.fp8_linear(x, weight, scale_inv)
    return naive.fp8_linear(x, weight, scale_inv)
