"""The fast CPU path of the GGUF quantized ops: the C kernels of ``kernels.c`` (built once per machine and loaded
with ctypes by ``native.py``), still in fp32, on weights in the x4 layout of ``naive.py``.

- A few rows (decode, verify, drafts: up to ``GEMV_MAX_ROWS``): one kernel dequantises each block of W in registers
  (the exact fp32 ``d * q + m`` of the reference) and multiplies it by every row of x; W is never written out.
- More rows (prefill): the kernel dequantises the matrix into a transient fp32 buffer (one per thread, reused) and
  ``F.linear`` (oneDNN / MKL sgemm) multiplies; no fp32 copy of the weights lives on.

Each function raises when the kernels cannot be built here (``baton.ops.quant_cpu`` checks first).
"""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F

from baton.ops.quant_cpu import naive, native

GEMV_MAX_ROWS = 48  # up to this many rows take the register kernels; more: dequantise + sgemm (crossover 48-64)
_local = threading.local()


def kernels():
    lib = native.lib()
    if lib is None:
        raise RuntimeError(f"quantized CPU kernels unavailable: {native.error()}")
    native.sync_threads(lib)
    return lib


def _scratch(numel: int) -> torch.Tensor:
    """A per-thread fp32 buffer of at least ``numel`` (the dequantised matrix of a prefill matmul)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < numel:
        buf = _local.buf = torch.empty(numel, dtype=torch.float32)
    return buf[:numel]


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32).contiguous()


def dequantize_into(fmt: str, packed: torch.Tensor, n: int, out: torch.Tensor) -> torch.Tensor:
    """out (fp32 [n, K], contiguous) = the dequantised matrix."""
    lib = kernels()
    k = naive.in_features(fmt, packed)
    assert out.dtype == torch.float32 and out.is_contiguous() and out.numel() == n * k
    fn = lib.bq_q4_1_dequant if fmt == "q4_1" else lib.bq_q8_0_dequant
    with native.traced(f"quant_cpu::{fmt}_dequant"):
        fn(packed.data_ptr(), n, k, out.data_ptr())
    return out


def linear(fmt: str, x: torch.Tensor, packed: torch.Tensor, n: int,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> fp32 [M, n] = x @ dequantize(...).T (+ residual [M, n], Q4_1 only in the kernel)."""
    lib = kernels()
    x = _rows(x)
    rows, k = x.shape
    if rows <= GEMV_MAX_ROWS:
        y = torch.empty(rows, n, dtype=torch.float32)
        with native.traced(f"quant_cpu::{fmt}_linear"):
            if fmt == "q4_1":
                res = None if residual is None else _rows(residual)
                err = lib.bq_q4_1_linear(x.data_ptr(), rows, k, packed.data_ptr(), n, y.data_ptr(),
                                         None if res is None else res.data_ptr())
                residual = None
            else:
                err = lib.bq_q8_0_linear(x.data_ptr(), rows, k, packed.data_ptr(), n, y.data_ptr())
        if err:
            raise MemoryError("quantized CPU kernel: out of memory")
    else:
        y = F.linear(x, dequantize_into(fmt, packed, n, _scratch(n * k).view(n, k)))
    return y if residual is None else y.add_(residual)


def embedding(fmt: str, ids: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Dequantised rows ``ids`` (any shape) -> fp32 [*ids.shape, K] (Q8_0 in the kernel)."""
    if fmt != "q8_0":
        return naive.embedding(fmt, ids, packed, n)
    lib = kernels()
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    k = naive.in_features(fmt, packed)
    out = torch.empty(flat.numel(), k, dtype=torch.float32)
    if lib.bq_q8_0_rows(flat.data_ptr(), flat.numel(), packed.data_ptr(), n, k, out.data_ptr()):
        raise IndexError(f"token id out of range [0, {n})")
    return out.reshape(*ids.shape, k)
