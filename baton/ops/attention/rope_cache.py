"""One Triton kernel for RoPE on q and k plus the cache write of k and v at device-side positions.

It replaces the ~20 small PyTorch ops of ``RotaryEmbedding`` on q and k followed by ``KVCache.write`` (or
``MLACache.write``) with one launch, and keeps their semantics (``baton.layers.rope``): angles =
positions.float() * inv_freq in fp32, the rotation in fp32, the result rounded to the input's dtype (then to
the cache's); rotate-half ("neox", Llama) or interleaved pairs ("GPT-J", Ling MLA). Dimensions past the
rotary width pass through unchanged.

The cosines come either from ``inv_freq`` [rotary_dim / 2] (computed in the kernel: libdevice cos/sin on CUDA,
the same fp32 functions PyTorch calls) or from a table [max_len, rotary_dim] = [cos | sin] built by
``cos_sin_cache`` with the very ops of ``RotaryEmbedding.cos_sin``, which makes the angles bit-identical.

Callers (one program per token, all heads in it):

- Llama GQA: q [T, H, D], k, v [T, Hkv, D], caches [S, Hkv, D].
- Ling MLA: q = q[..., nope:] [T, H, 64] (rotated in place inside the wider q), k = kv[:, 512:] [T, 64],
  v = c = kv[:, :512] [T, 512] with ``v_norm_weight`` = kv_a_layernorm's weight, k_cache = latent[:, 512:],
  v_cache = latent[:, :512]: the latent row is written as [RMSNorm(c) | RoPE(k_rope)] in one launch (the norm
  was a kernel of its own before). 2-D k / v / caches are read as one head.

The optional norm of v (``V_NORM``) is the arithmetic of ``baton.ops.rmsnorm``: per (token, head) row, the sum of
squares and 1 / rms in fp32, the normalised row rounded to v's dtype, times the weight in promote(v, weight)
dtype, then cast to the cache's dtype. Without it, its pointer and eps are passed as None (constexprs) and the
Llama / GQA kernel compiles to the PTX it had before the option existed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from baton.env import triton_interpret
from baton.ops.attention.triton import pdl_enabled
from baton.ops.linear.triton import _round

__all__ = ["cos_sin_cache", "rope_and_cache_write", "rope_and_cache_write_fwd", "rope_cos_sin"]


@triton.jit
def rope_cos_sin(freq_ptr, pos, i, ok, HALF: tl.constexpr, USE_TABLE: tl.constexpr, stride_table,
                 USE_LIBDEVICE: tl.constexpr):
    """cos, sin (fp32) of rotation pair ``i`` at position ``pos``, broadcast together (a scalar position and
    [BLOCK] pairs, or [R, 1] positions and [1, BLOCK] pairs); ``ok`` masks ``i``. From a ``cos_sin_cache``
    table row, or angle = pos * inv_freq[i] through libdevice (CUDA) / tl (interpreter) cos and sin."""
    if USE_TABLE:
        row = freq_ptr + pos.to(tl.int64) * stride_table
        cos = tl.load(row + i, mask=ok, other=0.0).to(tl.float32)
        sin = tl.load(row + HALF + i, mask=ok, other=0.0).to(tl.float32)
    else:
        angle = pos.to(tl.float32) * tl.load(freq_ptr + i, mask=ok, other=0.0).to(tl.float32)
        if USE_LIBDEVICE:
            cos = libdevice.cos(angle)
            sin = libdevice.sin(angle)
        else:
            cos = tl.cos(angle)
            sin = tl.sin(angle)
    return cos, sin


@triton.jit
def _rotate_heads(x_ptr, dst_ptr, stride_x_h, stride_dst_h, num_heads, cos, sin, offs_i, i_ok,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, INTERLEAVED: tl.constexpr):
    """dst[h, pair] = rotation of x[h, pair] by the angle of each pair, for all heads; fp32 math, the result
    rounded to x's dtype and then to dst's."""
    heads = tl.arange(0, BLOCK_H)
    ok = (heads < num_heads)[:, None] & i_ok[None, :]  # [BLOCK_H, BLOCK_HALF]
    if INTERLEAVED:
        i1 = 2 * offs_i
        i2 = 2 * offs_i + 1
    else:
        i1 = offs_i
        i2 = offs_i + HALF
    x_row = x_ptr + heads[:, None] * stride_x_h
    x1 = tl.load(x_row + i1[None, :], mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2[None, :], mask=ok, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    x_ty = x_ptr.dtype.element_ty
    dst_ty = dst_ptr.dtype.element_ty
    dst_row = dst_ptr + heads[:, None] * stride_dst_h
    tl.store(dst_row + i1[None, :], o1.to(x_ty).to(dst_ty), mask=ok)
    tl.store(dst_row + i2[None, :], o2.to(x_ty).to(dst_ty), mask=ok)


@triton.jit
def _copy_heads(x_ptr, dst_ptr, stride_x_h, stride_dst_h, num_heads, first, width,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    """dst[h, first:first + width] = x[h, first:first + width] for all heads, cast to dst's dtype."""
    heads = tl.arange(0, BLOCK_H)
    offs = first + tl.arange(0, BLOCK_D)
    ok = (heads < num_heads)[:, None] & (offs < first + width)[None, :]
    x = tl.load(x_ptr + heads[:, None] * stride_x_h + offs[None, :], mask=ok, other=0.0)
    tl.store(dst_ptr + heads[:, None] * stride_dst_h + offs[None, :], x.to(dst_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _norm_heads(x_ptr, w_ptr, dst_ptr, stride_x_h, stride_dst_h, num_heads, eps, width: tl.constexpr,
                BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INTERPRET: tl.constexpr):
    """dst[h, :width] = RMSNorm(x[h, :width]) * w for all heads, the arithmetic of ``baton.ops.rmsnorm``'s
    reference (and of its Triton kernel): sum of squares and 1 / rms in fp32, the normalised row rounded to x's
    dtype, times the weight in promote(x, w) (x's dtype when w's is the same, else fp32), then cast to dst's
    dtype as the cache write casts. Rounding to nearest even also in the interpreter (``_round``)."""
    heads = tl.arange(0, BLOCK_H)
    offs = tl.arange(0, BLOCK_D)
    d_ok = offs < width
    ok = (heads < num_heads)[:, None] & d_ok[None, :]
    xf = tl.load(x_ptr + heads[:, None] * stride_x_h + offs[None, :], mask=ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(xf * xf, axis=1) / width + eps)  # [BLOCK_H]
    x_ty = x_ptr.dtype.element_ty
    y = _round(xf * rstd[:, None], x_ty, INTERPRET)
    w = tl.load(w_ptr + offs, mask=d_ok, other=0.0).to(tl.float32)
    out = y * w[None, :]
    if w_ptr.dtype.element_ty == x_ty:  # the product's dtype is x's: round it (exact in fp32 for 16-bit inputs)
        out = _round(out, x_ty, INTERPRET)
    dst_ty = dst_ptr.dtype.element_ty
    out = _round(out, dst_ty, INTERPRET)  # the cache write's cast, to nearest even in the interpreter too
    tl.store(dst_ptr + heads[:, None] * stride_dst_h + offs[None, :], out.to(dst_ty), mask=ok)


@triton.jit
def rope_and_cache_write_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, freq_ptr, k_cache_ptr, v_cache_ptr, v_norm_w_ptr,
    num_q_heads, num_k_heads, num_v_heads,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, stride_table, v_norm_eps,
    HALF: tl.constexpr, HEAD_DIM_K: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_HV: tl.constexpr,
    BLOCK_PASS: tl.constexpr, BLOCK_DV: tl.constexpr,
    INTERLEAVED: tl.constexpr, USE_TABLE: tl.constexpr, HAS_Q: tl.constexpr, HAS_V: tl.constexpr,
    V_NORM: tl.constexpr, INTERPRET: tl.constexpr, USE_LIBDEVICE: tl.constexpr, USE_PDL: tl.constexpr,
):
    t = tl.program_id(0)
    if USE_PDL:  # q, k, v and the positions come from earlier kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pos = tl.load(pos_ptr + t)
    offs_i = tl.arange(0, BLOCK_HALF)
    i_ok = offs_i < HALF
    cos, sin = rope_cos_sin(freq_ptr, pos, offs_i, i_ok, HALF, USE_TABLE, stride_table, USE_LIBDEVICE)  # [BLOCK_HALF]

    if HAS_Q:  # in place
        q_t = q_ptr + t.to(tl.int64) * stride_q_t
        _rotate_heads(q_t, q_t, stride_q_h, stride_q_h, num_q_heads, cos, sin, offs_i, i_ok,
                      HALF, BLOCK_HQ, INTERLEAVED)
    k_t = k_ptr + t.to(tl.int64) * stride_k_t
    k_dst = k_cache_ptr + pos.to(tl.int64) * stride_kc_s
    _rotate_heads(k_t, k_dst, stride_k_h, stride_kc_h, num_k_heads, cos, sin, offs_i, i_ok,
                  HALF, BLOCK_HK, INTERLEAVED)
    if BLOCK_PASS > 0:  # k dims past the rotary width
        _copy_heads(k_t, k_dst, stride_k_h, stride_kc_h, num_k_heads, 2 * HALF, HEAD_DIM_K - 2 * HALF,
                    BLOCK_HK, BLOCK_PASS)
    if HAS_V:
        v_t = v_ptr + t.to(tl.int64) * stride_v_t
        v_dst = v_cache_ptr + pos.to(tl.int64) * stride_vc_s
        if V_NORM:  # MLA: the cache row's c is kv_a_layernorm(c)
            _norm_heads(v_t, v_norm_w_ptr, v_dst, stride_v_h, stride_vc_h, num_v_heads, v_norm_eps, HEAD_DIM_V,
                        BLOCK_HV, BLOCK_DV, INTERPRET)
        else:
            _copy_heads(v_t, v_dst, stride_v_h, stride_vc_h, num_v_heads, 0, HEAD_DIM_V, BLOCK_HV, BLOCK_DV)


def cos_sin_cache(inv_freq: torch.Tensor, max_len: int) -> torch.Tensor:
    """[max_len, rotary_dim] = [cos | sin] of positions 0..max_len-1, by the ops of ``RotaryEmbedding.cos_sin``."""
    positions = torch.arange(max_len, device=inv_freq.device)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [max_len, rotary_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def _heads(x: torch.Tensor) -> torch.Tensor:
    """A [T, D] tensor as [T, 1, D] (one head), strides kept."""
    return x.unsqueeze(1) if x.dim() == 2 else x


def rope_and_cache_write_fwd(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None, positions: torch.Tensor,
                             cos_sin_or_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                             interleaved: bool, v_norm_weight: torch.Tensor | None = None,
                             v_norm_eps: float = 1e-6) -> None:
    """Launches ``rope_and_cache_write_kernel`` over T programs; 3-D operands with a contiguous last dim. Without
    ``v_norm_weight`` its pointer and eps go in as None (constexprs): the kernel compiles as it did before the
    norm existed."""
    num_tokens, num_k_heads, head_dim_k = k.shape
    table = cos_sin_or_inv_freq
    use_table = table.dim() == 2
    half = table.shape[1] // 2 if use_table else table.shape[0]
    num_q_heads = 0 if q is None else q.shape[1]
    num_v_heads, head_dim_v = (0, 1) if v is None else v.shape[1:]
    q_arg = k if q is None else q  # dummies are never dereferenced
    v_arg, vc_arg = (k, k_cache) if v is None else (v, v_cache)
    device = k.device
    pdl = pdl_enabled(device)
    v_norm = v is not None and v_norm_weight is not None
    rope_and_cache_write_kernel[(num_tokens,)](
        q_arg, k, v_arg, positions, table, k_cache, vc_arg, v_norm_weight if v_norm else None,
        num_q_heads, num_k_heads, num_v_heads,
        q_arg.stride(0), q_arg.stride(1), k.stride(0), k.stride(1), v_arg.stride(0), v_arg.stride(1),
        k_cache.stride(0), k_cache.stride(1), vc_arg.stride(0), vc_arg.stride(1), table.stride(0),
        float(v_norm_eps) if v_norm else None,
        HALF=half, HEAD_DIM_K=head_dim_k, HEAD_DIM_V=head_dim_v,
        BLOCK_HALF=triton.next_power_of_2(half), BLOCK_HQ=triton.next_power_of_2(max(1, num_q_heads)),
        BLOCK_HK=triton.next_power_of_2(num_k_heads), BLOCK_HV=triton.next_power_of_2(max(1, num_v_heads)),
        BLOCK_PASS=0 if head_dim_k == 2 * half else triton.next_power_of_2(head_dim_k - 2 * half),
        BLOCK_DV=triton.next_power_of_2(head_dim_v),
        INTERLEAVED=bool(interleaved), USE_TABLE=use_table, HAS_Q=q is not None, HAS_V=v is not None,
        V_NORM=v_norm, INTERPRET=triton_interpret(), USE_LIBDEVICE=device.type == "cuda" and not triton_interpret(),
        USE_PDL=pdl,
        num_warps=4 if num_q_heads * half >= 512 or head_dim_v >= 512 else 2,
        **({"launch_pdl": True} if pdl else {}),
    )


def rope_and_cache_write(q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor | None, positions: torch.Tensor,
                         cos_sin_or_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None,
                         interleaved: bool, v_norm_weight: torch.Tensor | None = None,
                         v_norm_eps: float = 1e-6) -> torch.Tensor | None:
    """RoPE on q (in place; returned) and k, then k_cache[positions] = RoPE(k), v_cache[positions] = v (or
    ``rms_norm(v, v_norm_weight, v_norm_eps)`` per head, when a weight [Dv] is given: MLA's kv_a_layernorm).

    q [T, Hq, Dq] or None; k [T, Hk, Dk] or [T, Dk]; v [T, Hv, Dv], [T, Dv] or None; positions [T] int;
    caches [S, Hk, Dk] / [S, Hv, Dv] (or 2-D); ``cos_sin_or_inv_freq`` is inv_freq [rotary_dim / 2] (fp32) or a
    ``cos_sin_cache`` table [>= max position + 1, rotary_dim]. The rotary width may be below Dq / Dk; the
    dims past it pass through. k and v themselves are left as they were."""
    k, k_cache = _heads(k), _heads(k_cache)
    v = None if v is None else _heads(v)
    v_cache = None if v_cache is None else _heads(v_cache)
    assert (v is None) == (v_cache is None), "v and v_cache come together"
    table = cos_sin_or_inv_freq.contiguous()
    rotary_dim = table.shape[1] if table.dim() == 2 else 2 * table.shape[0]
    assert k.shape[2] >= rotary_dim and k_cache.shape[1:] == k.shape[1:], f"k {tuple(k.shape)}"
    assert q is None or (q.dim() == 3 and q.shape[2] >= rotary_dim), "q [T, H, D] with D >= rotary_dim"
    assert v is None or v_cache.shape[1:] == v.shape[1:], f"v {tuple(v.shape)} vs cache {tuple(v_cache.shape)}"
    assert v_norm_weight is None or (v is not None and v_norm_weight.shape == (v.shape[2],)
                                     and v_norm_weight.is_contiguous()), "v_norm_weight [Dv] with v"
    for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        assert x is None or x.stride(-1) == 1, f"{name}: the last dim must be contiguous"
    rope_and_cache_write_fwd(q, k, v, positions.contiguous(), table, k_cache, v_cache, interleaved, v_norm_weight,
                             v_norm_eps)
    return q
