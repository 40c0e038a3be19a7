"""Triton flash-decoding for weight-absorbed MLA: MQA with one 576-wide key and its first 512 values as value.

Semantics are those of ``baton.ops.mla_decode.naive.mla_decode``: score(i, j) = (q_lat_i . c_j + q_rope_i .
k_rope_j) * scale over cache rows j <= q_positions[i], fp32 softmax, o_lat_i = sum_j p_ij c_j. The context
length is read on the device (max(q_positions) + 1) and no row past it is loaded; the cache length S is only
the capture-time maximum.

Design:

- All query heads share the one latent row, so a program takes a tile of ``BLOCK_M`` rows of the flattened
  [T * H] queries (row = t * H + h) and streams each cache row once for all of them: scores are
  [BLOCK_M, 512] x [512, BLOCK_N] + [BLOCK_M, 64] x [64, BLOCK_N] and the value update
  [BLOCK_M, BLOCK_N] x [BLOCK_N, 512], both ``tl.dot``, reusing the same [BLOCK_N, 512] tile of c. Decode at
  Ling's H = 32 is one tile (all heads in one program). The fp32 accumulator is [BLOCK_M, 512], so rows are
  capped by registers (BLOCK_M = 32: 64 KiB of accumulator; 64-row tiles measured slower on H200); verify's
  T * H rows become several tiles, and the tiles of one key range are neighbours in the grid (axis 0) so
  that they run together and share the latent rows through L2. Verify at T = 16 (512 rows x 1088 MACs per
  key) is bound by the mma.sync tensor-core rate, not by the cache read.
- Split-KV exactly as in ``baton.ops.attention.triton``: num_splits is a fixed function of the shapes, the
  actual context is cut into num_splits runs of key blocks on the device, each split stores a normalised
  partial output and its log-sum-exp, and ``attention_reduce_kernel`` merges them (skipped for one split).
- The head-wise output gate of Ling MLA (optional ``gate_logits`` [T, H]): dense(o * sigmoid(g)) per (token,
  head) with o = o_lat @ W_UV^T linear, so the gate scales the fp32 o_lat row before its one rounding: in this
  kernel's store with one split, in ``attention_reduce_kernel`` with several (HAS_GATE in both; off, the
  kernels compile as they did without it). It replaces five torch kernels after the W_UV product.

Layouts: q_lat [T, H, C], q_rope [T, H, R], gate_logits [T, H] (strided views fine, last dim contiguous: q_lat
is the W_UK bmm's head-major output viewed as [T, H, C]), latent [S, C + R] with contiguous rows, q_positions
[T]. Output [T, H, C] in q_lat's dtype (``out`` any such view with a contiguous last dim).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.ops.attention.triton import (
    LOG2E,
    NEG_BIG,
    _kv_blocks_of_split,
    _store_partial,
    _workspace,
    attention_reduce_fwd,
    dot_options,
    num_kv_splits,
    pdl_enabled,
    tile_dot,
)

__all__ = ["mla_decode", "mla_decode_fwd", "mla_default_config"]


@triton.jit(do_not_specialize=["max_len", "num_splits"])  # both vary on the eager path: no recompiles
def mla_decode_kernel(
    q_lat_ptr, q_rope_ptr, latent_ptr, pos_ptr, o_ptr, part_o_ptr, part_lse_ptr, gate_ptr,
    num_queries, num_heads, max_len, num_splits, qk_scale,
    stride_ql_t, stride_ql_h, stride_qr_t, stride_qr_h, stride_lat_s, stride_o_t, stride_o_h, stride_g_t,
    KV_RANK: tl.constexpr, ROPE_DIM: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr, SPLIT_KV: tl.constexpr,
    HAS_GATE: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr, USE_PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    if USE_PDL:  # the queries, the latent cache and the positions all come from earlier kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M], row = t * H + h
    t = rows // num_heads
    head = rows % num_heads
    row_ok = t < num_queries
    row_pos = tl.load(pos_ptr + t, mask=row_ok, other=-1)  # [BLOCK_M]
    tile_len = tl.minimum(tl.max(row_pos, axis=0) + 1, max_len).to(tl.int32)
    if SPLIT_KV:
        start, end, _ = _kv_blocks_of_split(pos_ptr, num_queries, max_len, split, num_splits, BLOCK_N, BLOCK_T)
    else:
        start = 0
        end = tl.cdiv(tile_len, BLOCK_N)
    loop_end = tl.minimum(end, tl.cdiv(tile_len, BLOCK_N))

    offs_c = tl.arange(0, BLOCK_C)
    offs_r = tl.arange(0, BLOCK_R)
    c_ok = offs_c < KV_RANK
    r_ok = offs_r < ROPE_DIM
    cache_ty = latent_ptr.dtype.element_ty
    ql_ptrs = q_lat_ptr + t[:, None].to(tl.int64) * stride_ql_t + head[:, None] * stride_ql_h + offs_c[None, :]
    q_lat = tl.load(ql_ptrs, mask=row_ok[:, None] & c_ok[None, :], other=0.0).to(cache_ty)  # [M, C]
    qr_ptrs = q_rope_ptr + t[:, None].to(tl.int64) * stride_qr_t + head[:, None] * stride_qr_h + offs_r[None, :]
    q_rope = tl.load(qr_ptrs, mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(cache_ty)  # [M, R]

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_C], tl.float32)
    for blk in range(start, loop_end):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_ok = keys < tile_len
        row_ptrs = latent_ptr + keys[:, None].to(tl.int64) * stride_lat_s
        c = tl.load(row_ptrs + offs_c[None, :], mask=key_ok[:, None] & c_ok[None, :], other=0.0)  # [N, C]
        k_rope = tl.load(row_ptrs + KV_RANK + offs_r[None, :], mask=key_ok[:, None] & r_ok[None, :],
                         other=0.0)  # [N, R]
        s = tile_dot(q_lat, tl.trans(c), PRECISION, UPCAST) + tile_dot(q_rope, tl.trans(k_rope), PRECISION, UPCAST)
        s = s * qk_scale  # [M, N]
        visible = (keys[None, :] <= row_pos[:, None]) & key_ok[None, :]
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tile_dot(p.to(cache_ty), c, PRECISION, UPCAST)
        m_i = m_new

    if SPLIT_KV:
        _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, rows, row_ok, start < end, split,
                       num_queries * num_heads, offs_c, KV_RANK)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o_ptrs = o_ptr + t[:, None].to(tl.int64) * stride_o_t + head[:, None] * stride_o_h + offs_c[None, :]
        o = acc / l_safe[:, None]  # [M, C] fp32
        if HAS_GATE:  # the head-wise output gate, per row: o_lat * sigmoid(gate[t, h]) in fp32
            g = tl.load(gate_ptr + t.to(tl.int64) * stride_g_t + head, mask=row_ok, other=0.0).to(tl.float32)
            o = o * tl.sigmoid(g)[:, None]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & c_ok[None, :])


def mla_default_config(num_rows: int, kv_lora_rank: int, elem_bytes: int = 2) -> dict:
    """Tile sizes: BLOCK_M query rows (<= 32: the [BLOCK_M, C] fp32 accumulator lives in registers) and 64 keys
    a block. For Ling's C = 512 in bf16, measured on H200 at 32K context: decode (32 rows, one tile) is fastest
    with 8 warps and 3 stages (27.5 us), verify (several tiles) with 4 warps and 2 stages (T=6: 76 us, T=16:
    170 us). fp32 caches take 32-key blocks and 2 stages (shared memory). Retune with
    ``python -m benchmarks.ops.bench_attention``."""
    one_tile = num_rows <= 32
    if kv_lora_rank > 256:
        wide_elems = elem_bytes > 2
        return dict(block_m=32, block_n=32 if wide_elems else 64, num_warps=8 if one_tile else 4,
                    num_stages=3 if one_tile and not wide_elems else 2)
    return dict(block_m=min(32, max(16, triton.next_power_of_2(num_rows))), block_n=64, num_warps=4, num_stages=2)


def mla_decode_fwd(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
                   kv_lora_rank: int, scale: float, out: torch.Tensor, num_splits: int, block_m: int, block_n: int,
                   num_warps: int, num_stages: int, gate_logits: torch.Tensor | None = None) -> None:
    """Launches ``mla_decode_kernel`` (and the reduction when ``num_splits`` > 1) into ``out`` [T, H, C]; with
    ``gate_logits`` [T, H] (last dim contiguous) the kernel that stores the output (the main one with one split,
    else the reduction) scales each fp32 row by sigmoid(gate[t, h]) before the store."""
    num_queries, num_heads, _ = q_lat.shape
    max_len = latent.shape[0]
    rope_dim = q_rope.shape[-1]
    num_rows = num_queries * num_heads
    num_tiles = triton.cdiv(num_rows, block_m)
    part_o, part_lse = (out, out) if num_splits == 1 else _workspace(num_splits, num_rows, kv_lora_rank,
                                                                     q_lat.device)
    pdl = pdl_enabled(q_lat.device)
    gate_here = gate_logits is not None and num_splits == 1  # split-KV: the reduction applies the gate
    mla_decode_kernel[(num_tiles, num_splits)](
        q_lat, q_rope, latent, q_positions, out, part_o, part_lse, gate_logits if gate_here else None,
        num_queries, num_heads, max_len, num_splits, float(scale) * LOG2E,
        q_lat.stride(0), q_lat.stride(1), q_rope.stride(0), q_rope.stride(1), latent.stride(0),
        out.stride(0), out.stride(1), gate_logits.stride(0) if gate_here else None,
        KV_RANK=kv_lora_rank, ROPE_DIM=rope_dim, BLOCK_C=max(16, triton.next_power_of_2(kv_lora_rank)),
        BLOCK_R=max(16, triton.next_power_of_2(rope_dim)), BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_T=triton.next_power_of_2(num_queries), SPLIT_KV=num_splits > 1, HAS_GATE=gate_here,
        **dot_options(latent.dtype), USE_PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        **({"launch_pdl": True} if pdl else {}),
    )
    if num_splits > 1:
        attention_reduce_fwd(part_o, part_lse, q_positions, out, max_len, block_n, gate_logits)


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
               kv_lora_rank: int, scale: float, gate_logits: torch.Tensor | None = None, *,
               out: torch.Tensor | None = None, num_splits: int | None = None, block_m: int | None = None,
               block_n: int | None = None, num_warps: int | None = None,
               num_stages: int | None = None) -> torch.Tensor:
    """q_lat [T, H, C], q_rope [T, H, R], latent [S, C + R], q_positions [T] -> o_lat [T, H, C] in q_lat's dtype,
    times sigmoid(gate_logits) [T, H] per (token, head) when given (in fp32, before the store).

    Query i attends to latent rows 0..q_positions[i]; rows past max(q_positions) are never read. The keyword
    arguments override the shape-derived defaults (benchmarks, tests); ``out`` may be any [T, H, C] view with a
    contiguous last dim."""
    num_queries, num_heads, c_dim = q_lat.shape
    assert c_dim == kv_lora_rank and q_rope.shape[:2] == (num_queries, num_heads), "query shapes"
    assert latent.shape[1] == kv_lora_rank + q_rope.shape[-1], f"latent rows of {latent.shape[1]} values"
    assert q_positions.shape == (num_queries,), "one position per query"
    assert gate_logits is None or gate_logits.shape == (num_queries, num_heads), "one gate logit per (token, head)"
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_rope = q_rope if q_rope.stride(-1) == 1 else q_rope.contiguous()
    if gate_logits is not None and gate_logits.stride(-1) != 1:
        gate_logits = gate_logits.contiguous()
    latent = latent if latent.stride(-1) == 1 else latent.contiguous()
    q_positions = q_positions.contiguous()
    if out is None:
        out = torch.empty(num_queries, num_heads, kv_lora_rank, dtype=q_lat.dtype, device=q_lat.device)  # [T, H, C]
    cfg = mla_default_config(num_queries * num_heads, kv_lora_rank, latent.element_size())
    overrides = dict(block_m=block_m, block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    cfg.update({key: val for key, val in overrides.items() if val is not None})
    if num_splits is None:
        num_splits = num_kv_splits(latent.shape[0], triton.cdiv(num_queries * num_heads, cfg["block_m"]))
    assert out.shape == q_lat.shape and out.stride(-1) == 1, "out [T, H, C] with a contiguous last dim"
    mla_decode_fwd(q_lat, q_rope, latent, q_positions, kv_lora_rank, scale, out, num_splits, **cfg,
                   gate_logits=gate_logits)
    return out
