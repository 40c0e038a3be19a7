"""Attention over a position-indexed cache; ``attention`` picks the implementation for the device.

CUDA tensors take the Triton kernels (``triton.py``: flash-decoding attention; ``rope_cache.py``: RoPE plus the
cache write; ``fused_decode.py``: all of it in one kernel for a few new tokens, opt-in with
``BATON_FUSED_ATTENTION``) when triton imports and ``baton.env.use_triton()`` allows; CPU tensors, a custom mask, or no
triton take the plain-PyTorch reference. Triton is imported on the first CUDA call, never by importing this
package.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch

from baton.env import use_fused_attention, use_triton
from baton.ops.attention.naive import attention as attention_naive
from baton.ops.attention.naive import causal_mask
from baton.ops.rmsnorm.naive import rms_norm as rms_norm_naive
from baton.ops.rope import apply_rope, rope_cos_sin

__all__ = ["attention", "causal_mask", "rope_and_cache_write", "rope_cache_attention", "triton_module",
           "use_fused_decode"]


@functools.cache
def _import(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def triton_module(name: str, tensor: torch.Tensor) -> ModuleType | None:
    """The Triton implementation module ``name`` when ``tensor`` is on CUDA, Triton is allowed and importable."""
    if not (tensor.is_cuda and use_triton()):
        return None
    return _import(name)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [T, H, Dv]; causal over cache rows unless ``mask`` [T, S]."""
    impl = triton_module("baton.ops.attention.triton", q) if mask is None else None
    if impl is not None:
        return impl.attention(q, k, v, q_positions, scale)
    return attention_naive(q, k, v, q_positions, scale, mask)


FUSED_MAX_TOKENS = 16  # fused_decode.MAX_TOKENS (not imported here: that would import triton)


def use_fused_decode(q: torch.Tensor, cos_sin_or_inv_freq: torch.Tensor) -> bool:
    """Whether ``rope_cache_attention`` takes the one-kernel path for ``q`` [T, H, D]."""
    return _fused_decode(q, cos_sin_or_inv_freq) is not None


def _fused_decode(q: torch.Tensor, table: torch.Tensor) -> ModuleType | None:
    """The fused-decode module when ``BATON_FUSED_ATTENTION`` is on and the call fits it: CUDA, at most
    ``FUSED_MAX_TOKENS`` tokens, RoPE over the full head dim, autograd off (the kernel has no backward, and
    draft training runs these layers)."""
    if q.shape[0] > FUSED_MAX_TOKENS or torch.is_grad_enabled() or 2 * _half(table) != q.shape[-1]:
        return None
    return triton_module("baton.ops.attention.fused_decode", q) if use_fused_attention() else None


def rope_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                         cos_sin_or_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         scale: float, kv_len: int | None) -> torch.Tensor:
    """RoPE on q and k, ``k_cache[positions] = RoPE(k)``, ``v_cache[positions] = v``, then causal attention of
    RoPE(q) over the cache's first ``kv_len`` rows: q [T, H, D], k / v [T, Hkv, D], positions [T] contiguous
    (the next tokens of one sequence), rotate-half RoPE. One kernel on CUDA when ``use_fused_decode`` says so;
    otherwise ``rope_and_cache_write`` then ``attention``."""
    impl = _fused_decode(q, cos_sin_or_inv_freq)
    if impl is not None:
        return impl.fused_rope_cache_attention(q, k, v, positions, cos_sin_or_inv_freq, k_cache, v_cache, scale)
    q = rope_and_cache_write(q, k, v, positions, cos_sin_or_inv_freq, k_cache, v_cache, interleaved=False)
    return attention(q, k_cache[:kv_len], v_cache[:kv_len], positions, scale)


def _half(table: torch.Tensor) -> int:
    return table.shape[1] // 2 if table.dim() == 2 else table.shape[0]


def rope_and_cache_write(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None, positions: torch.Tensor,
                         cos_sin_or_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                         interleaved: bool, v_norm_weight: torch.Tensor | None = None,
                         v_norm_eps: float = 1e-6) -> torch.Tensor | None:
    """Returns RoPE(q) and writes ``k_cache[positions] = RoPE(k)``, ``v_cache[positions] = v``, or
    ``rms_norm(v, v_norm_weight, v_norm_eps)`` when a weight is given (MLA: c through kv_a_layernorm on its way to
    the latent cache, in the same launch). The Triton kernel rotates q in place and returns it; the PyTorch path
    returns a new tensor: callers use the return value. Shapes and the two forms of ``cos_sin_or_inv_freq`` as
    in ``rope_cache.rope_and_cache_write``."""
    impl = triton_module("baton.ops.attention.rope_cache", k)
    if impl is not None:
        return impl.rope_and_cache_write(q, k, v, positions, cos_sin_or_inv_freq, k_cache, v_cache, interleaved,
                                         v_norm_weight, v_norm_eps)
    return _rope_and_cache_write_torch(q, k, v, positions, cos_sin_or_inv_freq, k_cache, v_cache, interleaved,
                                       v_norm_weight, v_norm_eps)


def _rope_and_cache_write_torch(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None,
                                positions: torch.Tensor, cos_sin_or_inv_freq: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor | None, interleaved: bool,
                                v_norm_weight: torch.Tensor | None = None,
                                v_norm_eps: float = 1e-6) -> torch.Tensor | None:
    """The same in plain PyTorch, with the rotation math of ``baton.ops.rope`` (fp32 angles and rotation) and the
    norm of ``baton.ops.rmsnorm.naive.rms_norm``."""
    table = cos_sin_or_inv_freq
    if table.dim() == 2:
        cos, sin = table[positions].float().chunk(2, dim=-1)  # [T, rotary_dim / 2] each
    else:
        cos, sin = rope_cos_sin(positions, table)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin, interleaved)

    if q is not None:
        q = rotate(q)  # out of place, so autograd (draft training) can differentiate through it
    k3 = k if k.dim() == 3 else k.unsqueeze(1)
    k_cache3 = k_cache if k_cache.dim() == 3 else k_cache.unsqueeze(1)
    k_cache3.index_copy_(0, positions, rotate(k3).to(k_cache.dtype))
    if v is not None:
        if v_norm_weight is not None:
            v = rms_norm_naive(v, v_norm_weight, v_norm_eps)
        v_cache3 = v_cache if v_cache.dim() == 3 else v_cache.unsqueeze(1)
        v_cache3.index_copy_(0, positions, (v if v.dim() == 3 else v.unsqueeze(1)).to(v_cache.dtype))
    return q
