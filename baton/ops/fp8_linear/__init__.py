"""``x @ W.T`` for a weight stored in fp8 (e4m3) with 128 x 128 block scales (``baton.ops.quant``):

- ``fp8_linear``, fp32 out: the drafts' lm_head under ``--enable-fp8-draft-lm-head`` (half the bytes of a bf16
  lm_head pass, the largest read of a NEXTN draft step);
- ``fp8_dense_linear`` / ``fp8_dense_linear_swiglu``: the dense projections under ``--quantization fp8`` with the
  fusions of ``baton.ops.linear`` (RMSNorm prologue, residual or SwiGLU epilogue), out in the activations' dtype.
  A fused weight whose parts are quantised each on its own and are not 128-row aligned passes ``row_block`` (each
  weight row's scale row). ``act_fp8=True`` (w8a8): the rows are quantised to e4m3 per (row, 128 columns) after the
  prologue and multiplied on fp8 x fp8 MMAs (``baton.ops.quant.fp8.quantize_act_e4m3``; default False: w8a16, rows
  in x's dtype).

CUDA tensors take the Triton kernels (``triton.py``: the block scales applied in registers, one fp32 sum) when triton
imports, ``baton.env.use_triton()`` allows and the call fits (at most 16 rows for the lm_head; 32 for a dense
projection in one launch, a DSpark verify of gamma 16 being 17, and up to 256 (a short prefill) in launches of 32
rows); everything else the dequantise-then-matmul references (``naive.py``).
Triton is imported on the first CUDA call, never by importing this package.
"""

from __future__ import annotations

import torch

from baton.ops.attention import triton_module
from baton.ops.fp8_linear import naive

__all__ = ["fp8_dense_linear", "fp8_dense_linear_swiglu", "fp8_linear"]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """x [M, K] (bf16 / fp32), weight [N, K] float8_e4m3fn, scale_inv [ceil(N/128), ceil(K/128)] fp32 -> fp32
    [M, N] = x @ dequantise(weight).T."""
    impl = triton_module("baton.ops.fp8_linear.triton", x)
    if impl is not None and impl.supports(x, weight, scale_inv):
        return impl.fp8_linear(x, weight, scale_inv)
    return naive.fp8_linear(x, weight, scale_inv)


def fp8_dense_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                     row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     residual: torch.Tensor | None = None, *, act_fp8: bool = False) -> torch.Tensor:
    """``[residual +] (rms_norm(x) if norm_weight else x) @ dequantise(weight).T``, x [..., K] -> [..., N] in x's
    dtype (``baton.ops.linear.linear`` on an fp8 weight). ``act_fp8`` (w8a8): the normalised rows quantised to e4m3
    per (row, 128 columns) first (``baton.ops.quant.fp8.quantize_act_e4m3``) and the product taken on fp8 x fp8
    MMAs; False (w8a16): the rows stay in x's dtype."""
    impl = triton_module("baton.ops.fp8_linear.triton", x)
    if impl is not None and impl.supports_dense(x, weight, scale_inv, row_block, norm_weight, residual):
        return impl.fp8_dense(x, weight, scale_inv, row_block, norm_weight, eps, residual, act_fp8=act_fp8)
    return naive.fp8_dense_linear(x, weight, scale_inv, row_block, norm_weight, eps, residual, act_fp8=act_fp8)


def fp8_dense_linear_swiglu(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                            row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                            eps: float = 1e-6, limit: float = 0.0, *, act_fp8: bool = False) -> torch.Tensor:
    """``swiglu((rms_norm(x) if norm_weight else x) @ dequantise(weight).T, limit)``; weight [2I, K] holds gate rows
    then up rows. Returns [..., I] (``baton.ops.linear.linear_swiglu`` on an fp8 weight). ``act_fp8``: w8a8, as
    ``fp8_dense_linear``."""
    impl = triton_module("baton.ops.fp8_linear.triton", x)
    if impl is not None and impl.supports_dense(x, weight, scale_inv, row_block, norm_weight, None, True):
        return impl.fp8_dense(x, weight, scale_inv, row_block, norm_weight, eps, None, True, limit, act_fp8=act_fp8)
    return naive.fp8_dense_linear_swiglu(x, weight, scale_inv, row_block, norm_weight, eps, limit, act_fp8=act_fp8)
