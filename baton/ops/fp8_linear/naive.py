"""The reference: dequantise the fp8 weight to fp32 (``baton.ops.quant.dequantize_fp8_block``), then one fp32
matmul."""

from __future__ import annotations

import torch

from baton.ops.quant import dequantize_fp8_block


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] fp8, scale_inv [ceil(N/128), ceil(K/128)] -> fp32 [M, N]."""
    return x.float() @ dequantize_fp8_block(weight, scale_inv, torch.float32).t()
