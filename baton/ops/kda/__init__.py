"""KDA (Kimi Delta Attention) ops. ``naive`` holds the plain-PyTorch references, ``triton`` the fused GPU kernel.

``kda_recurrent_fused`` dispatches: CUDA tensors with triton importable and ``baton.env.use_triton()`` take the
Triton kernel, everything else the naive composition with the same signature. The Triton module is imported on
first CUDA use only, so CPU runs never need triton (and tests can set ``TRITON_INTERPRET`` before it loads).
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from baton.env import use_triton
from baton.ops.kda import naive as _naive
from baton.ops.kda.naive import kda_chunk, kda_decode_step, kda_gate, kda_recurrent, l2norm

__all__ = ["kda_chunk", "kda_decode_step", "kda_gate", "kda_recurrent", "kda_recurrent_fused", "l2norm"]


@functools.cache
def _triton_impl() -> Any:
    try:
        from baton.ops.kda import triton as impl
    except ImportError:
        return None
    return impl


def kda_recurrent_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    state: torch.Tensor,
    scale: float | None,
    out_states: torch.Tensor | None = None,
    update_state: bool = True,
    o_norm_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Fused KDA decode / verify recurrence from the raw projections; see ``baton.ops.kda.naive``'s version
    for the contract. Returns o [T, H, V] in v's dtype."""
    impl = _triton_impl() if q.is_cuda and use_triton() else None
    fn = impl.kda_recurrent_fused if impl is not None else _naive.kda_recurrent_fused
    return fn(q, k, v, f, b_logits, A_log, dt_bias, lower_bound, state, scale, out_states, update_state,
              o_norm_weight, gate, eps, out=out, block_v=block_v, num_warps=num_warps)
