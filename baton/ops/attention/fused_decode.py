"""Decode and verify attention in ONE Triton kernel: RoPE of q and of the new k, the cache write of the new k and
v, flash-decoding over the cache, and the merge of the splits (the last split to finish does it).

Why: at short contexts the three kernels of the unfused path (``rope_cache.rope_and_cache_write``, the split
``attention_kernel`` and ``attention_reduce_kernel``) are a chain of launch latencies, not of reads: for SmolLM2
at a 512-token context the layer's attention time is many times its K/V bytes over the bandwidth
(docs/performance.md has the census). Semantics are those of ``rope_and_cache_write`` followed by ``attention``
(causal over cache rows), for the T new tokens of one sequence at contiguous positions p0 .. p0 + T - 1
(decode, a verify chain, a draft step):

- Keys before p0 come from the cache, split across ``num_splits`` programs per (row tile, kv head) exactly as
  ``triton.attention_kernel`` splits them (``num_kv_splits`` of the cache capacity: the grid is a function of
  shapes, so a CUDA graph replays at any context).
- The T new keys and values never make a round trip through the cache inside this launch: split 0 rotates
  them in registers, attends to them as one extra tile (query row t sees new key u iff u <= t), and (in the
  first row tile) writes RoPE(k) and v to the cache rows p0 .. p0 + T - 1 for later steps. No other program
  reads those rows, so there is no race.
- Each split stores its normalised partial and log2-sum-exp (fp32), then takes a ticket on a per-(tile, kv
  head) counter (an acq_rel atomic); the program that draws the last ticket merges the partials into the output
  and resets the counter to 0 for the next launch. One split (short caches): no workspace, no counter.

RoPE is rotate-half ("neox", Llama) over the full head dim, angles positions.float() * inv_freq in fp32 (or a
``cos_sin_cache`` table), the rotation in fp32 and the result rounded to the input's dtype, as in
``rope_cache``. Interleaved RoPE, partial rotary widths, T > ``MAX_TOKENS`` or a custom mask take the unfused
path (``baton.ops.attention.rope_cache_attention`` decides).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.env import triton_interpret
from baton.ops.attention.rope_cache import rope_cos_sin
from baton.ops.attention.triton import (
    LOG2E,
    NEG_BIG,
    _store_partial,
    attend_tile,
    default_blocks,
    default_num_splits,
    default_num_stages,
    dot_options,
    pdl_enabled,
)

__all__ = ["MAX_TOKENS", "fused_rope_cache_attention"]

MAX_TOKENS = 16  # new tokens per call (decode, verify chains, draft blocks); longer runs take the unfused path


@triton.jit
def _angles(freq_ptr, pos, offs_d, HALF: tl.constexpr, USE_TABLE: tl.constexpr, stride_table,
            USE_LIBDEVICE: tl.constexpr):
    """cos, sin [R, BLOCK_D] of the rotation pair of each dim (d and d +- HALF share angle d % HALF) at the rows'
    positions ``pos`` [R]."""
    return rope_cos_sin(freq_ptr, pos[:, None], (offs_d % HALF)[None, :], (offs_d < 2 * HALF)[None, :], HALF,
                        USE_TABLE, stride_table, USE_LIBDEVICE)


@triton.jit
def _rope_rows(base, row_stride_ptrs, offs_d, ok, cos, sin, HALF: tl.constexpr):
    """Rotate-half RoPE of rows [R, BLOCK_D] (``base`` + per-row offsets ``row_stride_ptrs`` [R]) in fp32:
    out[d] = x[d] cos - x[d + HALF] sin for d < HALF, x[d] cos + x[d - HALF] sin for HALF <= d < 2 HALF."""
    partner = tl.where(offs_d < HALF, offs_d + HALF, offs_d - HALF)
    x = tl.load(base + row_stride_ptrs[:, None] + offs_d[None, :], mask=ok, other=0.0)
    xp = tl.load(base + row_stride_ptrs[:, None] + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    sign = tl.where(offs_d < HALF, -1.0, 1.0)
    out = x.to(tl.float32) * cos + sign[None, :] * xp * sin
    return out.to(x.dtype)  # rounded to the input's dtype, as the unfused kernel stores it


@triton.jit(do_not_specialize=["max_len", "num_splits"])
def fused_decode_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, freq_ptr, kc_ptr, vc_ptr, o_ptr, part_o_ptr, part_lse_ptr, count_ptr,
    num_queries, num_heads, num_kv_heads, max_len, num_splits, qk_scale,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_kc_s, stride_kc_h, stride_vc_s, stride_vc_h, stride_o_t, stride_o_h, stride_table,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, HALF: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, SPLIT_KV: tl.constexpr, USE_TABLE: tl.constexpr, USE_LIBDEVICE: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:  # q, k, v and the positions come from earlier kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    p0 = tl.load(pos_ptr).to(tl.int32)  # the first new position: keys < p0 are in the cache
    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M], row = t * GROUP + g
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = t < num_queries
    row_pos = p0 + t
    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    v_ok = offs_v < HEAD_DIM_V
    kv_ty = kc_ptr.dtype.element_ty

    # q: RoPE in registers (never written back)
    cos_q, sin_q = _angles(freq_ptr, row_pos, offs_d, HALF, USE_TABLE, stride_table, USE_LIBDEVICE)
    q_rows = t.to(tl.int64) * stride_q_t + head * stride_q_h
    q = _rope_rows(q_ptr, q_rows, offs_d, row_ok[:, None] & d_ok[None, :], cos_q, sin_q, HALF).to(kv_ty)

    # the cached keys 0 .. p0 - 1, this split's share (the split arithmetic of attention_kernel, on p0 rows)
    if SPLIT_KV:  # p0 cached rows cut into num_splits equal runs of blocks (``_kv_blocks_of_split`` on p0)
        num_blocks = tl.cdiv(p0, BLOCK_N)
        per_split = tl.maximum(tl.cdiv(num_blocks, num_splits), 1)
        start = split * per_split
        end = tl.minimum(start + per_split, num_blocks)
        num_active = tl.maximum(tl.cdiv(num_blocks, per_split), 1)  # split 0 always holds the new keys
    else:
        start = 0
        end = tl.cdiv(p0, BLOCK_N)
        num_active = 1
    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = kc_ptr + kv_head * stride_kc_h
    v_base = vc_ptr + kv_head * stride_vc_h
    for blk in range(start, end):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < p0  # every query sits at or past p0: all cached keys are visible
        k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_kc_s + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)
        v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_vc_s + offs_v[None, :],
                    mask=key_ok[:, None] & v_ok[None, :], other=0.0)
        visible = key_ok[None, :] & row_ok[:, None]
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION, UPCAST)

    if split == 0:  # the T new keys: rotated here, attended as one more tile, written to the cache (tile 0)
        u = tl.arange(0, BLOCK_T)
        u_ok = u < num_queries
        cos_k, sin_k = _angles(freq_ptr, p0 + u, offs_d, HALF, USE_TABLE, stride_table, USE_LIBDEVICE)
        k_rows = u.to(tl.int64) * stride_k_t + kv_head * stride_k_h
        k_new = _rope_rows(k_ptr, k_rows, offs_d, u_ok[:, None] & d_ok[None, :], cos_k, sin_k, HALF).to(kv_ty)
        v_new = tl.load(v_ptr + u[:, None].to(tl.int64) * stride_v_t + kv_head * stride_v_h + offs_v[None, :],
                        mask=u_ok[:, None] & v_ok[None, :], other=0.0).to(vc_ptr.dtype.element_ty)
        if tile == 0:
            dst = (p0 + u)[:, None].to(tl.int64)
            tl.store(k_base + dst * stride_kc_s + offs_d[None, :], k_new, mask=u_ok[:, None] & d_ok[None, :])
            tl.store(v_base + dst * stride_vc_s + offs_v[None, :], v_new, mask=u_ok[:, None] & v_ok[None, :])
        visible = (u[None, :] <= t[:, None]) & u_ok[None, :] & row_ok[:, None]  # [BLOCK_M, BLOCK_T]
        m_i, l_i, acc = attend_tile(q, k_new, v_new, visible, m_i, l_i, acc, qk_scale, PRECISION, UPCAST)

    o_rows = t[:, None].to(tl.int64) * stride_o_t + head[:, None] * stride_o_h + offs_v[None, :]
    if SPLIT_KV:
        num_rows = num_queries * num_heads
        part_rows = t * num_heads + head
        _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, part_rows, row_ok, (start < end) | (split == 0),
                       split, num_rows, offs_v, HEAD_DIM_V)
        counter = count_ptr + tile * num_kv_heads + kv_head
        tl.debug_barrier()  # every thread's partial stores precede the release below (CUTLASS's semaphore order)
        ticket = tl.atomic_add(counter, 1, sem="acq_rel")  # our partial is visible to whoever draws the last
        if ticket == num_splits - 1:  # every split has stored: merge (splits past num_active hold no keys)
            tl.debug_barrier()  # and every thread's loads follow the acquire
            m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
            den = tl.zeros([BLOCK_M], tl.float32)
            out = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
            for s_ in range(0, num_active):
                base = s_ * num_rows + part_rows
                lse = tl.load(part_lse_ptr + base, mask=row_ok, other=float("-inf"))
                o_s = tl.load(part_o_ptr + base[:, None].to(tl.int64) * HEAD_DIM_V + offs_v[None, :],
                              mask=row_ok[:, None] & v_ok[None, :], other=0.0)
                m_new = tl.maximum(m, lse)
                a = tl.exp2(m - m_new)
                b = tl.exp2(lse - m_new)
                out = out * a[:, None] + b[:, None] * o_s
                den = den * a + b
                m = m_new
            den = tl.where(den > 0.0, den, 1.0)
            tl.store(o_ptr + o_rows, (out / den[:, None]).to(o_ptr.dtype.element_ty),
                     mask=row_ok[:, None] & v_ok[None, :])
            tl.atomic_xchg(counter, 0)  # ready for the next launch (the next replay of a graph included)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        tl.store(o_ptr + o_rows, (acc / l_safe[:, None]).to(o_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & v_ok[None, :])


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 tickets [n], one buffer per device and size for the whole process: each launch's merging
    program resets its counters to 0, and launches on a stream run one after another (a PDL successor waits
    for this grid's completion before it touches anything), so calls and graph replays can share them."""
    key = (str(device), n)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return buf


def fused_rope_cache_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                               cos_sin_or_inv_freq: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
                               block_n: int | None = None, num_warps: int = 4,
                               num_stages: int | None = None) -> torch.Tensor:
    """q [T, H, D], k / v [T, Hkv, D] (before RoPE), positions [T] = p0 .. p0 + T - 1 (on the device),
    caches [S, Hkv, D]; ``cos_sin_or_inv_freq`` is inv_freq [D / 2] or a ``cos_sin_cache`` table [>= S, D].
    Writes k_cache / v_cache rows p0 .. p0 + T - 1 (RoPE(k), v) and returns attention(RoPE(q)) [T, H, D] in
    q's dtype. q is not modified. ``num_splits`` / ``block_n`` override the defaults (tests, benchmarks)."""
    num_queries, num_heads, head_dim = q.shape
    max_len, num_kv_heads, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    table = cos_sin_or_inv_freq
    use_table = table.dim() == 2
    half = table.shape[1] // 2 if use_table else table.shape[0]
    assert 1 <= num_queries <= MAX_TOKENS, f"{num_queries} tokens: the fused path takes 1..{MAX_TOKENS}"
    assert 2 * half == head_dim, "RoPE over the full head dim only"
    assert k.shape == (num_queries, num_kv_heads, head_dim) and v.shape == (num_queries, num_kv_heads, head_dim_v)
    assert num_heads % num_kv_heads == 0 and v_cache.shape[:2] == k_cache.shape[:2]
    for name, x in (("q", q), ("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache), ("rope", table)):
        assert x.stride(-1) == 1, f"{name}: the last dim must be contiguous"
    if out is None:
        out = torch.empty(num_queries, num_heads, head_dim_v, dtype=q.dtype, device=q.device)
    group = num_heads // num_kv_heads
    block_m, default_n = default_blocks(num_queries * group, head_dim)
    block_n = block_n or default_n
    num_stages = num_stages or default_num_stages(block_n, head_dim, head_dim_v, k_cache.element_size())
    if num_splits is None:
        num_splits = default_num_splits(num_queries, num_heads, num_kv_heads, head_dim, max_len)
    num_tiles = triton.cdiv(num_queries * group, block_m)
    if num_splits > 1:
        part_o = torch.empty(num_splits, num_queries * num_heads, head_dim_v, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(num_splits, num_queries * num_heads, dtype=torch.float32, device=q.device)
        count = _counters(q.device, num_tiles * num_kv_heads)
    else:
        part_o = part_lse = count = out  # never dereferenced
    pdl = pdl_enabled(q.device)
    fused_decode_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k, v, positions, table, k_cache, v_cache, out, part_o, part_lse, count,
        num_queries, num_heads, num_kv_heads, max_len, num_splits, float(scale) * LOG2E,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1), out.stride(0), out.stride(1),
        table.stride(0),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v, HALF=half,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=max(16, triton.next_power_of_2(head_dim_v)),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_T=max(16, triton.next_power_of_2(num_queries)),
        SPLIT_KV=num_splits > 1, USE_TABLE=use_table, USE_LIBDEVICE=q.is_cuda and not triton_interpret(),
        **dot_options(k_cache.dtype), USE_PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    return out
