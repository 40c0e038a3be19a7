"""KDA (Kimi Delta Attention) ops. ``naive`` holds the plain-PyTorch references, ``triton`` the fused GPU kernel.

``kda_recurrent_fused`` dispatches: CUDA tensors with triton importable and ``baton.env.use_triton()`` take the
Triton kernel, everything else the naive composition with the same signature. ``kda_chunk`` (prefill) takes
fla-core's ``chunk_kda`` on CUDA when fla is importable (``BATON_FLA=0`` turns it off), else the naive chunked form.
The Triton module is imported on first CUDA use only, so CPU runs never need triton (and tests can set
``TRITON_INTERPRET`` before it loads).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch

from baton.env import use_fla, use_triton
from baton.ops.kda import naive as _naive
from baton.ops.kda.naive import kda_decode_step, kda_gate, kda_recurrent, l2norm

log = logging.getLogger(__name__)

__all__ = ["kda_chunk", "kda_decode_step", "kda_gate", "kda_recurrent", "kda_recurrent_fused", "l2norm"]


@functools.cache
def _triton_impl() -> Any:
    try:
        from baton.ops.kda import triton as impl
    except ImportError:
        return None
    return impl


@functools.cache
def _fla_chunk() -> Any:
    """fla-core's ``chunk_kda``, or None (said once, loudly: a CUDA prefill without it takes the PyTorch chunked
    form, ~15x slower on Ling-3.0-flash's 8192-token prompt: 7.4 s instead of ~0.5 s on an H200)."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError as e:
        missing = (e.name or "fla").split(".")[0]  # fla itself (absent, or too old for chunk_kda), or a dependency
        hint = ("pip install 'baton[gpu]'" if missing == "fla"
                else f"fla-core is installed but a dependency of it is missing: pip install {missing}")
        log.warning("KDA prefill on CUDA falls back to the PyTorch chunked form (slow: ~15x on long prompts) "
                    "because fla-core's chunk_kda does not import (%s); %s", e, hint)
        return None
    return chunk_kda


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
    bounded_gate: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked KDA over a prompt (see ``naive.kda_chunk`` for the contract: q, k [T, H, K], v [T, H, V], g the
    log-space decay [T, H, K], beta [T, H], state [H, K, V] fp32; returns o [T, H, V] in v's dtype and the final
    fp32 state). fla's layout is the same with a leading batch of one. ``bounded_gate``: g comes from the
    lower-bounded ("safe") gate, so fla may take its bounded-gate tensor-core path."""
    # fp32 inputs take the PyTorch form: fla's kernels compute their products in TF32 (the model's fp32 logits on
    # the H200 differ from the CPU reference by 5.3e-4 relative with fla, 1.3e-6 without), and fp32 is the
    # precision the tests compare against
    fla = _fla_chunk() if q.is_cuda and use_fla() and chunk_size == 64 and v.dtype != torch.float32 else None
    if fla is None:
        return _naive.kda_chunk(q, k, v, g, beta, initial_state, scale, use_qk_l2norm, chunk_size)
    dtype = v.dtype
    s0 = None if initial_state is None else initial_state.float().unsqueeze(0).contiguous()  # [1, H, K, V]
    o, final = fla(q.to(dtype).unsqueeze(0).contiguous(), k.to(dtype).unsqueeze(0).contiguous(),
                   v.unsqueeze(0).contiguous(), g.float().unsqueeze(0).contiguous(),
                   beta.float().unsqueeze(0).contiguous(), scale=scale, initial_state=s0, output_final_state=True,
                   use_qk_l2norm_in_kernel=use_qk_l2norm, safe_gate=bounded_gate)
    return o[0].to(dtype), final[0].float()


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
    conv_weight: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_windows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused KDA decode / verify recurrence from the raw projections; with ``conv_weight`` / ``conv_state`` (/
    ``conv_windows``) from the raw q|k|v before the short conv, which it applies (and whose window it updates or
    stages) itself. See ``baton.ops.kda.naive``'s version for the contract. Returns o [T, H, V] in v's dtype."""
    impl = _triton_impl() if q.is_cuda and use_triton() else None
    fn = impl.kda_recurrent_fused if impl is not None else _naive.kda_recurrent_fused
    return fn(q, k, v, f, b_logits, A_log, dt_bias, lower_bound, state, scale, out_states, update_state,
              o_norm_weight, gate, eps, out=out, block_v=block_v, num_warps=num_warps, conv_weight=conv_weight,
              conv_state=conv_state, conv_windows=conv_windows)
