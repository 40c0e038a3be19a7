"""RMSNorm in one Triton kernel (one program per row), for the norms that are not fused into a linear's prologue:
the NEXTN head's enorm / hnorm / final norm, the target's final norm before the NEXTN head, DSpark's norms (MLA's
kv_a_layernorm runs inside ``rope_and_cache_write``, with this arithmetic). The PyTorch form (``naive.rms_norm``)
is ~6 kernels (cast, square, mean, rsqrt, two multiplies), each a launch gap at batch 1 (the SmolLM2 NEXTN step
census in docs/performance.md counts them).

Same arithmetic as the reference: the row normalised in fp32, rounded to x's dtype, then times the weight in
the promoted dtype of the two (the product of two bf16 values is exact in fp32, so rounding it once matches
torch's bf16 multiply). Only the order of the fp32 sum of squares differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton import env
from baton.ops.linear.triton import _round

MAX_DIM = 16384


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_o, D, eps, BLOCK_D: tl.constexpr,
                     INTERPRET: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    mask = offs < D
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=0) / D + eps)
    y = _round(xf * rstd, x_ptr.dtype.element_ty, INTERPRET)  # x's dtype, to nearest (also in the interpreter)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    out = _round(y * w, out_ptr.dtype.element_ty, INTERPRET)
    tl.store(out_ptr + row * stride_o + offs, out.to(out_ptr.dtype.element_ty), mask=mask)


def supports(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() >= 1 and x.shape[-1] == weight.shape[0] <= MAX_DIM and x.stride(-1) == 1
            and weight.is_contiguous() and x.numel() > 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and weight.dtype in (torch.float32, torch.bfloat16, torch.float16))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] (last dim contiguous), weight [D] -> [..., D] in promote(weight, x) dtype."""
    d = x.shape[-1]
    rows = x.reshape(-1, d)  # a view when the leading dims are uniform (else a copy)
    out = torch.empty(rows.shape, device=x.device, dtype=torch.promote_types(weight.dtype, x.dtype))
    block = triton.next_power_of_2(d)
    _rms_norm_kernel[(rows.shape[0],)](rows, weight, out, rows.stride(0), out.stride(0), d, eps, BLOCK_D=block,
                                       INTERPRET=env.triton_interpret(), num_warps=4 if block <= 2048 else 8)
    return out.reshape(x.shape)
