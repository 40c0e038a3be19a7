"""MoE routing and routed experts.

``select_experts`` (router logits -> top-k ids and weights) and ``moe_experts`` (routed experts + shared output +
residual, combined in fp32) dispatch to the Triton kernels in ``baton.ops.moe.triton`` for CUDA tensors when triton
imports and ``BATON_TRITON`` is on, and to the PyTorch reference otherwise (the host-sync-free
``fused_experts_dense_gather`` while a CUDA graph is being captured). The Triton module is imported lazily, on the
first CUDA call, so that tests can switch ``TRITON_INTERPRET`` on before its kernels are decorated."""

from __future__ import annotations

import functools
from types import ModuleType

import torch

from baton import env
from baton.ops.moe.naive import (
    append_shared_expert,
    drop_inactive_rows,
    fused_experts,
    fused_experts_dense_gather,
    fused_experts_w8a8,
    grouped_topk,
    quantize_act_e4m3,
)

__all__ = ["append_shared_expert", "drop_inactive_rows", "fused_experts", "fused_experts_dense_gather",
           "fused_experts_w8a8", "grouped_topk", "moe_experts", "quantize_act_e4m3", "select_experts"]


@functools.lru_cache(maxsize=1)
def _triton_impl() -> ModuleType | None:
    try:
        from baton.ops.moe import triton as impl
    except ImportError:
        return None
    return impl


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and env.use_triton() and _triton_impl() is not None


def select_experts(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, n_group: int, topk_group: int,
                   renormalize: bool, scaling_factor: float, active_rows: torch.Tensor | None = None,
                   shared_id: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (topk_ids [T, k], topk_weights [T, k] fp32): sigmoid, group-limited top-k on the
    bias-corrected scores, weights from the unbiased scores (renormalised, scaled).

    ``active_rows``: an int tensor of one element (0-d or [1]) on the logits' device, the number of leading rows
    that are used (a verify whose rows past the accepted prefix will be dropped). Rows ``>= active_rows`` get id -1
    and weight 0, which ``moe_experts`` treats as no expert: none of their experts' weights is read (on the fixed
    shapes of a CUDA graph too: the value is never read on the host). None: every row routes.

    ``shared_id``: a fused shared expert (``baton.layers.moe.Experts``): k + 1 columns, the last ``(shared_id,
    1.0)`` on every row, ``active_rows`` or not (the shared expert runs on every row); the Triton kernel writes it
    in the same launch."""
    if _use_triton(logits):
        return _triton_impl().grouped_topk_fused(logits, expert_bias, top_k, n_group, topk_group, renormalize,
                                                 scaling_factor, active_rows, shared_id)
    ids, weights = grouped_topk(torch.sigmoid(logits.float()), expert_bias, top_k, n_group, topk_group, renormalize,
                                scaling_factor)
    if active_rows is not None:
        ids, weights = drop_inactive_rows(ids, weights, active_rows)
    return (ids, weights) if shared_id is None else append_shared_expert(ids, weights, shared_id)


def moe_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                topk_weights: torch.Tensor, swiglu_limit: float = 0.0, residual: torch.Tensor | None = None,
                shared_out: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
                w2_scale: torch.Tensor | None = None, act_fp8: bool = False, shared_limit: float = 0.0,
                shared_id: int | None = None) -> torch.Tensor:
    """``[residual +] [shared_out +] sum_k w_k * expert_k(x)`` accumulated in fp32, returned in x's dtype.
    x [T, d]; w13 [E, 2I, d]; w2 [E, d, I]; topk_ids / topk_weights [T, k]; residual / shared_out [T, d].
    An id of -1 (``select_experts``' rows past ``active_rows``) is no expert: it adds nothing and the Triton kernels
    and the eager reference read no weights for it, so a row of -1s returns ``residual + shared_out``.
    fp8 experts: w13 / w2 in float8_e4m3fn with 128 x 128 block ``*_scale`` (scale_inv); the reference path
    dequantises to x's dtype first (the kernel applies the scales in registers).
    ``act_fp8`` (fp8 experts only; default False, the numerics above): w8a8, x and each pair's SwiGLU output
    quantised to e4m3 per (row, 128-K group) with power-of-two scales and fp8 x fp8 products
    (``naive.fused_experts_w8a8``, the same arithmetic on every path).
    ``shared_id``: the expert id of a fused shared expert (stacked as the last expert of w13 / w2, routed with
    weight 1.0 by ``select_experts(shared_id=...)``); its pairs take the SwiGLU clamp ``shared_limit``, the others
    ``swiglu_limit`` (0: off). With it ``shared_out`` is None: the shared product is summed with the routed ones
    in fp32 and never rounded to x's dtype before the residual is added."""
    lim = dict(shared_limit=shared_limit, shared_id=shared_id)
    if act_fp8:
        if w13_scale is None or w2_scale is None:
            raise ValueError("act_fp8 needs fp8 experts (w13_scale and w2_scale)")
        if _use_triton(x):
            return _triton_impl().fused_experts_decode(x, w13, w2, topk_ids, topk_weights, swiglu_limit,
                                                       residual=residual, shared_out=shared_out,
                                                       w13_scale=w13_scale, w2_scale=w2_scale, act_fp8=True, **lim)
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        y = fused_experts_w8a8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, swiglu_limit,
                               capturing=capturing, **lim)
        if shared_out is not None:
            y = y + shared_out.float()
        if residual is not None:
            y = y + residual.float()
        return y.to(x.dtype)
    if _use_triton(x) and (w13_scale is None or env.fp8_aligned_prefill()
                           or x.shape[0] * topk_ids.shape[1] <= _triton_impl().FP8_DIRECT_MAX_PAIRS):
        # fp8 at any T too: direct for the decode shapes, aligned past them (prefill: no dequantised copy)
        return _triton_impl().fused_experts_decode(x, w13, w2, topk_ids, topk_weights, swiglu_limit,
                                                   residual=residual, shared_out=shared_out,
                                                   w13_scale=w13_scale, w2_scale=w2_scale, **lim)
    if w13_scale is not None:
        from baton.ops.quant import dequantize_fp8_block, dequantize_fp8_gate_up

        w13, w2 = dequantize_fp8_gate_up(w13, w13_scale, x.dtype), dequantize_fp8_block(w2, w2_scale, x.dtype)
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    routed = fused_experts_dense_gather if capturing else fused_experts
    y = routed(x, w13, w2, topk_ids, topk_weights, swiglu_limit, **lim)
    if shared_out is not None:
        y = y + shared_out.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)
