"""The references: dequantise the fp8 weight (``baton.ops.quant``), then one matmul: in fp32 for the drafts'
lm_head (``fp8_linear``), in the activations' dtype with the fusions of ``baton.ops.linear`` (RMSNorm prologue,
residual or SwiGLU epilogue) for the dense projections of ``--quantization fp8`` (``fp8_dense_linear``)."""

from __future__ import annotations

import torch

from baton.ops.linear import naive as dense
from baton.ops.quant import dequantize_fp8_block, dequantize_fp8_rows


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] fp8, scale_inv [ceil(N/128), ceil(K/128)] -> fp32 [M, N]."""
    return x.float() @ dequantize_fp8_block(weight, scale_inv, torch.float32).t()


def fp8_dense_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None) -> torch.Tensor:
    """``naive.linear`` (``[residual +] (rms_norm(x) if norm_weight else x) @ W.T``) with ``W`` the fp8 weight
    dequantised to x's dtype; ``row_block`` [N] names each weight row's scale row (None: ``row // 128``)."""
    return dense.linear(x, dequantize_fp8_rows(weight, scale_inv, row_block, x.dtype), norm_weight, eps, residual)


def fp8_dense_linear_swiglu(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                            eps: float = 1e-6, limit: float = 0.0) -> torch.Tensor:
    """``naive.linear_swiglu`` with the fp8 weight [2I, K] (gate rows, then up rows) dequantised to x's dtype."""
    return dense.linear_swiglu(x, dequantize_fp8_rows(weight, scale_inv, row_block, x.dtype), norm_weight, eps,
                               limit)
