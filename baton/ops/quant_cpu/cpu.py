"""The fast CPU path of the GGUF quantized ops: the references of ``naive.py`` written so that TorchInductor fuses
each into one vectorised C++ loop (``torch.compile``), still in fp32.

- GEMV (a few rows, decode): the codes are unpacked, scaled and reduced against x in registers, never written as
  a weight matrix. Q4_1 sums ``d * (q_lo . x_lo + q_hi . x_hi)`` over each block plus ``m * sum(x_block)``; Q8_0
  sums ``d * (q . x)``. Same products as ``x @ dequantize(W).T``, summed in another order: equal to fp32 rounding.
- Many rows (prefill): the matrix is dequantised by one fused kernel into a transient fp32 buffer and multiplied by
  ``F.linear`` (oneDNN / MKL sgemm); the buffer is freed after the call, so no fp32 copy of the weights lives on.

Each (op, shape) compiles once per process (a few seconds; Inductor's on-disk cache makes later processes start
faster).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from baton.ops.quant_cpu.naive import GROUP

GEMV_MAX_ROWS = 16  # up to this many rows (decode, verify, drafts) take the GEMV kernels; more: dequantise + sgemm


def q4_1_gemv(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 [M, N]; traced by Inductor (also inside the fused decoder-layer graphs of
    baton.models.llama). Rows are the vector lanes: per block, ``s = q_lo . x_lo + q_hi . x_hi`` for 16 rows at once,
    then ``d * s + m * sum(x_block)``."""
    b, _, n = packed.shape
    p = packed.to(torch.int32)  # int32 lanes: Inductor vectorises the nibble shifts on them
    lo, hi = (p & 15).float(), (p >> 4).float()  # [B, 16, N]
    xv = x.float().view(-1, b, 2, GROUP // 2)  # [M, B, (lo, hi), 16]
    s = (lo[None] * xv[:, :, 0, :, None] + hi[None] * xv[:, :, 1, :, None]).sum(2)  # [M, B, N]
    return (s * d.float()[None]).sum(1) + (m.float()[None] * xv.sum((2, 3))[:, :, None]).sum(1)


def q8_0_gemv(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    n, b, _ = codes.shape
    w = codes.float() * d.float()[..., None]
    return (w[None] * x.float().view(-1, 1, b, GROUP)).sum((-1, -2))


def _q4_1_dequant(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    q = torch.cat([packed & 15, packed >> 4], dim=1).float()
    return (q * d.float()[:, None, :] + m.float()[:, None, :]).permute(2, 0, 1).reshape(packed.shape[2], -1)


def _q8_0_dequant(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    return (codes.float() * d.float()[..., None]).reshape(codes.shape[0], -1)


_FUNCTIONS = {"q4_1_gemv": q4_1_gemv, "q8_0_gemv": q8_0_gemv, "q4_1_dequant": _q4_1_dequant,
              "q8_0_dequant": _q8_0_dequant}


def compile_fn(fn):
    """``torch.compile`` as these kernels use it: static shapes (one entry per weight shape and row count; the
    default limit of 8 per function is too few for a model's shapes), one whole graph."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(fn, dynamic=False, fullgraph=True)


@functools.cache
def _compiled(name: str):
    return compile_fn(_FUNCTIONS[name])


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> fp32 [M, N] = x @ dequantize_q4_1(packed, d, m).T."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _compiled("q4_1_gemv")(x, packed, d, m)
    return F.linear(x.float(), _compiled("q4_1_dequant")(packed, d, m))


def q8_0_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32 -> fp32 [M, N] = x @ dequantize_q8_0(codes, d).T."""
    if x.shape[0] <= GEMV_MAX_ROWS:
        return _compiled("q8_0_gemv")(x, codes, d)
    return F.linear(x.float(), _compiled("q8_0_dequant")(codes, d))
