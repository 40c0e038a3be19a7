"""The references: dequantise the fp8 weight (``baton.ops.quant``), then one matmul: in fp32 for the drafts'
lm_head (``fp8_linear``), in the activations' dtype with the fusions of ``baton.ops.linear`` (RMSNorm prologue,
residual or SwiGLU epilogue) for the dense projections of ``--quantization fp8`` (``fp8_dense_linear``).

w8a8 (``act_fp8=True``): the prologue's output (x, or rms_norm(x) in x's dtype) quantised to e4m3 per row and 128
columns (``baton.ops.quant.fp8.quantize_act_e4m3``: the per-token-group quantisation that 128 x 128 block-fp8
checkpoints are served with), then ``dequantise(q_x) @ dequantise(W).T`` in fp32, rounded to x's dtype, then the
epilogue. The Triton kernel computes the same q_x and scales bit for bit; only its fp32 summation order differs."""

from __future__ import annotations

import torch

from baton.ops.linear import naive as dense
from baton.ops.quant import dequantize_fp8_block, dequantize_fp8_rows
from baton.ops.quant.fp8 import dequantize_act_e4m3, quantize_act_e4m3
from baton.ops.rmsnorm.naive import rms_norm


def _w8a8(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, row_block: torch.Tensor | None,
          norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The w8a8 GEMM: [..., N] in x's dtype (the epilogues' input, as F.linear's output is in naive.linear)."""
    h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    h2 = h.reshape(-1, h.shape[-1])
    hd = dequantize_act_e4m3(*quantize_act_e4m3(h2))
    y = hd @ dequantize_fp8_rows(weight, scale_inv, row_block, torch.float32).t()
    return y.to(x.dtype).reshape(*x.shape[:-1], weight.shape[0])


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K], weight [N, K] fp8, scale_inv [ceil(N/128), ceil(K/128)] -> fp32 [M, N]."""
    return x.float() @ dequantize_fp8_block(weight, scale_inv, torch.float32).t()


def fp8_dense_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None, *, act_fp8: bool = False) -> torch.Tensor:
    """``naive.linear`` (``[residual +] (rms_norm(x) if norm_weight else x) @ W.T``) with ``W`` the fp8 weight
    dequantised to x's dtype; ``row_block`` [N] names each weight row's scale row (None: ``row // 128``).
    ``act_fp8``: w8a8 (the module docstring)."""
    if act_fp8:
        y = _w8a8(x, weight, scale_inv, row_block, norm_weight, eps)
        return y if residual is None else residual + y
    return dense.linear(x, dequantize_fp8_rows(weight, scale_inv, row_block, x.dtype), norm_weight, eps, residual)


def fp8_dense_linear_swiglu(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                            eps: float = 1e-6, limit: float = 0.0, *, act_fp8: bool = False) -> torch.Tensor:
    """``naive.linear_swiglu`` with the fp8 weight [2I, K] (gate rows, then up rows) dequantised to x's dtype;
    ``act_fp8``: w8a8."""
    if act_fp8:
        return dense.swiglu(_w8a8(x, weight, scale_inv, row_block, norm_weight, eps), limit)
    return dense.linear_swiglu(x, dequantize_fp8_rows(weight, scale_inv, row_block, x.dtype), norm_weight, eps,
                               limit)
