"""Projections with optional RMSNorm prologue, residual epilogue, SwiGLU epilogue.

CUDA tensors with at most 32 rows take the Triton kernels (``triton.py``) when triton imports,
``env.use_triton()`` allows and the GPU's tuned table does not name cuBLAS for the shape and row bucket; everything
else (CPU, larger M, those table entries: cuBLAS through F.linear) runs the reference in ``naive.py``. Triton is
imported on the first CUDA call, never by importing this package (CPU runs never need it, and tests can set
``TRITON_INTERPRET`` before it loads)."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from baton import env
from baton.ops.linear import naive
from baton.ops.linear.naive import swiglu

__all__ = ["linear", "linear_swiglu", "swiglu"]


@functools.cache
def _triton_impl() -> ModuleType | None:
    try:
        from baton.ops.linear import triton as impl
    except ImportError:  # no triton on this machine
        return None
    return impl


def _fast(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, residual: torch.Tensor | None,
          swiglu: bool) -> ModuleType | None:
    """The Triton module when this call qualifies for it, else None."""
    if not (x.is_cuda and env.use_triton()):
        return None
    impl = _triton_impl()
    return impl if impl is not None and impl.supports(x, weight, norm_weight, residual, swiglu) else None


def linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``[residual +] (rms_norm(x) if norm_weight else x) @ weight.T``. x [M, K], weight [N, K] -> [M, N]."""
    impl = _fast(x, weight, norm_weight, residual, False)
    if impl is not None:
        return impl.linear(x, weight, norm_weight, eps, residual)
    return naive.linear(x, weight, norm_weight, eps, residual)


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  limit: float = 0.0) -> torch.Tensor:
    """``swiglu((rms_norm(x) if norm_weight else x) @ weight.T, limit)``; weight [2I, K] holds gate rows then up
    rows. Returns [M, I]."""
    impl = _fast(x, weight, norm_weight, None, True)
    if impl is not None:
        return impl.linear_swiglu(x, weight, norm_weight, eps, limit)
    return naive.linear_swiglu(x, weight, norm_weight, eps, limit)
