"""Triton flash-decoding attention over a position-indexed KV cache: GQA decode and verify (and prefill).

Semantics are those of ``baton.ops.attention.naive.attention`` with the causal mask: query i sees cache rows
0..q_positions[i]. Nothing per step comes from the host: the context length is max(q_positions) + 1, read on
the device, and the cache length S is only the capture-time maximum, so one CUDA graph replays for any
context. No key row beyond max(q_positions) is ever loaded.

Design:

- A program owns one kv head, one tile of ``BLOCK_M`` query rows and one range of key blocks. Row
  r = t * group + g is query position t of query head ``kv_head * group + g``: all the group's heads for all
  T positions share one program, so K and V are read once per kv head (SmolLM2 verify, T=16: 48 rows, one
  tile). QK^T and PV are ``tl.dot`` tiles [BLOCK_M, D] x [D, BLOCK_N]; the softmax is online, in fp32, in
  base 2 (the scale folds log2(e)).
- Split-KV (flash-decoding): the grid has ``num_splits`` programs along the key axis, a fixed function of
  the shapes (``num_kv_splits``: S, heads, tiles) so replays are shape-stable. The *actual* context is cut
  into num_splits equal runs of key blocks on the device, so every split has work at short and long
  contexts alike; a split past the end of a short context exits without a load. Each split stores its
  normalised partial output and its log-sum-exp (fp32); ``attention_reduce_kernel`` merges them.
  With one split the main kernel writes the output itself and the reduction is not launched.
- Longer T (prefill) tiles the rows over a grid axis; each tile stops at its own last position.

Layouts: q [T, H, D], k_cache [S, Hkv, D], v_cache [S, Hkv, Dv] with the last dim contiguous (strided views of
a wider projection output are fine); q_positions [T] int32/int64 on the same device. Output [T, H, Dv] in q's
dtype.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from baton.env import triton_interpret, use_pdl

__all__ = [
    "attend_tile",
    "attention",
    "attention_fwd",
    "attention_reduce_fwd",
    "default_blocks",
    "default_num_splits",
    "default_num_stages",
    "num_kv_splits",
    "pdl_enabled",
]

LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # running-max start: finite, so a fully masked block gives exp2(-inf) = 0, never NaN

# Split policy constants (see num_kv_splits). 132 SMs on H200/H100 SXM: about two programs per SM.
TARGET_PROGRAMS = 264
MIN_KEYS_PER_SPLIT = 256
MAX_SPLITS = 128


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Programmatic dependent launch: CUDA, compute capability >= 9 and ``BATON_PDL`` on."""
    return _pdl_capable(device) and use_pdl()


def num_kv_splits(max_len: int, programs_per_split: int, target_programs: int = TARGET_PROGRAMS,
                  min_keys_per_split: int = MIN_KEYS_PER_SPLIT, max_splits: int = MAX_SPLITS) -> int:
    """Key-axis splits for a cache of ``max_len`` rows (the capture-time maximum) when each split already has
    ``programs_per_split`` programs (kv heads x row tiles): enough programs to fill the GPU, but no split
    shorter than ``min_keys_per_split`` keys at full length and at most ``max_splits`` partials to merge.
    Depends on shapes only, so a captured graph's grid never changes."""
    by_len = triton.cdiv(max_len, min_keys_per_split)
    by_grid = max(1, target_programs // max(1, programs_per_split))
    return max(1, min(by_len, by_grid, max_splits))


@triton.jit
def tile_dot(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with fp32 accumulation. UPCAST (the CPU interpreter only, whose 16-bit dot is wrong) widens the
    operands first: products of 16-bit floats are exact in fp32, so the result is the GPU's up to summation order."""
    if UPCAST:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b, input_precision=PRECISION)
    return out


@triton.jit
def attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One step of the online softmax: q [M, D] against a key tile k [N, D] / v [N, Dv] where ``visible``
    [M, N]; scores in base 2 (``qk_scale`` folds log2(e)), fp32 running max ``m_i``, sum ``l_i`` and output
    ``acc`` [M, Dv]. Returns the updated (m_i, l_i, acc)."""
    s = tile_dot(q, tl.trans(k), PRECISION, UPCAST) * qk_scale  # [M, N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tile_dot(p.to(v.dtype), v, PRECISION, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _kv_blocks_of_split(pos_ptr, num_queries, max_len, split, num_splits, BLOCK_N: tl.constexpr,
                        BLOCK_T: tl.constexpr):
    """Key blocks [start, end) of ``split`` and the number of splits holding any key: the context
    (max(q_positions) + 1 rows, read here on the device) cut into ``num_splits`` equal runs of blocks."""
    offs = tl.arange(0, BLOCK_T)
    pos = tl.load(pos_ptr + offs, mask=offs < num_queries, other=-1)  # [BLOCK_T]
    kv_len = tl.minimum(tl.max(pos, axis=0) + 1, max_len).to(tl.int32)
    num_blocks = tl.cdiv(kv_len, BLOCK_N)
    per_split = tl.maximum(tl.cdiv(num_blocks, num_splits), 1)
    start = split * per_split
    end = tl.minimum(start + per_split, num_blocks)
    return start, end, tl.cdiv(num_blocks, per_split)


@triton.jit
def _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, part_rows, row_ok, active, split, num_rows,
                   offs_v, HEAD_DIM_V: tl.constexpr):
    """Split ``split``'s normalised output [rows, Dv] and log2-sum-exp [rows]; rows with no key here get
    lse = -inf and o = 0, so the merge gives them weight 0."""
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))  # [BLOCK_M]
    ok = row_ok & active
    base = split.to(tl.int64) * num_rows + part_rows  # [BLOCK_M]
    o_ptrs = part_o_ptr + base[:, None] * HEAD_DIM_V + offs_v[None, :]
    tl.store(o_ptrs, acc / l_safe[:, None], mask=ok[:, None] & (offs_v[None, :] < HEAD_DIM_V))
    tl.store(part_lse_ptr + base, lse, mask=ok)


@triton.jit(do_not_specialize=["max_len", "num_splits"])  # both vary on the eager path: no recompiles
def attention_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, o_ptr, part_o_ptr, part_lse_ptr,
    num_queries, num_heads, max_len, num_splits, qk_scale,
    stride_q_t, stride_q_h, stride_k_s, stride_k_h, stride_v_s, stride_v_h, stride_o_t, stride_o_h,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_T: tl.constexpr, SPLIT_KV: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    tile = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if USE_PDL:  # q, the caches and the positions all come from earlier kernels
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M], row = t * GROUP + g
    t = rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_ok = t < num_queries
    row_pos = tl.load(pos_ptr + t, mask=row_ok, other=-1)  # [BLOCK_M]
    tile_len = tl.minimum(tl.max(row_pos, axis=0) + 1, max_len).to(tl.int32)  # keys this tile may see
    if SPLIT_KV:
        start, end, _ = _kv_blocks_of_split(pos_ptr, num_queries, max_len, split, num_splits, BLOCK_N, BLOCK_T)
    else:
        start = 0
        end = tl.cdiv(tile_len, BLOCK_N)
    loop_end = tl.minimum(end, tl.cdiv(tile_len, BLOCK_N))

    offs_d = tl.arange(0, BLOCK_D)
    offs_v = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < HEAD_DIM
    v_ok = offs_v < HEAD_DIM_V
    q_ptrs = q_ptr + t[:, None].to(tl.int64) * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0).to(k_ptr.dtype.element_ty)  # [M, D]

    m_i = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    k_base = k_ptr + kv_head * stride_k_h
    v_base = v_ptr + kv_head * stride_v_h
    for blk in range(start, loop_end):
        keys = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_ok = keys < tile_len
        k = tl.load(k_base + keys[:, None].to(tl.int64) * stride_k_s + offs_d[None, :],
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [N, D]
        v = tl.load(v_base + keys[:, None].to(tl.int64) * stride_v_s + offs_v[None, :],
                    mask=key_ok[:, None] & v_ok[None, :], other=0.0)  # [N, Dv]
        visible = (keys[None, :] <= row_pos[:, None]) & key_ok[None, :]
        m_i, l_i, acc = attend_tile(q, k, v, visible, m_i, l_i, acc, qk_scale, PRECISION, UPCAST)

    if SPLIT_KV:
        _store_partial(part_o_ptr, part_lse_ptr, acc, m_i, l_i, t * num_heads + head, row_ok, start < end, split,
                       num_queries * num_heads, offs_v, HEAD_DIM_V)
    else:
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        o = acc / l_safe[:, None]
        o_ptrs = o_ptr + t[:, None].to(tl.int64) * stride_o_t + head[:, None] * stride_o_h + offs_v[None, :]
        tl.store(o_ptrs, o.to(o_ptr.dtype.element_ty), mask=row_ok[:, None] & v_ok[None, :])


@triton.jit(do_not_specialize=["max_len", "num_splits"])
def attention_reduce_kernel(
    part_o_ptr, part_lse_ptr, pos_ptr, o_ptr, gate_ptr,
    num_queries, num_heads, max_len, num_splits, stride_o_t, stride_o_h, stride_g_t,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_SPLITS: tl.constexpr, HAS_GATE: tl.constexpr, USE_PDL: tl.constexpr,
):
    """o[t, h] = sum_s 2^(lse_s - lse_max) o_s / sum_s 2^(lse_s - lse_max) over the splits that hold keys
    (the same device-side split arithmetic as the main kernel: unwritten partials are never read). One
    program per (row, BLOCK_DV slice) loads all its splits at once: no dependent loads.

    HAS_GATE (MLA's head-wise output gate): the merged fp32 row is scaled by sigmoid(gate[t, h]) before its
    store (``gate_ptr`` [T, H], last dim contiguous, row stride ``stride_g_t``). Without it ``gate_ptr`` and
    ``stride_g_t`` are passed as None (constexprs), so GQA's compiled kernel is the one it always was."""
    row = tl.program_id(0)  # t * num_heads + h
    v_chunk = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    num_rows = num_queries * num_heads
    _, _, num_active = _kv_blocks_of_split(pos_ptr, num_queries, max_len, 0, num_splits, BLOCK_N, BLOCK_T)

    splits = tl.arange(0, BLOCK_SPLITS)
    ok = splits < num_active
    offs_v = v_chunk * BLOCK_DV + tl.arange(0, BLOCK_DV)
    v_ok = offs_v < HEAD_DIM_V
    lse = tl.load(part_lse_ptr + splits * num_rows + row, mask=ok, other=float("-inf"))  # [BLOCK_SPLITS]
    o_ptrs = part_o_ptr + (splits[:, None].to(tl.int64) * num_rows + row) * HEAD_DIM_V + offs_v[None, :]
    o_s = tl.load(o_ptrs, mask=ok[:, None] & v_ok[None, :], other=0.0)  # [BLOCK_SPLITS, BLOCK_DV]
    w = tl.exp2(lse - tl.max(lse, axis=0))  # lse_max is finite: split 0 holds key 0, visible to every query
    o = tl.sum(w[:, None] * o_s, axis=0) / tl.sum(w, axis=0)  # [BLOCK_DV]
    t = row // num_heads
    h = row % num_heads
    if HAS_GATE:
        o = o * tl.sigmoid(tl.load(gate_ptr + t.to(tl.int64) * stride_g_t + h).to(tl.float32))
    tl.store(o_ptr + t.to(tl.int64) * stride_o_t + h * stride_o_h + offs_v, o.to(o_ptr.dtype.element_ty), mask=v_ok)


def _workspace(num_splits: int, num_rows: int, head_dim_v: int, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-split partial outputs [num_splits, rows, Dv] and log2-sum-exps [num_splits, rows], fp32."""
    part_o = torch.empty(num_splits, num_rows, head_dim_v, dtype=torch.float32, device=device)
    part_lse = torch.empty(num_splits, num_rows, dtype=torch.float32, device=device)
    return part_o, part_lse


def dot_options(dtype: torch.dtype) -> dict:
    """tl.dot settings for operands of ``dtype``: exact fp32 (never tf32); 16-bit operands widened under the
    interpreter (see ``tile_dot``)."""
    return dict(PRECISION="ieee" if dtype == torch.float32 else "tf32",
                UPCAST=dtype != torch.float32 and triton_interpret())


def attention_reduce_fwd(part_o: torch.Tensor, part_lse: torch.Tensor, q_positions: torch.Tensor, out: torch.Tensor,
                         max_len: int, block_n: int, gate_logits: torch.Tensor | None = None) -> None:
    """Merges the split partials into ``out`` [T, H, Dv]; ``block_n`` must be the main kernel's. ``gate_logits``
    [T, H] (last dim contiguous; MLA only) scales each merged row by sigmoid(gate) in fp32 before the store."""
    num_splits, _, head_dim_v = part_o.shape
    num_queries, num_heads = out.shape[0], out.shape[1]
    block_splits = triton.next_power_of_2(num_splits)
    block_dv = max(16, min(triton.next_power_of_2(head_dim_v), 4096 // block_splits))  # <= 4096 partials a program
    pdl = pdl_enabled(out.device)
    grid = (num_queries * num_heads, triton.cdiv(head_dim_v, block_dv))
    has_gate = gate_logits is not None
    attention_reduce_kernel[grid](
        part_o, part_lse, q_positions, out, gate_logits,
        num_queries, num_heads, max_len, num_splits, out.stride(0), out.stride(1),
        gate_logits.stride(0) if has_gate else None,
        HEAD_DIM_V=head_dim_v, BLOCK_DV=block_dv, BLOCK_N=block_n, BLOCK_T=triton.next_power_of_2(num_queries),
        BLOCK_SPLITS=block_splits, HAS_GATE=has_gate, USE_PDL=pdl,
        num_warps=4, **({"launch_pdl": True} if pdl else {}),
    )


def attention_fwd(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_positions: torch.Tensor,
                  scale: float, out: torch.Tensor, num_splits: int, block_m: int, block_n: int, num_warps: int,
                  num_stages: int) -> None:
    """Launches ``attention_kernel`` (and the reduction when ``num_splits`` > 1) into ``out`` [T, H, Dv]."""
    num_queries, num_heads, head_dim = q.shape
    max_len, num_kv_heads, _ = k_cache.shape
    head_dim_v = v_cache.shape[-1]
    group = num_heads // num_kv_heads
    num_tiles = triton.cdiv(num_queries * group, block_m)
    block_dv = max(16, triton.next_power_of_2(head_dim_v))
    part_o, part_lse = (out, out) if num_splits == 1 else _workspace(
        num_splits, num_queries * num_heads, head_dim_v, q.device)
    pdl = pdl_enabled(q.device)
    attention_kernel[(num_tiles, num_kv_heads, num_splits)](
        q, k_cache, v_cache, q_positions, out, part_o, part_lse,
        num_queries, num_heads, max_len, num_splits, float(scale) * LOG2E,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), v_cache.stride(0), v_cache.stride(1),
        out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_DV=block_dv, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_T=triton.next_power_of_2(num_queries), SPLIT_KV=num_splits > 1, **dot_options(k_cache.dtype),
        USE_PDL=pdl, num_warps=num_warps, num_stages=num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    if num_splits > 1:
        attention_reduce_fwd(part_o, part_lse, q_positions, out, max_len, block_n)


def default_blocks(num_rows: int, head_dim: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): rows padded to a tl.dot-friendly tile (16..64), 64 keys a block (32 for wide heads)."""
    block_m = min(64, max(16, triton.next_power_of_2(num_rows)))
    block_n = 64 if head_dim <= 128 else 32
    return block_m, block_n


def default_num_stages(block_n: int, head_dim: int, head_dim_v: int, elem_bytes: int) -> int:
    """Pipelining depth: up to 4 stages of K and V tiles within ~160 KB of shared memory (H200, SmolLM2 at 32K:
    T=1 11.7 us with 4 stages vs 15.1 us with 2; T=16 14.6 vs 16.7 us)."""
    stage = block_n * (max(16, triton.next_power_of_2(head_dim)) + max(16, triton.next_power_of_2(head_dim_v)))
    return max(1, min(4, (160 << 10) // (stage * elem_bytes)))


def default_num_splits(num_queries: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int) -> int:
    """The split count ``attention`` uses: ``num_kv_splits`` over kv heads x row tiles."""
    num_rows = num_queries * (num_heads // num_kv_heads)
    block_m, _ = default_blocks(num_rows, head_dim)
    return num_kv_splits(max_len, num_kv_heads * triton.cdiv(num_rows, block_m))


def attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, q_positions: torch.Tensor,
              scale: float, *, out: torch.Tensor | None = None, num_splits: int | None = None,
              block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None) -> torch.Tensor:
    """q [T, H, D], k_cache [S, Hkv, D], v_cache [S, Hkv, Dv], q_positions [T] -> [T, H, Dv] in q's dtype.

    Causal over cache rows: query i attends to rows 0..q_positions[i]; rows past max(q_positions) are never
    read. ``num_splits`` / ``block_n`` override the shape-derived defaults (benchmarks, tests)."""
    num_queries, num_heads, head_dim = q.shape
    max_len, num_kv_heads, _ = k_cache.shape
    assert k_cache.shape[2] == head_dim and v_cache.shape[:2] == k_cache.shape[:2], "cache shapes"
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert q_positions.shape == (num_queries,), "one position per query"
    q = q if q.stride(-1) == 1 else q.contiguous()
    k_cache = k_cache if k_cache.stride(-1) == 1 else k_cache.contiguous()
    v_cache = v_cache if v_cache.stride(-1) == 1 else v_cache.contiguous()
    q_positions = q_positions.contiguous()
    if out is None:
        out = torch.empty(num_queries, num_heads, v_cache.shape[-1], dtype=q.dtype, device=q.device)  # [T, H, Dv]
    block_m, default_n = default_blocks(num_queries * (num_heads // num_kv_heads), head_dim)
    block_n = block_n or default_n
    num_stages = num_stages or default_num_stages(block_n, head_dim, v_cache.shape[-1], k_cache.element_size())
    if num_splits is None:
        num_splits = default_num_splits(num_queries, num_heads, num_kv_heads, head_dim, max_len)
    attention_fwd(q, k_cache, v_cache, q_positions, scale, out, num_splits, block_m, block_n, num_warps, num_stages)
    return out

