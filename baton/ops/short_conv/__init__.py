"""Depthwise causal short convolution (+SiLU) of KDA. ``short_conv_update`` dispatches: CUDA tensors with
triton importable and ``baton.env.use_triton()`` take the Triton kernel (imported on first CUDA use), everything
else the naive composition with the same signature."""

from __future__ import annotations

import functools
from typing import Any

import torch

from baton.env import use_triton
from baton.ops.short_conv import naive as _naive
from baton.ops.short_conv.naive import short_conv

__all__ = ["short_conv", "short_conv_update"]


@functools.cache
def _triton_impl() -> Any:
    try:
        from baton.ops.short_conv import triton as impl
    except ImportError:
        return None
    return impl


def short_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    out_windows: torch.Tensor | None = None,
    update_state: bool = True,
    *,
    out: torch.Tensor | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Short conv + SiLU of T new rows over the carried window, staging / updating the window; see
    ``baton.ops.short_conv.naive.short_conv_update``. Returns y [T, D] in x's dtype."""
    impl = _triton_impl() if x.is_cuda and use_triton() else None
    fn = impl.short_conv_update if impl is not None else _naive.short_conv_update
    return fn(x, weight, conv_state, out_windows, update_state, out=out, block_d=block_d, num_warps=num_warps)
