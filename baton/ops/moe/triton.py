"""Triton MoE for batch-1 decode and short verify chains (T = 1..32 tokens, top-k = 8 of 512 experts).

Everything is built on the GPU from ``topk_ids``: no ``.item()`` / ``.tolist()``, so every launcher here is safe
inside CUDA-graph capture.

Kernels:

* ``grouped_topk_kernel``: the Ling / DeepSeek-V3 "noaux_tc" router on logits ``[T, E]``: sigmoid, ``+ expert_bias``
  for selection only, group score = sum of the top-2 biased scores of each group, keep ``topk_group`` groups, top-k
  experts among them, weights from the unbiased sigmoid, renormalise, ``x scaling``. One program per token; the
  logits are loaded as ``[groups, experts_per_group]`` so every step is a register reduction. The router GEMV stays
  in cuBLAS (folding a 2.6 MB GEMV into a T-program kernel would collapse its parallelism).
  Tie-break: among equal (biased) scores the lowest group / expert index wins; ``torch.topk`` leaves ties unspecified,
  so exact ties may select differently from the reference. Output ids are in selection order (best first).
* Direct work list (``mode="direct"``): pair ``p = t * k + j`` is simply the flat index into ``topk_ids``.
  ``moe_up_direct_kernel``: program = (N-block of I, pair): a GEMV of ``w13[e]``'s gate and up rows against
  ``x[t]`` with SwiGLU (+ post-SiLU clamp) in the epilogue, writing ``act [T*k, I]`` fp32.
  ``moe_down_direct_kernel``: program = (N-block of d, token): one flattened loop over the token's k experts x
  K-blocks of I reading ``w2[e]`` tiles, the routing weight folded into the activation, the combine accumulated in
  fp32 in a fixed order (deterministic, no atomics), then ``+ shared_out + residual`` and one cast to x's dtype.
* Aligned work list (``mode="aligned"``): ``moe_align_kernel`` (one program, up to ``MAX_ALIGN_PAIRS`` = 256
  (token, expert) pairs: 32 tokens of top-8) compares every pair with the pairs of one chunk of ``ALIGN_CHUNK`` at a
  time, accumulating each pair's stable rank in its expert bucket, the bucket's population and the number of pairs
  of lower experts (packed in one int32, one reduction at the end): the pair's sorted position. It writes
  ``sorted_pairs`` (pairs grouped by expert, stable in pair index; ids -1 last, in no block) and (expert, rank,
  population) in sorted order to a scratch buffer; after a CTA barrier it reads that back as one vector, and every
  pair whose rank is a multiple of ``BLOCK_M`` leads a block, numbered by a running count (``tl.cumsum``): per block
  ``(expert, start, count)`` plus the block count. No torch sort, no host value; nothing scales with E.
  ``moe_up_aligned_kernel`` / ``moe_down_aligned_kernel``: program = (N-block, expert block): ``tl.dot`` over up
  to ``BLOCK_M`` rows so each expert's weights are read once however many tokens picked it; the down stage writes
  weighted per-pair rows ``y [T*k, d]`` fp32 and ``moe_combine_kernel`` sums each token's k rows in fixed order
  (+ shared + residual). For more than ``MAX_ALIGN_PAIRS`` pairs (prefill) the alignment is done with torch sort /
  scatter ops on the device instead (still no host sync).
* w8a8 (``act_fp8=True``, fp8 experts only): ``moe_up_w8a8_kernel`` / ``moe_down_w8a8_kernel`` run fp8 x fp8
  ``tl.dot`` (Hopper QGMMA) with no per-weight conversion. Swap-AB: the expert's weight tile is the MMA's wide
  side (``[2 * BLOCK_N, 128]``: BLOCK_N gate rows and the matching up rows in one tile; ``[BLOCK_N, 128]`` for w2)
  and the block's (up to 16) token rows the narrow side. The activations (x, then each pair's SwiGLU output) are
  quantised in the K loop per (row, 128-column group) to e4m3 with a power-of-two scale
  (``baton.ops.quant.triton.quant_e4m3_rows``, the bits of ``baton.ops.quant.fp8.quantize_act_e4m3``, as the dense
  w8a8 projections do); each group's product is scaled by weight block scale x row scale and summed
  in fp32. Work list: for T < ``ALIGNED_MIN_TOKENS`` one program column per pair (no alignment launch), else the
  alignment's blocks; then ``moe_combine_kernel``. Options measured slower on the H200 and off by default: an L2
  prefetch of the weight tiles before the PDL wait (``W8A8_PREFETCH``, ``W8A8_PREFETCH_UP_GROUPS``) and a split-K
  up-projection (``MoETile.split_k`` > 1: partial gate | up sums, SwiGLU in the down kernel). Tiles: kind
  ``fp8_w8a8``.
* ``mode="hybrid"``: aligned up-projection (w13 is 2/3 of each expert's bytes) + the direct per-token down-projection
  (no ``y`` buffer, no combine launch; w2 of a shared expert is read once per token that picked it).

On the H200 direct wins at T = 1; from T = 6 aligned wins clearly once routes overlap between tokens and stays
within 5-10% of the best with independent routes (the figures are in docs/performance.md), so ``default_mode``
picks direct for T < 3 and aligned from T = 3. The tiles come from the current GPU's table (table.py).

Fused shared expert (``shared_id``; ``baton.layers.moe`` stacks the shared expert as the last expert where it has a
routed expert's shape and format): ``grouped_topk_kernel`` writes k + 1 columns, the last ``(shared_id, 1.0)`` on
every row, in the same launch, and the experts kernels treat it as any pair (weight 1; the combine sums it in fp32,
then the residual, one cast). The one difference is the SwiGLU clamp: every up-projection takes the clamp of its
program's expert (``_pair_limit``: ``shared_limit`` for ``shared_id``, else ``limit``; an off clamp is +inf there),
compiled in only with ``PAIR_LIMIT`` (the two clamps differ), so the unfused kernels are today's. The decode step
saves the separate shared MLP's two GEMM launches per MoE layer. Pair counts grow by T (the thresholds below are in
pairs: 32 tokens of top-8 plus the shared pair are 288 > ``MAX_ALIGN_PAIRS``, so T > 28 aligns with torch ops).

PDL (``use_pdl()``, compute capability >= 9, never in the interpreter): every kernel calls ``gdc_wait`` before its
first load of data written by an earlier kernel and ``gdc_launch_dependents`` right after that wait. Because each
producer triggers only after its own wait, data written two launches back (the router's ``topk_ids`` /
``topk_weights``, the alignment metadata) is complete when a consumer starts, so the down kernels read it before
their wait and only the activations are behind it.

fp8 experts (e4m3 weights, 128 x 128 block ``scale_inv``, the Ling fp8 checkpoint layout): up to
``FP8_DIRECT_MAX_PAIRS`` (token, expert) pairs the direct kernels take one scalar scale per 128-column chunk and fold
it into the activations; past that (prefill) the aligned kernels widen each weight tile to the activations' dtype
and scale the tile's product (BLOCK_N and BLOCK_K divide 128, so a tile lies in one scale block). Neither path makes
a dequantised copy of the experts.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from baton import env
from baton.ops.moe import table
from baton.ops.moe.table import MoEConfig, MoETile
from baton.ops.quant.triton import f16_rows, quant_e4m3_rows

# Up to this many (token, expert) pairs (T * k: 32 tokens of top-8) the alignment is one program
# (``moe_align_kernel``); more (prefill) are aligned with torch sort / scatter ops on the device.
MAX_ALIGN_PAIRS = 256
ALIGN_CHUNK = 32  # the pairs q that moe_align_kernel compares with every pair p at a time
# Default mode: direct below this many tokens, aligned from it on.
ALIGNED_MIN_TOKENS = 3

_POISON_INT = 1 << 30


def _empty(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Allocation hook for every output / intermediate buffer (tests monkeypatch it to poison the memory)."""
    return torch.empty(shape, dtype=dtype, device=device)


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("0", "", "false", "False")


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device) -> bool:
    """PDL on this device: ``BATON_PDL``, CUDA with compute capability >= 9, not the interpreter."""
    if device.type != "cuda" or _interpreting() or not env.use_pdl():
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device())[0] >= 9


def _launch_kw(pdl: bool, num_warps: int, num_stages: int | None = None) -> dict:
    kw: dict = {"USE_PDL": pdl, "num_warps": num_warps}
    if num_stages is not None:
        kw["num_stages"] = num_stages
    if pdl:
        kw["launch_pdl"] = True
    return kw


# --------------------------------------------------------------------------------------------------------------------
# Config table
# --------------------------------------------------------------------------------------------------------------------


# The tiles: MoETile / MoEConfig and the per-GPU tables live in table.py (tuned/<gpu name>.json, FALLBACK without
# one). fp8 experts (direct path): BLOCK_N must divide the 128-row scale blocks (a program's rows share one scale
# row) and BLOCK_K must divide the 128-column blocks or be a multiple of them (a chunk of min(BLOCK_K, 128) columns
# shares one scale, a scalar that multiplies the activation chunk); fp8 rows are half the bytes, so the same bytes
# per program take twice the rows. The table is keyed by T alone, so an fp8 entry has to be good at one GPU's expert
# width (I = 768) and at one TP2 rank's (I = 384) both.
FP8_BLOCK = 128
# fp8 past the decode shapes (prefill: more than FP8_DIRECT_MAX_PAIRS (token, expert) pairs) runs the aligned
# kernels (kind "fp8_aligned"), the weights widened to the activations' dtype in registers and each tile's product
# scaled once (BLOCK_N and BLOCK_K divide the 128 x 128 scale blocks).
FP8_DIRECT_MAX_PAIRS = 128
# fp8 experts on the fp16 MMA (mode "f16", the w8a8 kernels on fp16 rows) are the default up to this many pairs
# where this GPU's table prefers them (kind fp8_f16): the largest measured, a 132-token prefill (a cached follow-up
# turn's shape), 1.46x faster than the aligned fp8 kernels on an H100 (benchmarks/results/h100-2026-12-07-f16).
# Longer prefills keep the aligned kernels (their 64-row blocks read each expert a quarter as often).
FP8_F16_MAX_PAIRS = 132 * 8


def get_config(num_tokens: int, mode: str) -> MoEConfig:
    """The tiles for ``num_tokens`` in ``mode``: "direct", "fp8" (direct over fp8 experts), "fp8_aligned", or
    "aligned" (any other mode: hybrid's up-projection is aligned), from the current GPU's table."""
    return table.get_config(num_tokens, mode if mode in table.KINDS else "aligned")


def default_mode(num_tokens: int) -> str:
    return "direct" if num_tokens < ALIGNED_MIN_TOKENS else "aligned"


# --------------------------------------------------------------------------------------------------------------------
# Router
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def grouped_topk_kernel(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr,  # [T, E], [E], [T, TOPK + NUM_SHARED] int32 / fp32
    active_ptr,  # HAS_ACTIVE: one int, the number of leading rows that route (the rest get id -1, weight 0)
    stride_lt, scaling,
    N_GROUP: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_EG: tl.constexpr,
    TOPK_GROUP: tl.constexpr, TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr,
    HAS_BIAS: tl.constexpr, RENORM: tl.constexpr, HAS_ACTIVE: tl.constexpr, USE_PDL: tl.constexpr,
    shared_id=-1, NUM_SHARED: tl.constexpr = 0,  # 1: column TOPK of every row is (shared_id, 1.0), active or not
):
    t = tl.program_id(0)
    g = tl.arange(0, BLOCK_G)
    j = tl.arange(0, BLOCK_EG)
    valid = (g[:, None] < N_GROUP) & (j[None, :] < GROUP_SIZE)
    flat = g[:, None] * GROUP_SIZE + j[None, :]  # [BLOCK_G, BLOCK_EG] expert index
    if HAS_BIAS:  # a weight: may be read before the producer finishes
        bias = tl.load(bias_ptr + flat, mask=valid, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    logit = tl.load(logits_ptr + t * stride_lt + flat, mask=valid, other=0.0).to(tl.float32)
    score = 1.0 / (1.0 + tl.exp(-logit))
    choice = score
    if HAS_BIAS:
        choice = score + bias
    neg_inf = float("-inf")
    choice = tl.where(valid, choice, neg_inf)
    if N_GROUP > 1:
        m1 = tl.max(choice, axis=1)  # [BLOCK_G]
        if GROUP_SIZE > 1:
            first = tl.min(tl.where(choice == m1[:, None], j[None, :], BLOCK_EG), axis=1)
            m2 = tl.max(tl.where(j[None, :] == first[:, None], neg_inf, choice), axis=1)
            gscore = m1 + m2
        else:
            gscore = m1
        gscore = tl.where(g < N_GROUP, gscore, neg_inf)
        keep = g < 0
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(gscore, axis=0)
            pick = tl.min(tl.where(gscore == best, g, BLOCK_G), axis=0)  # lowest group index among ties
            keep = keep | (g == pick)
            gscore = tl.where(g == pick, neg_inf, gscore)
        choice = tl.where(keep[:, None], choice, neg_inf)
    kk = tl.arange(0, BLOCK_TOPK)
    out_ids = tl.zeros([BLOCK_TOPK], dtype=tl.int32)
    out_w = tl.zeros([BLOCK_TOPK], dtype=tl.float32)
    big = N_GROUP * GROUP_SIZE
    for i in tl.static_range(TOPK):
        best = tl.max(tl.max(choice, axis=1), axis=0)
        sel = tl.min(tl.min(tl.where(choice == best, flat, big), axis=1), axis=0)  # lowest expert index among ties
        w = tl.sum(tl.sum(tl.where(flat == sel, score, 0.0), axis=1), axis=0)
        out_ids = tl.where(kk == i, sel, out_ids)
        out_w = tl.where(kk == i, w, out_w)
        choice = tl.where(flat == sel, neg_inf, choice)
    if RENORM:
        out_w = out_w / (tl.sum(out_w, axis=0) + 1e-20)
    out_w = out_w * scaling
    if HAS_ACTIVE:  # a device value written by an earlier kernel: read after the wait
        routed = t < tl.load(active_ptr)
        out_ids = tl.where(routed, out_ids, -1)
        out_w = tl.where(routed, out_w, 0.0)
    if NUM_SHARED > 0:  # the fused shared expert: one more pair per row, weight 1 (not scaled), on every row
        out_ids = tl.where(kk == TOPK, shared_id, out_ids)
        out_w = tl.where(kk == TOPK, 1.0, out_w)
    WIDTH: tl.constexpr = TOPK + NUM_SHARED
    mk = kk < WIDTH
    tl.store(ids_ptr + t * WIDTH + kk, out_ids, mask=mk)
    tl.store(weights_ptr + t * WIDTH + kk, out_w, mask=mk)


def grouped_topk_fwd(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, n_group: int,
                     topk_group: int, renormalize: bool, scaling_factor: float,
                     active_rows: torch.Tensor | None = None, shared_id: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (pre-sigmoid, any float dtype). Returns (topk_ids [T, k] int32, topk_weights [T, k] fp32).
    ``active_rows`` (one int on the device): rows from it on get id -1 and weight 0 (no expert). ``shared_id``
    (a fused shared expert, ``baton.layers.moe.Experts``): k + 1 columns, the last ``(shared_id, 1.0)`` on every
    row, active or not, written by the same kernel (no extra launch)."""
    num_tokens, num_experts = logits.shape
    n_group = max(n_group, 1)
    assert num_experts % n_group == 0 and 1 <= topk_group <= n_group and 1 <= top_k <= num_experts
    logits = logits.contiguous()
    group_size = num_experts // n_group
    num_shared = 0 if shared_id is None else 1
    ids = _empty((num_tokens, top_k + num_shared), torch.int32, logits.device)
    weights = _empty((num_tokens, top_k + num_shared), torch.float32, logits.device)
    if num_tokens == 0:
        return ids, weights
    bias = expert_bias.contiguous() if expert_bias is not None else logits
    active = active_rows if active_rows is not None else ids
    block_g, block_eg = triton.next_power_of_2(n_group), triton.next_power_of_2(group_size)
    shared = {} if shared_id is None else dict(shared_id=int(shared_id), NUM_SHARED=1)
    grouped_topk_kernel[(num_tokens,)](
        logits, bias, ids, weights, active, logits.stride(0), float(scaling_factor),
        N_GROUP=n_group, GROUP_SIZE=group_size, BLOCK_G=block_g, BLOCK_EG=block_eg,
        TOPK_GROUP=topk_group if n_group > 1 else 1, TOPK=top_k,
        BLOCK_TOPK=triton.next_power_of_2(top_k + num_shared),
        HAS_BIAS=expert_bias is not None, RENORM=bool(renormalize) and top_k > 1, HAS_ACTIVE=active_rows is not None,
        **shared, **_launch_kw(pdl_enabled(logits.device), 4 if num_experts <= 1024 else 8),
    )
    return ids, weights


def grouped_topk_fused(logits: torch.Tensor, expert_bias: torch.Tensor | None, top_k: int, n_group: int,
                       topk_group: int, renormalize: bool, scaling_factor: float,
                       active_rows: torch.Tensor | None = None, shared_id: int | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid + group-limited top-k on router logits; the selection of ``naive.grouped_topk(sigmoid(logits))``
    (rows from ``active_rows`` on: id -1, weight 0; ``shared_id``: the appended shared-expert column)."""
    return grouped_topk_fwd(logits, expert_bias, top_k, n_group, topk_group, renormalize, scaling_factor,
                            active_rows, shared_id)


# --------------------------------------------------------------------------------------------------------------------
# Direct (per-pair / per-token) experts
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _swiglu(g, u, limit, HAS_LIMIT: tl.constexpr):
    a = g / (1.0 + tl.exp(-g))
    if HAS_LIMIT:
        a = tl.minimum(a, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    return a * u


@triton.jit
def _pair_limit(e, limit, shared_limit, shared_id, PAIR_LIMIT: tl.constexpr):
    """The SwiGLU clamp of expert ``e``'s pairs: ``limit``, or with PAIR_LIMIT (a fused shared expert whose clamp
    differs from the routed experts') ``shared_limit`` for the shared expert ``shared_id``. Without PAIR_LIMIT the
    kernel is today's (no compare, no select)."""
    if PAIR_LIMIT:
        limit = tl.where(e == shared_id, shared_limit, limit)
    return limit


def _limit_args(swiglu_limit: float, shared_limit: float = 0.0, shared_id: int | None = None) -> dict:
    """The SwiGLU-clamp arguments of an up-projection kernel (``limit``, ``HAS_LIMIT``; with a fused shared expert
    whose clamp differs, ``shared_limit``, ``shared_id`` and ``PAIR_LIMIT``). A clamp of 0 is off; when only one of
    the two is on, the other is +inf in the kernel (min / max with inf is exact)."""
    if shared_id is None or float(shared_limit) == float(swiglu_limit):
        return dict(limit=float(swiglu_limit), HAS_LIMIT=swiglu_limit > 0)
    on = lambda v: float(v) if v > 0 else float("inf")  # noqa: E731
    return dict(limit=on(swiglu_limit), HAS_LIMIT=True, shared_limit=on(shared_limit), shared_id=int(shared_id),
                PAIR_LIMIT=True)


@triton.jit
def _store_token_row(y, shared_ptr, res_ptr, out_ptr, tok, offs_n, mask_n, stride_st, stride_rt, stride_ot,
                     HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr):
    """A token's routed sum y [BLOCK_N] fp32 ``+ shared_out + residual`` (in fp32, that order), stored once in the
    output's dtype: the epilogue of every kernel that finishes a token's row."""
    if HAS_SHARED:
        y += tl.load(shared_ptr + tok * stride_st + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    if HAS_RES:
        y += tl.load(res_ptr + tok * stride_rt + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + tok * stride_ot + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def moe_up_direct_kernel(
    x_ptr, w13_ptr, ids_ptr, act_ptr,  # x [T, HIDDEN], w13 [E, 2I, HIDDEN], ids [T*TOPK], act [T*TOPK, INTER] fp32
    HIDDEN: tl.constexpr, INTER: tl.constexpr, stride_xt, stride_we, stride_wn, stride_at, limit,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr,
    HAS_LIMIT: tl.constexpr, USE_PDL: tl.constexpr,
    s_ptr=None, stride_se=0, stride_sn=0,  # fp8: scale_inv [E, 2*ceil(I/SB), ceil(HIDDEN/SB)]: gate blocks, up blocks
    HAS_SCALE: tl.constexpr = False, SB: tl.constexpr = 128,
    shared_limit=0.0, shared_id=-1, PAIR_LIMIT: tl.constexpr = False,  # _pair_limit
):
    pid_n = tl.program_id(0)
    pair = tl.program_id(1)
    tok = pair // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    # fp8: a chunk of SUB columns shares one scale (SUB divides SB), so the scale is one scalar per chunk and
    # multiplies the activations; a BLOCK_K past SB is taken as BLOCK_K // SB chunks of SB (unrolled)
    SUB: tl.constexpr = SB if HAS_SCALE and BLOCK_K > SB else BLOCK_K
    offs_k = tl.arange(0, SUB)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.load(ids_ptr + pair).to(tl.int64)
    if e < 0:  # no expert (a row past the active prefix): no weight read; its act row is never read either
        return
    wg_ptrs = w13_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, SUB]
    wu_ptrs = wg_ptrs + INTER * stride_wn
    x_ptrs = x_ptr + tok * stride_xt + offs_k
    if HAS_SCALE:  # BLOCK_N divides SB: the program's rows share one scale row (gate and up quantised apart)
        up_row0: tl.constexpr = (INTER + SB - 1) // SB
        nb = (pid_n * BLOCK_N) // SB
        sg_ptr = s_ptr + e * stride_se + nb * stride_sn
        su_ptr = s_ptr + e * stride_se + (up_row0 + nb) * stride_sn
    acc_g = tl.zeros([BLOCK_N, SUB], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N, SUB], dtype=tl.float32)
    for k0 in tl.range(0, HIDDEN, BLOCK_K, num_stages=NUM_STAGES):  # explicit: GEMV loads are not dot operands
        for sub in tl.static_range(BLOCK_K // SUB):
            kk = k0 + sub * SUB
            mk = (kk + offs_k) < HIDDEN
            xk = tl.load(x_ptrs + kk, mask=mk, other=0.0).to(tl.float32)
            m = mask_n[:, None] & mk[None, :]
            wg = tl.load(wg_ptrs + kk, mask=m, other=0.0).to(tl.float32)
            wu = tl.load(wu_ptrs + kk, mask=m, other=0.0).to(tl.float32)
            if HAS_SCALE:  # one scalar per chunk and projection, on the activations ([SUB]), not the weights
                ok = kk < HIDDEN
                acc_g += wg * (xk * tl.load(sg_ptr + kk // SB, mask=ok, other=0.0))[None, :]
                acc_u += wu * (xk * tl.load(su_ptr + kk // SB, mask=ok, other=0.0))[None, :]
            else:
                acc_g += wg * xk[None, :]
                acc_u += wu * xk[None, :]
    lim = _pair_limit(e, limit, shared_limit, shared_id, PAIR_LIMIT)
    act = _swiglu(tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1), lim, HAS_LIMIT)
    tl.store(act_ptr + pair * stride_at + offs_n, act, mask=mask_n)


@triton.jit
def moe_down_direct_kernel(
    act_ptr, w2_ptr, ids_ptr, tw_ptr, shared_ptr, res_ptr, out_ptr,  # act [T*TOPK, INTER], w2 [E, HIDDEN, INTER]
    HIDDEN: tl.constexpr, INTER: tl.constexpr, stride_at, stride_we, stride_wn, stride_st, stride_rt, stride_ot,
    TOPK: tl.constexpr, BLOCK_TOPK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr, USE_PDL: tl.constexpr,
    s_ptr=None, stride_se=0, stride_sn=0,  # fp8: scale_inv [E, ceil(HIDDEN/SB), ceil(INTER/SB)]
    HAS_SCALE: tl.constexpr = False, SB: tl.constexpr = 128,
):
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    SUB: tl.constexpr = SB if HAS_SCALE and BLOCK_K > SB else BLOCK_K  # as in the up kernel
    offs_k = tl.arange(0, SUB)
    jj = tl.arange(0, BLOCK_TOPK)
    mj = jj < TOPK
    # Router outputs: written two launches back, complete once the up kernel (which triggers after its own wait)
    # let this grid start; only the activations are behind the wait.
    ids = tl.load(ids_ptr + tok * TOPK + jj, mask=mj, other=0).to(tl.int64)
    tw = tl.load(tw_ptr + tok * TOPK + jj, mask=mj, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    w_rows = offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, SUB]
    num_k: tl.constexpr = (INTER + BLOCK_K - 1) // BLOCK_K
    if HAS_SCALE:  # BLOCK_N divides SB: the program's rows share one scale row
        s_row = s_ptr + ((pid_n * BLOCK_N) // SB) * stride_sn
    acc = tl.zeros([BLOCK_N, SUB], dtype=tl.float32)
    for it in tl.range(0, TOPK * num_k, num_stages=NUM_STAGES):  # experts x K-blocks: the pipeline spans experts
        j = it // num_k
        k0 = (it - j * num_k) * BLOCK_K
        e = tl.sum(tl.where(jj == j, ids, 0), axis=0)
        rw = tl.sum(tl.where(jj == j, tw, 0.0), axis=0)
        routed = e >= 0  # id -1: no expert, every load of it masked off (no weight read, adds zero)
        for sub in tl.static_range(BLOCK_K // SUB):
            kk = k0 + sub * SUB
            mk = ((kk + offs_k) < INTER) & routed
            a = tl.load(act_ptr + (tok * TOPK + j) * stride_at + kk + offs_k, mask=mk, other=0.0).to(tl.float32)
            w = tl.load(w2_ptr + e * stride_we + w_rows + kk, mask=mask_n[:, None] & mk[None, :], other=0.0)
            w = w.to(tl.float32)
            if HAS_SCALE:  # one scalar per chunk, on the activations
                rw_s = rw * tl.load(s_row + e * stride_se + kk // SB, mask=(kk < INTER) & routed, other=0.0)
                acc += w * (a * rw_s)[None, :]
            else:
                acc += w * (a * rw)[None, :]
    y = tl.sum(acc, axis=1)
    _store_token_row(y, shared_ptr, res_ptr, out_ptr, tok, offs_n, mask_n, stride_st, stride_rt, stride_ot,
                     HAS_SHARED, HAS_RES)


def _scale_args(scale: torch.Tensor | None, tile: MoETile) -> dict:
    if scale is None:
        return {}
    assert FP8_BLOCK % tile.block_n == 0, "fp8 tiles: BLOCK_N must divide the 128-row scale blocks"
    assert FP8_BLOCK % tile.block_k == 0 or tile.block_k % FP8_BLOCK == 0, \
        "fp8 tiles: BLOCK_K must divide the 128-column scale blocks or be a multiple of them"
    return dict(s_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1), HAS_SCALE=True, SB=FP8_BLOCK)


def moe_up_direct_fwd(x: torch.Tensor, w13: torch.Tensor, flat_ids: torch.Tensor, top_k: int, swiglu_limit: float,
                      tile: MoETile, pdl: bool, w13_scale: torch.Tensor | None = None, shared_limit: float = 0.0,
                      shared_id: int | None = None) -> torch.Tensor:
    """x [T, d], w13 [E, 2I, d] (bf16, or fp8 with ``w13_scale`` block scales) , flat_ids [T*k] -> act [T*k, I]
    (the pairs of expert ``shared_id`` clamped at ``shared_limit``: ``_limit_args``)."""
    num_pairs, inter, hidden = flat_ids.numel(), w13.shape[1] // 2, w13.shape[2]
    act = _empty((num_pairs, inter), torch.float32, x.device)
    grid = (triton.cdiv(inter, tile.block_n), num_pairs)
    moe_up_direct_kernel[grid](
        x, w13, flat_ids, act, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOPK=top_k, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, NUM_STAGES=tile.num_stages,
        **_limit_args(swiglu_limit, shared_limit, shared_id), **_scale_args(w13_scale, tile),
        **_launch_kw(pdl, tile.num_warps, tile.num_stages),
    )
    return act


def moe_down_direct_fwd(act: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                        shared_out: torch.Tensor | None, residual: torch.Tensor | None, out: torch.Tensor,
                        tile: MoETile, pdl: bool, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """act [T*k, I], w2 [E, d, I], topk_ids / topk_weights [T, k] -> out [T, d] = sum_k w act @ w2[e].T (+ ...)."""
    num_tokens, top_k = topk_ids.shape
    hidden, inter = w2.shape[1], w2.shape[2]
    shared = shared_out if shared_out is not None else out
    res = residual if residual is not None else out
    grid = (triton.cdiv(hidden, tile.block_n), num_tokens)
    moe_down_direct_kernel[grid](
        act, w2, topk_ids, topk_weights, shared, res, out, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
        shared.stride(0), res.stride(0), out.stride(0),
        TOPK=top_k, BLOCK_TOPK=triton.next_power_of_2(top_k), BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        NUM_STAGES=tile.num_stages, HAS_SHARED=shared_out is not None, HAS_RES=residual is not None,
        **_scale_args(w2_scale, tile), **_launch_kw(pdl, tile.num_warps, tile.num_stages),
    )
    return out


# --------------------------------------------------------------------------------------------------------------------
# Pair-axis alignment
# --------------------------------------------------------------------------------------------------------------------


@dataclass
class AlignedPairs:
    """(token, expert) pairs grouped by expert. ``sorted_pairs [M]`` int32 (flat pair indices, stable within an
    expert; the pairs with no expert, id -1, last, in pair order and in no block); per block ``b < num_blocks``:
    ``block_expert``, ``block_start`` (into sorted_pairs), ``block_count`` (1..BLOCK_M), all ``[max_blocks]`` int32
    and valid only below ``num_blocks [1]`` (the tail is never written)."""

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_start: torch.Tensor
    block_count: torch.Tensor
    num_blocks: torch.Tensor
    max_blocks: int
    block_m: int


def max_aligned_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound on sum_e ceil(n_e / BLOCK_M): at most M // BLOCK_M full blocks plus one partial per distinct
    expert, and never more than M."""
    return max(1, min(num_pairs, num_pairs // block_m + min(num_pairs, num_experts)))


@triton.jit
def moe_align_kernel(
    ids_ptr, scratch_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr, num_blocks_ptr,
    M, BLOCK_M: tl.constexpr, NP: tl.constexpr, QB: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program. Pass 1 compares every pair p with the pairs q of one chunk of QB at a time ([NP, QB] in
    registers, NP / QB chunks), summing p's stable rank in its bucket, the bucket population and the pairs of lower
    experts: p's sorted position. Each pair writes its (expert, rank, population) at that position into scratch.
    Pass 2 (after a CTA barrier) reads the sorted scratch back as one vector: a block leader is a pair whose rank
    is a multiple of BLOCK_M, its block index the running count of leaders (one tl.cumsum)."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    BIG: tl.constexpr = 1 << 30
    p = tl.arange(0, NP)
    real = p < M
    eid = tl.load(ids_ptr + p, mask=real, other=BIG).to(tl.int32)  # padding sorts last, matches nothing real
    eid = tl.where(eid < 0, BIG, eid)  # so does a pair with no expert (id -1): it is in no block
    # (rank, population, lower) packed in 10-bit fields of one int32 (each <= NP <= 512 < 1024), accumulated
    # elementwise over the chunks and reduced once at the end
    acc = tl.zeros([NP, QB], dtype=tl.int32)
    for q0 in tl.static_range(0, NP, QB):
        q = q0 + tl.arange(0, QB)
        eq = tl.load(ids_ptr + q, mask=q < M, other=BIG).to(tl.int32)
        eq = tl.where(eq < 0, BIG, eq)
        same = eid[:, None] == eq[None, :]  # [NP (p), QB (q)]
        before = same & (q[None, :] < p[:, None])
        lower = eq[None, :] < eid[:, None]
        acc += before.to(tl.int32) + (same.to(tl.int32) << 10) + (lower.to(tl.int32) << 20)
    packed = tl.sum(acc, axis=1)
    rank = packed & 1023
    count = (packed >> 10) & 1023
    n_lower = (packed >> 20) & 1023
    pos = n_lower + rank  # stable sorted position (the pairs with no expert last, in pair order)
    tl.store(sorted_pairs_ptr + pos, p, mask=real)
    tl.store(scratch_ptr + pos, eid, mask=real)
    tl.store(scratch_ptr + NP + pos, rank, mask=real)
    tl.store(scratch_ptr + 2 * NP + pos, count, mask=real)
    tl.debug_barrier()  # the scratch writes of every thread are visible to the whole CTA after it
    i = tl.arange(0, NP)
    ri = i < M
    se = tl.load(scratch_ptr + i, mask=ri, other=BIG, volatile=True)
    sr = tl.load(scratch_ptr + NP + i, mask=ri, other=0, volatile=True)
    sc = tl.load(scratch_ptr + 2 * NP + i, mask=ri, other=0, volatile=True)
    leader = ri & (se < BIG) & (sr % BLOCK_M == 0)
    lead = leader.to(tl.int32)
    bidx = tl.cumsum(lead, axis=0) - 1
    tl.store(block_expert_ptr + bidx, se, mask=leader)
    tl.store(block_start_ptr + bidx, i, mask=leader)
    tl.store(block_count_ptr + bidx, tl.minimum(sc - sr, BLOCK_M), mask=leader)
    tl.store(num_blocks_ptr, tl.sum(lead, axis=0))


def _align_buffers(num_pairs: int, max_blocks: int, device: torch.device) -> tuple[torch.Tensor, ...]:
    return (_empty((num_pairs,), torch.int32, device), _empty((max_blocks,), torch.int32, device),
            _empty((max_blocks,), torch.int32, device), _empty((max_blocks,), torch.int32, device),
            _empty((1,), torch.int32, device))


def moe_align_fwd(flat_ids: torch.Tensor, num_experts: int, block_m: int, pdl: bool) -> AlignedPairs:
    """One-program pair-axis alignment for M <= MAX_ALIGN_PAIRS pairs (``moe_align_kernel``: O(M^2) comparisons
    in chunks of ALIGN_CHUNK pairs, one scan); no host value, no torch sort: capture-safe."""
    num_pairs = flat_ids.numel()
    assert num_pairs <= MAX_ALIGN_PAIRS <= 512, f"the one-program alignment takes at most {MAX_ALIGN_PAIRS} pairs"
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    bufs = _align_buffers(num_pairs, max_blocks, flat_ids.device)
    np2 = max(16, triton.next_power_of_2(num_pairs))
    scratch = _empty((3 * np2,), torch.int32, flat_ids.device)
    moe_align_kernel[(1,)](flat_ids, scratch, *bufs, num_pairs, BLOCK_M=block_m, NP=np2, QB=min(np2, ALIGN_CHUNK),
                           **_launch_kw(pdl, 4 if np2 <= 64 else 8))
    return AlignedPairs(*bufs, max_blocks=max_blocks, block_m=block_m)


def moe_align_torch(flat_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedPairs:
    """The same alignment with device-side torch ops (sort, scatter, cumsum): any M, no host sync."""
    num_pairs, device = flat_ids.numel(), flat_ids.device
    max_blocks = max_aligned_blocks(num_pairs, num_experts, block_m)
    sorted_pairs, block_expert, block_start, block_count, num_blocks = _align_buffers(num_pairs, max_blocks, device)
    key = flat_ids.long()
    key = torch.where(key < 0, num_experts, key)  # id -1 (no expert): bucket E, sorted last, given no block
    sorted_e, order = torch.sort(key, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=device)
    counts.scatter_add_(0, sorted_e, torch.ones_like(sorted_e))
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(num_pairs, device=device)
    rank = pos - starts[sorted_e]
    nblk = (counts + block_m - 1) // block_m
    nblk[num_experts:].zero_()  # (a device op: capturable)
    blk_off = torch.cumsum(nblk, 0) - nblk
    leader = (rank % block_m == 0) & (sorted_e < num_experts)
    dst = torch.where(leader, blk_off[sorted_e] + rank // block_m, max_blocks)  # non-leaders go to a dump slot
    scratch = torch.empty(3, max_blocks + 1, dtype=torch.int32, device=device)
    scratch[0].scatter_(0, dst, sorted_e.int())
    scratch[1].scatter_(0, dst, pos.int())
    scratch[2].scatter_(0, dst, torch.clamp(counts[sorted_e] - rank, max=block_m).int())
    block_expert.copy_(scratch[0, :max_blocks])
    block_start.copy_(scratch[1, :max_blocks])
    block_count.copy_(scratch[2, :max_blocks])
    sorted_pairs.copy_(order)
    num_blocks.copy_(nblk.sum().reshape(1))
    return AlignedPairs(sorted_pairs, block_expert, block_start, block_count, num_blocks, max_blocks, block_m)


# --------------------------------------------------------------------------------------------------------------------
# Aligned (expert-grouped) experts
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def moe_up_aligned_kernel(
    x_ptr, w13_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr, num_blocks_ptr, act_ptr,
    HIDDEN: tl.constexpr, INTER: tl.constexpr, stride_xt, stride_we, stride_wn, stride_at, limit,
    TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, HAS_LIMIT: tl.constexpr, USE_PDL: tl.constexpr,
    s_ptr=None, stride_se=0, stride_sn=0,  # fp8: scale_inv [E, 2*ceil(I/SB), ceil(HIDDEN/SB)]: gate blocks, up blocks
    HAS_SCALE: tl.constexpr = False, SB: tl.constexpr = 128,
    shared_limit=0.0, shared_id=-1, PAIR_LIMIT: tl.constexpr = False,  # _pair_limit
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    start = tl.load(block_start_ptr + b)
    count = tl.load(block_count_ptr + b)
    rows = tl.arange(0, BLOCK_M)
    mr = rows < count
    pair = tl.load(sorted_pairs_ptr + start + rows, mask=mr, other=0)
    tok = pair // TOPK
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    wg_ptrs = w13_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    wu_ptrs = wg_ptrs + INTER * stride_wn
    if HAS_SCALE:  # BLOCK_N and BLOCK_K divide SB: each [BLOCK_K, BLOCK_N] tile lies in one scale block
        up_row0: tl.constexpr = (INTER + SB - 1) // SB
        nb = (pid_n * BLOCK_N) // SB
        sg_ptr = s_ptr + e * stride_se + nb * stride_sn
        su_ptr = s_ptr + e * stride_se + (up_row0 + nb) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, HIDDEN, BLOCK_K):
        mk = (k0 + offs_k) < HIDDEN
        wg = tl.load(wg_ptrs + k0, mask=mk[:, None] & mask_n[None, :], other=0.0)
        wu = tl.load(wu_ptrs + k0, mask=mk[:, None] & mask_n[None, :], other=0.0)
        if HAS_SCALE:  # fp8 weights widen exactly to the activations' dtype; the tile's scale scales its product
            a = tl.load(x_ptrs + k0, mask=mr[:, None] & mk[None, :], other=0.0)
            wg, wu = wg.to(a.dtype), wu.to(a.dtype)
        else:
            a = tl.load(x_ptrs + k0, mask=mr[:, None] & mk[None, :], other=0.0).to(wg.dtype)
        if UPCAST_DOT:
            a, wg, wu = a.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        if HAS_SCALE:
            acc_g += tl.dot(a, wg, input_precision=DOT_PRECISION) * tl.load(sg_ptr + k0 // SB)
            acc_u += tl.dot(a, wu, input_precision=DOT_PRECISION) * tl.load(su_ptr + k0 // SB)
        else:
            acc_g = tl.dot(a, wg, acc_g, input_precision=DOT_PRECISION)
            acc_u = tl.dot(a, wu, acc_u, input_precision=DOT_PRECISION)
    act = _swiglu(acc_g, acc_u, _pair_limit(e, limit, shared_limit, shared_id, PAIR_LIMIT), HAS_LIMIT)
    tl.store(act_ptr + pair[:, None] * stride_at + offs_n[None, :], act, mask=mr[:, None] & mask_n[None, :])


@triton.jit
def moe_down_aligned_kernel(
    act_ptr, w2_ptr, tw_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr, num_blocks_ptr,
    y_ptr,  # act [M, INTER], w2 [E, HIDDEN, INTER], tw [M], y [M, HIDDEN] fp32 (weighted per-pair rows)
    HIDDEN: tl.constexpr, INTER: tl.constexpr, stride_at, stride_we, stride_wn, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr, USE_PDL: tl.constexpr,
    s_ptr=None, stride_se=0, stride_sn=0,  # fp8: scale_inv [E, ceil(HIDDEN/SB), ceil(INTER/SB)]
    HAS_SCALE: tl.constexpr = False, SB: tl.constexpr = 128, DOT_BF16: tl.constexpr = True,
):
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    # Alignment metadata and routing weights: two or more launches back (see the module docstring).
    if b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + b).to(tl.int64)
    start = tl.load(block_start_ptr + b)
    count = tl.load(block_count_ptr + b)
    rows = tl.arange(0, BLOCK_M)
    mr = rows < count
    pair = tl.load(sorted_pairs_ptr + start + rows, mask=mr, other=0)
    rw = tl.load(tw_ptr + pair, mask=mr, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = act_ptr + pair[:, None] * stride_at + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w2_ptr + e * stride_we + offs_n[None, :] * stride_wn + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    if HAS_SCALE:  # BLOCK_N and BLOCK_K divide SB: one scale per tile
        s_row = s_ptr + e * stride_se + ((pid_n * BLOCK_N) // SB) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        mk = (k0 + offs_k) < INTER
        w = tl.load(w_ptrs + k0, mask=mk[:, None] & mask_n[None, :], other=0.0)
        a = tl.load(a_ptrs + k0, mask=mr[:, None] & mk[None, :], other=0.0)
        if HAS_SCALE:  # fp8 weights: the dot in bf16 (a bf16 model) or fp32
            if DOT_BF16:
                a, w = a.to(tl.bfloat16), w.to(tl.bfloat16)
            else:
                a, w = a.to(tl.float32), w.to(tl.float32)
        else:
            a = a.to(w.dtype)
        if UPCAST_DOT:
            a, w = a.to(tl.float32), w.to(tl.float32)
        if HAS_SCALE:
            acc += tl.dot(a, w, input_precision=DOT_PRECISION) * tl.load(s_row + k0 // SB)
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    acc = acc * rw[:, None]
    tl.store(y_ptr + pair[:, None] * stride_yp + offs_n[None, :], acc, mask=mr[:, None] & mask_n[None, :])


@triton.jit
def moe_combine_kernel(
    y_ptr, ids_ptr, shared_ptr, res_ptr, out_ptr,  # y [T*TOPK, HIDDEN] fp32, ids [T*TOPK], out [T, HIDDEN]
    HIDDEN: tl.constexpr, stride_yp, stride_st, stride_rt, stride_ot,
    TOPK: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr,
    USE_PDL: tl.constexpr,
):
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for j in tl.static_range(TOPK):  # fixed order: deterministic
        routed = tl.load(ids_ptr + tok * TOPK + j) >= 0  # a pair with no expert was in no block: y never written
        acc += tl.load(y_ptr + (tok * TOPK + j) * stride_yp + offs_n, mask=mask_n & routed, other=0.0)
    _store_token_row(acc, shared_ptr, res_ptr, out_ptr, tok, offs_n, mask_n, stride_st, stride_rt, stride_ot,
                     HAS_SHARED, HAS_RES)


# --------------------------------------------------------------------------------------------------------------------
# w8a8: fp8 experts x fp8 activations (act_fp8=True)
# --------------------------------------------------------------------------------------------------------------------


@triton.jit
def _w8a8_block(b, ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr,
                BLOCK_M: tl.constexpr, DIRECT: tl.constexpr):
    """The work item of program b: (expert, pair per row [BLOCK_M], row mask). DIRECT: pair b alone (no alignment
    launch: T < 3); else block b of the alignment."""
    rows = tl.arange(0, BLOCK_M)
    if DIRECT:
        e = tl.load(ids_ptr + b).to(tl.int64)
        pair = tl.where(rows == 0, b, 0)
        mr = (rows == 0) & (e >= 0)
    else:
        e = tl.load(block_expert_ptr + b).to(tl.int64)
        start = tl.load(block_start_ptr + b)
        count = tl.load(block_count_ptr + b)
        mr = rows < count
        pair = tl.load(sorted_pairs_ptr + start + rows, mask=mr, other=0)
    return e, pair, mr


@triton.jit
def _prefetch_l2_rows(row_ptrs, ROW_BYTES: tl.constexpr, BL: tl.constexpr):
    """``prefetch.global.L2`` of every 128-byte line of the rows at ``row_ptrs`` ([R] byte pointers, ROW_BYTES each):
    no register result, no wait (compiled kernels only: inline PTX). BL: a power of two >= the lines per row."""
    LINES: tl.constexpr = (ROW_BYTES + 127) // 128
    j = tl.arange(0, BL)
    ptrs = row_ptrs[:, None] + tl.where(j < LINES, j, 0)[None, :] * 128
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _act_operand(v, FP8_DOT: tl.constexpr, ACT_F16: tl.constexpr):
    """(activation operand [R, 128], its per-row scales [R]) of one 128-K group: v fp32 rows quantised to e4m3
    (w8a8) or, ACT_F16, scaled into fp16. FP8_DOT false (the interpreter): the operand's values in fp32."""
    if ACT_F16:
        q, s = f16_rows(v, FP8_DOT)
    else:
        q, s = quant_e4m3_rows(v, FP8_DOT)
    return q, s


@triton.jit
def _w_operand(w, FP8_DOT: tl.constexpr, ACT_F16: tl.constexpr):
    """The e4m3 weight tile as the MMA takes it: as loaded (w8a8), widened to fp16 (ACT_F16: exact), or in fp32
    (FP8_DOT false: the interpreter, whose dot on fp8 bits is not the e4m3 product)."""
    if not FP8_DOT:
        w = w.to(tl.float32)
    elif ACT_F16:
        w = w.to(tl.float16)
    return w


@triton.jit
def _mma_operands(v, w, FP8_DOT: tl.constexpr, ACT_F16: tl.constexpr):
    """(activation operand, its per-row scales, weight operand) of one 128-K group (``_act_operand``,
    ``_w_operand``)."""
    q, s = _act_operand(v, FP8_DOT, ACT_F16)
    return q, s, _w_operand(w, FP8_DOT, ACT_F16)


@triton.jit
def moe_up_w8a8_kernel(
    x_ptr, w13_ptr, s_ptr, ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr,
    num_blocks_ptr, act_ptr,  # x [T, HIDDEN], w13 [E, 2I, HIDDEN] e4m3, s [E, 2*ceil(I/SB), ceil(HIDDEN/SB)]
    HIDDEN: tl.constexpr, INTER: tl.constexpr, stride_xt, stride_we, stride_wn, stride_se, stride_sn, stride_at,
    limit, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
    DIRECT: tl.constexpr, FP8_DOT: tl.constexpr, HAS_LIMIT: tl.constexpr, USE_PDL: tl.constexpr,
    SB: tl.constexpr = 128, SPLIT_K: tl.constexpr = 1, stride_as=0, num_experts=1,
    PREFETCH_GROUPS: tl.constexpr = 0, ACT_F16: tl.constexpr = False,
    shared_limit=0.0, shared_id=-1, PAIR_LIMIT: tl.constexpr = False,  # _pair_limit
):
    """Swap-AB: acc [2 * BLOCK_N (gate rows, then up rows), BLOCK_M (pairs)] += (w13 tile [2 * BLOCK_N, SB] e4m3)
    @ (x rows quantised per 128-K group to e4m3)^T, scaled by (weight block scale x the rows' group scales) once per
    group; SwiGLU in the epilogue (SPLIT_K > 1: the partial sums instead). ACT_F16 (w8a16): the rows scaled into
    fp16 per group instead (``f16_rows``) and the weight tile widened to fp16 (one packed cvt per two weights), an
    fp16 x fp16 MMA (FP8_DOT false, the interpreter: both in fp32)."""
    pid = tl.program_id(0)
    pid_n = pid // SPLIT_K
    ks = pid - pid_n * SPLIT_K
    b = tl.program_id(1)
    if PREFETCH_GROUPS > 0:  # aligned: the router's ids are two launches back, complete before the wait; pair b's
        # expert (the grid covers every pair, so every expert touched) is a hint for the first K groups of the tile
        e_pf = tl.minimum(tl.maximum(tl.load(ids_ptr + b), 0), num_experts - 1).to(tl.int64)
        r_pf = tl.arange(0, 2 * BLOCK_N)
        n_pf = tl.minimum(pid_n * BLOCK_N + tl.where(r_pf >= BLOCK_N, r_pf - BLOCK_N, r_pf), INTER - 1)
        rows_pf = tl.where(r_pf >= BLOCK_N, INTER + n_pf, n_pf)
        KS_PF: tl.constexpr = ((HIDDEN + SB - 1) // SB + SPLIT_K - 1) // SPLIT_K * SB  # this split's first column
        _prefetch_l2_rows(w13_ptr + e_pf * stride_we + rows_pf.to(tl.int64) * stride_wn + ks * KS_PF,
                          PREFETCH_GROUPS * SB, PREFETCH_GROUPS)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if not DIRECT:
        if b >= tl.load(num_blocks_ptr):
            return
    e, pair, mr = _w8a8_block(b, ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr,
                              BLOCK_M, DIRECT)
    if e < 0:  # no expert: no weight read; the pair's act row is never read either
        return
    tok = pair // TOPK
    # One [2 * BLOCK_N, SB] weight tile per K step: rows r < BLOCK_N are gate rows, the rest the matching up rows
    # (one dot, its operand straight from the load: the pipeliner streams it into shared memory).
    r = tl.arange(0, 2 * BLOCK_N)
    is_up = r >= BLOCK_N
    offs_n = pid_n * BLOCK_N + tl.where(is_up, r - BLOCK_N, r)
    mask_n = offs_n < INTER
    w_rows = tl.where(is_up, INTER + offs_n, offs_n)
    offs_k = tl.arange(0, SB)
    w_ptrs = w13_ptr + e * stride_we + w_rows[:, None] * stride_wn + offs_k[None, :]  # [2 * BLOCK_N, SB]
    x_ptrs = x_ptr + tok[:, None] * stride_xt + offs_k[None, :]  # [BLOCK_M, SB]
    up_row0: tl.constexpr = (INTER + SB - 1) // SB
    nb = (pid_n * BLOCK_N) // SB  # BLOCK_N divides SB: one scale row per half
    sg_ptr = s_ptr + e * stride_se + nb * stride_sn
    su_ptr = sg_ptr + up_row0 * stride_sn
    acc = tl.zeros([2 * BLOCK_N, BLOCK_M], dtype=tl.float32)
    if SPLIT_K == 1:
        k_lo = 0
        k_hi = HIDDEN
    else:
        K_SPLIT: tl.constexpr = ((HIDDEN + SB - 1) // SB + SPLIT_K - 1) // SPLIT_K * SB  # K columns per split
        k_lo = ks * K_SPLIT
        k_hi = tl.minimum(k_lo + K_SPLIT, HIDDEN)
    for k0 in tl.range(k_lo, k_hi, SB, num_stages=NUM_STAGES):
        mk = (k0 + offs_k) < HIDDEN
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mk[None, :], other=0.0)
        xv = tl.load(x_ptrs + k0, mask=mr[:, None] & mk[None, :], other=0.0).to(tl.float32)
        xq, xs, w = _mma_operands(xv, w, FP8_DOT, ACT_F16)
        ws = tl.where(is_up, tl.load(su_ptr + k0 // SB), tl.load(sg_ptr + k0 // SB))  # [2 * BLOCK_N]
        acc += tl.dot(w, tl.trans(xq)) * (ws[:, None] * xs[None, :])
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0)))
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < INTER
    m = mask_n[:, None] & mr[None, :]
    if SPLIT_K == 1:
        act = _swiglu(acc_g, acc_u, _pair_limit(e, limit, shared_limit, shared_id, PAIR_LIMIT), HAS_LIMIT)
        tl.store(act_ptr + pair[None, :] * stride_at + offs_n[:, None], act, mask=m)
    else:  # this split's partial gate | up sums, act [SPLIT_K, M, 2I]: the down kernel sums them and applies SwiGLU
        part = act_ptr + ks * stride_as + pair[None, :] * stride_at + offs_n[:, None]
        tl.store(part, acc_g, mask=m)
        tl.store(part + INTER, acc_u, mask=m)


@triton.jit
def moe_down_w8a8_kernel(
    act_ptr, w2_ptr, s_ptr, tw_ptr, ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr,
    num_blocks_ptr, y_ptr,  # act [M, INTER] fp32, w2 [E, HIDDEN, INTER] e4m3, y [M, HIDDEN] fp32 (weighted rows)
    HIDDEN: tl.constexpr, INTER: tl.constexpr, stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_yp,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, DIRECT: tl.constexpr,
    FP8_DOT: tl.constexpr, USE_PDL: tl.constexpr, SB: tl.constexpr = 128, PREFETCH: tl.constexpr = False,
    PF_LINES: tl.constexpr = 1, SPLIT_K: tl.constexpr = 1, stride_as=0, limit=0.0, HAS_LIMIT: tl.constexpr = False,
    ACT_F16: tl.constexpr = False,
    shared_limit=0.0, shared_id=-1, PAIR_LIMIT: tl.constexpr = False,  # _pair_limit (SPLIT_K > 1: SwiGLU here)
):
    """Swap-AB: acc [BLOCK_N, BLOCK_M (pairs)] += (w2 tile [BLOCK_N, SB] e4m3) @ (the pairs' SwiGLU rows scaled per
    128-K group: e4m3, or fp16 with ACT_F16, as the up kernel)^T x (block scale x group scales); y = acc x the
    routing weight."""
    pid_n = tl.program_id(0)
    b = tl.program_id(1)
    # Work list and routing weights: two or more launches back (the module docstring).
    if not DIRECT:
        if b >= tl.load(num_blocks_ptr):
            return
    e, pair, mr = _w8a8_block(b, ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_start_ptr, block_count_ptr,
                              BLOCK_M, DIRECT)
    if e < 0:
        return
    rw = tl.load(tw_ptr + pair, mask=mr, other=0.0).to(tl.float32)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    if PREFETCH:  # the weights need nothing from the up kernel: pull this program's tile into L2 before the wait
        _prefetch_l2_rows(w2_ptr + e * stride_we + tl.where(mask_n, offs_n, 0).to(tl.int64) * stride_wn, INTER,
                          PF_LINES)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_k = tl.arange(0, SB)
    w_ptrs = w2_ptr + e * stride_we + offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, SB]
    a_ptrs = act_ptr + pair[:, None] * stride_at + offs_k[None, :]  # [BLOCK_M, SB]
    s_row = s_ptr + e * stride_se + ((pid_n * BLOCK_N) // SB) * stride_sn
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    lim = _pair_limit(e, limit, shared_limit, shared_id, PAIR_LIMIT)  # (used by the split-K SwiGLU alone)
    for k0 in tl.range(0, INTER, SB, num_stages=NUM_STAGES):
        mk = (k0 + offs_k) < INTER
        w = tl.load(w_ptrs + k0, mask=mask_n[:, None] & mk[None, :], other=0.0)
        ma = mr[:, None] & mk[None, :]
        if SPLIT_K == 1:
            av = tl.load(a_ptrs + k0, mask=ma, other=0.0)
        else:  # the up kernel's partial sums, added in split order, then SwiGLU
            g = tl.load(a_ptrs + k0, mask=ma, other=0.0)
            u = tl.load(a_ptrs + INTER + k0, mask=ma, other=0.0)
            for sp in tl.static_range(1, SPLIT_K):
                g += tl.load(a_ptrs + sp * stride_as + k0, mask=ma, other=0.0)
                u += tl.load(a_ptrs + sp * stride_as + INTER + k0, mask=ma, other=0.0)
            av = _swiglu(g, u, lim, HAS_LIMIT)
        aq, as_, w = _mma_operands(av, w, FP8_DOT, ACT_F16)
        acc += tl.dot(w, tl.trans(aq)) * (tl.load(s_row + k0 // SB) * as_)[None, :]
    acc = acc * rw[None, :]
    tl.store(y_ptr + pair[None, :] * stride_yp + offs_n[:, None], acc, mask=mask_n[:, None] & mr[None, :])


@triton.jit
def moe_down_token_kernel(
    act_ptr, w2_ptr, s_ptr, ids_ptr, tw_ptr, shared_ptr, res_ptr, out_ptr,  # act [T*TOPK, INTER] fp32, out [T, HIDDEN]
    HIDDEN: tl.constexpr, INTER: tl.constexpr, stride_at, stride_we, stride_wn, stride_se, stride_sn, stride_st,
    stride_rt, stride_ot, TOPK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr, FP8_DOT: tl.constexpr, HAS_SHARED: tl.constexpr, HAS_RES: tl.constexpr,
    USE_PDL: tl.constexpr, SB: tl.constexpr = 128, ACT_F16: tl.constexpr = False,
):
    """The tensor-core down-projection and the combine in one: program = (N-block of d, token). One flattened loop
    over the token's TOPK experts x 128-K groups (the pipeline spans experts, as ``moe_down_direct_kernel``'s): the
    activation tile holds the token's TOPK SwiGLU rows with every row but expert j's masked to zero, so column j of
    acc [BLOCK_N, BLOCK_M] gathers expert j's product (scaled per group by block scale x row scale x routing
    weight) and the others add zeros; y = the columns' sum (+ shared + residual), one cast. No per-pair rows, no
    combine launch. BLOCK_M (>= 16, the MMA's narrow side) >= TOPK."""
    pid_n = tl.program_id(0)
    tok = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    mj = rows < TOPK
    # Router outputs: written two launches back, complete before this grid starts (the module docstring)
    ids = tl.load(ids_ptr + tok * TOPK + rows, mask=mj, other=-1).to(tl.int64)
    rw = tl.load(tw_ptr + tok * TOPK + rows, mask=mj, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < HIDDEN
    offs_k = tl.arange(0, SB)
    a_rows = act_ptr + (tok * TOPK + rows)[:, None] * stride_at + offs_k[None, :]  # [BLOCK_M, SB]
    w_rows = offs_n[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, SB]
    s_col = ((pid_n * BLOCK_N) // SB) * stride_sn  # BLOCK_N divides SB: one scale row
    num_k: tl.constexpr = (INTER + SB - 1) // SB
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for it in tl.range(0, TOPK * num_k, num_stages=NUM_STAGES):
        j = it // num_k
        k0 = (it - j * num_k) * SB
        e = tl.sum(tl.where(rows == j, ids, 0), axis=0)
        routed = e >= 0  # id -1: no expert, no weight read, adds zero
        mk = (k0 + offs_k) < INTER
        av = tl.load(a_rows + k0, mask=((rows == j) & routed)[:, None] & mk[None, :], other=0.0)
        w = tl.load(w2_ptr + e * stride_we + w_rows + k0, mask=mask_n[:, None] & (mk & routed)[None, :], other=0.0)
        aq, as_ = _act_operand(av, FP8_DOT, ACT_F16)
        ws = tl.load(s_ptr + e * stride_se + s_col + k0 // SB, mask=routed, other=0.0)
        acc += tl.dot(_w_operand(w, FP8_DOT, ACT_F16), tl.trans(aq)) * (ws * as_ * rw)[None, :]
    y = tl.sum(acc, axis=1)
    _store_token_row(y, shared_ptr, res_ptr, out_ptr, tok, offs_n, mask_n, stride_st, stride_rt, stride_ot,
                     HAS_SHARED, HAS_RES)


# L2 prefetch before the PDL wait, off: the down kernel its program's w2 tile (W8A8_PREFETCH), the aligned up
# kernel the first W8A8_PREFETCH_UP_GROUPS 128-column groups of its w13 tile (by pair b's expert, a hint). Measured
# on the H200 (benchmarks/results/moe-2026-12-02): slower at every T (T = 6: 91.8 us with both, 90.0 with the down
# one alone, 84.0 with none; T = 17: 205 / 198 / 191 us), so neither is compiled in by default.
W8A8_PREFETCH = False
W8A8_PREFETCH_UP_GROUPS = 0


def _up_prefetch_groups(hidden: int, split: int) -> int:
    """A power of two <= W8A8_PREFETCH_UP_GROUPS and <= one split's 128-column groups whole (every prefetched line
    inside the split's columns of the row), 0 for none."""
    groups = hidden // FP8_BLOCK // split
    g = W8A8_PREFETCH_UP_GROUPS
    while g > groups:
        g //= 2
    return g


def _w8a8_tile_check(tile: MoETile) -> None:
    assert FP8_BLOCK % tile.block_n == 0, "w8a8 tiles: BLOCK_N must divide the 128-row scale blocks"
    assert tile.split_k >= 1
    assert tile.block_k == FP8_BLOCK, "w8a8 tiles: BLOCK_K is the 128-column activation group"




def fused_experts_w8a8(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                       topk_weights: torch.Tensor, swiglu_limit: float, residual: torch.Tensor | None,
                       shared_out: torch.Tensor | None, w13_scale: torch.Tensor, w2_scale: torch.Tensor,
                       out: torch.Tensor, cfg: MoEConfig, pdl: bool, align: str | None = None,
                       act: str = "e4m3", shared_limit: float = 0.0, shared_id: int | None = None) -> torch.Tensor:
    """The w8a8 experts (``naive.fused_experts_w8a8``'s arithmetic; ``act="f16"``: ``naive.fused_experts_fp8_f16``'s,
    fp16 activations). Under ALIGNED_MIN_TOKENS tokens: direct (the up kernel one program column per pair, no
    alignment), then down per pair and the combine, or with ``cfg.token_down`` ``moe_down_token_kernel`` (the
    down-projection with the combine per token: two launches in all); ``align="none"``: direct with the token
    kernel at any T; else the alignment, then up, down and combine over its blocks. The pairs of expert
    ``shared_id`` (a fused shared expert) take the SwiGLU clamp ``shared_limit``."""
    if act not in ("e4m3", "f16"):
        raise ValueError(f"unknown activation scaling {act!r} (e4m3, f16)")
    act_f16 = act == "f16"
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    top_k = topk_ids.shape[1]
    _w8a8_tile_check(cfg.up)
    _w8a8_tile_check(cfg.down)
    flat_ids = topk_ids.view(-1)
    num_pairs = flat_ids.numel()
    split = cfg.up.split_k
    # the token kernel (down + combine per token) runs direct at any T: on align "none", or where the tiles say so
    token_down = split == 1 and (align == "none" or cfg.token_down)
    direct = align == "none" or (align is None and (num_tokens < ALIGNED_MIN_TOKENS or token_down))
    if direct:
        meta = (flat_ids, flat_ids, flat_ids, flat_ids, flat_ids)  # (ids, sorted_pairs, expert, start, count)
        num_blocks, grid_m, block_m = flat_ids, num_pairs, 16
    else:
        block_m = cfg.block_m
        align = align or ("triton" if num_pairs <= MAX_ALIGN_PAIRS else "torch")
        al = (moe_align_fwd(flat_ids, num_experts, block_m, pdl) if align == "triton"
              else moe_align_torch(flat_ids, num_experts, block_m))
        meta = (flat_ids, al.sorted_pairs, al.block_expert, al.block_start, al.block_count)
        num_blocks, grid_m = al.num_blocks, al.max_blocks
    fp8_dot = not _interpreting()
    limits = _limit_args(swiglu_limit, shared_limit, shared_id)
    # split-K: [split, M, 2I] partial gate | up sums (SwiGLU in the down kernel); else act [M, I]
    act = _empty((split, num_pairs, two_inter) if split > 1 else (num_pairs, inter), torch.float32, x.device)
    stride_as = act.stride(0) if split > 1 else 0
    stride_at = act.stride(-2)
    moe_up_w8a8_kernel[(triton.cdiv(inter, cfg.up.block_n) * split, grid_m)](
        x, w13, w13_scale, *meta, num_blocks, act, hidden, inter, x.stride(0), w13.stride(0), w13.stride(1),
        w13_scale.stride(0), w13_scale.stride(1), stride_at,
        TOPK=top_k, BLOCK_M=block_m, BLOCK_N=cfg.up.block_n, NUM_STAGES=cfg.up.num_stages, DIRECT=direct,
        FP8_DOT=fp8_dot, **limits, SB=FP8_BLOCK, SPLIT_K=split, stride_as=stride_as,
        num_experts=num_experts,
        PREFETCH_GROUPS=_up_prefetch_groups(hidden, split) if fp8_dot and not direct and grid_m <= num_pairs else 0,
        ACT_F16=act_f16, **_launch_kw(pdl, cfg.up.num_warps, cfg.up.num_stages),
    )
    if token_down:  # the down-projection and the combine in one launch per token
        shared = shared_out if shared_out is not None else out
        res = residual if residual is not None else out
        moe_down_token_kernel[(triton.cdiv(hidden, cfg.down.block_n), num_tokens)](
            act, w2, w2_scale, flat_ids, topk_weights.view(-1), shared, res, out, hidden, inter, stride_at,
            w2.stride(0), w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), shared.stride(0), res.stride(0),
            out.stride(0), TOPK=top_k, BLOCK_M=max(16, triton.next_power_of_2(top_k)), BLOCK_N=cfg.down.block_n,
            NUM_STAGES=cfg.down.num_stages, FP8_DOT=fp8_dot, HAS_SHARED=shared_out is not None,
            HAS_RES=residual is not None, SB=FP8_BLOCK, ACT_F16=act_f16,
            **_launch_kw(pdl, cfg.down.num_warps, cfg.down.num_stages),
        )
        return out
    y = _empty((num_pairs, hidden), torch.float32, x.device)
    moe_down_w8a8_kernel[(triton.cdiv(hidden, cfg.down.block_n), grid_m)](
        act, w2, w2_scale, topk_weights.view(-1), *meta, num_blocks, y, hidden, inter, stride_at, w2.stride(0),
        w2.stride(1), w2_scale.stride(0), w2_scale.stride(1), y.stride(0),
        BLOCK_M=block_m, BLOCK_N=cfg.down.block_n, NUM_STAGES=cfg.down.num_stages, DIRECT=direct, FP8_DOT=fp8_dot,
        SB=FP8_BLOCK, PREFETCH=fp8_dot and W8A8_PREFETCH,
        PF_LINES=triton.next_power_of_2(triton.cdiv(inter, 128)), SPLIT_K=split, stride_as=stride_as,
        **limits, ACT_F16=act_f16,
        **_launch_kw(pdl, cfg.down.num_warps, cfg.down.num_stages),
    )
    return moe_combine_fwd(y, flat_ids, top_k, shared_out, residual, out, cfg.combine, pdl)


# UPCAST_DOT: the Triton 3.6 interpreter computes tl.dot on bf16 operands from their raw bits (garbage); in the
# interpreter the operands are upcast to fp32 first. Compiled kernels keep bf16 operands (tensor cores, fp32 acc).


def _dot_precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _aligned_scale_args(scale: torch.Tensor | None, tile: MoETile) -> dict:
    if scale is None:
        return {}
    assert FP8_BLOCK % tile.block_n == 0 and FP8_BLOCK % tile.block_k == 0, \
        "fp8 aligned tiles: BLOCK_N and BLOCK_K must divide the 128 x 128 scale blocks"
    return dict(s_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1), HAS_SCALE=True, SB=FP8_BLOCK)


def moe_up_aligned_fwd(x: torch.Tensor, w13: torch.Tensor, al: AlignedPairs, top_k: int, swiglu_limit: float,
                       tile: MoETile, pdl: bool, w13_scale: torch.Tensor | None = None, shared_limit: float = 0.0,
                       shared_id: int | None = None) -> torch.Tensor:
    """x [T, d], w13 [E, 2I, d] (bf16, or fp8 with ``w13_scale``) -> act [T*k, I] fp32 (pair order), one program
    per (N-block, expert block); the blocks of expert ``shared_id`` clamped at ``shared_limit``."""
    inter, hidden = w13.shape[1] // 2, w13.shape[2]
    act = _empty((al.sorted_pairs.numel(), inter), torch.float32, x.device)
    grid = (triton.cdiv(inter, tile.block_n), al.max_blocks)
    moe_up_aligned_kernel[grid](
        x, w13, al.sorted_pairs, al.block_expert, al.block_start, al.block_count, al.num_blocks, act,
        hidden, inter, x.stride(0), w13.stride(0), w13.stride(1), act.stride(0),
        TOPK=top_k, BLOCK_M=al.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        DOT_PRECISION=_dot_precision(x.dtype if w13_scale is not None else w13.dtype), UPCAST_DOT=_interpreting(),
        **_limit_args(swiglu_limit, shared_limit, shared_id), **_aligned_scale_args(w13_scale, tile),
        **_launch_kw(pdl, tile.num_warps, tile.num_stages),
    )
    return act


def moe_down_aligned_fwd(act: torch.Tensor, w2: torch.Tensor, flat_weights: torch.Tensor, al: AlignedPairs,
                         tile: MoETile, pdl: bool, w2_scale: torch.Tensor | None = None,
                         dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """act [T*k, I], w2 [E, d, I] -> y [T*k, d] fp32 = weight * act @ w2[e].T per pair. fp8 ``w2`` (with
    ``w2_scale``): the dot runs in ``dtype`` (the model's: bf16, or fp32)."""
    fp8 = w2_scale is not None
    hidden, inter = w2.shape[1], w2.shape[2]
    y = _empty((act.shape[0], hidden), torch.float32, act.device)
    grid = (triton.cdiv(hidden, tile.block_n), al.max_blocks)
    moe_down_aligned_kernel[grid](
        act, w2, flat_weights, al.sorted_pairs, al.block_expert, al.block_start, al.block_count, al.num_blocks, y,
        hidden, inter, act.stride(0), w2.stride(0), w2.stride(1), y.stride(0),
        BLOCK_M=al.block_m, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        DOT_PRECISION=_dot_precision(dtype if fp8 else w2.dtype), UPCAST_DOT=_interpreting(),
        DOT_BF16=dtype != torch.float32, **_aligned_scale_args(w2_scale, tile),
        **_launch_kw(pdl, tile.num_warps, tile.num_stages),
    )
    return y


def moe_combine_fwd(y: torch.Tensor, flat_ids: torch.Tensor, top_k: int, shared_out: torch.Tensor | None,
                    residual: torch.Tensor | None, out: torch.Tensor, tile: MoETile, pdl: bool) -> torch.Tensor:
    """out [T, d] = sum over the pairs with an expert (flat_ids [T*k] >= 0) of y[t*k + j] (+ shared_out +
    residual), in fp32, cast once."""
    num_tokens, hidden = out.shape
    shared = shared_out if shared_out is not None else out
    res = residual if residual is not None else out
    grid = (triton.cdiv(hidden, tile.block_n), num_tokens)
    moe_combine_kernel[grid](
        y, flat_ids, shared, res, out, hidden, y.stride(0), shared.stride(0), res.stride(0), out.stride(0),
        TOPK=top_k, BLOCK_N=tile.block_n, HAS_SHARED=shared_out is not None, HAS_RES=residual is not None,
        **_launch_kw(pdl, tile.num_warps, tile.num_stages),
    )
    return out


# --------------------------------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------------------------------


def fused_experts_decode(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
                         topk_weights: torch.Tensor, swiglu_limit: float = 0.0, residual: torch.Tensor | None = None,
                         shared_out: torch.Tensor | None = None, *, mode: str | None = None,
                         config: MoEConfig | None = None, align: str | None = None,
                         out: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
                         w2_scale: torch.Tensor | None = None, act_fp8: bool = False, shared_limit: float = 0.0,
                         shared_id: int | None = None) -> torch.Tensor:
    """``[residual +] [shared_out +] sum_k topk_weights * expert_k(x)`` accumulated in fp32, returned in x's dtype.

    x [T, d]; w13 [E, 2I, d] (gate rows, then up rows); w2 [E, d, I]; topk_ids [T, k] (int32/int64);
    topk_weights [T, k]; residual / shared_out [T, d]. An id of -1 is no expert (``select_experts``' rows past
    ``active_rows``): no program reads weights for it and it adds nothing, so a row of -1s is residual + shared_out.
    ``mode``: "direct", "aligned" or "hybrid" (default by T, see ``default_mode``), or for fp8 experts "f16" (the
    w8a8 kernels with fp16 activations: ``naive.fused_experts_fp8_f16``; the default where this GPU's ``fp8_f16``
    table entry is preferred); ``align``: "triton" (one program, M <= MAX_ALIGN_PAIRS) or "torch" (default by M), or
    for the tensor-core fp8 forms "none" (direct at any T, no alignment: the default where the tiles say
    ``token_down``).
    No host synchronisation: safe under CUDA-graph capture.

    ``shared_id``: the id of a fused shared expert stacked with the routed ones (``baton.layers.moe.Experts``; its
    pairs are ordinary pairs, weight 1): the up-projection clamps its pairs at ``shared_limit`` and the others at
    ``swiglu_limit`` (0: off). None: one clamp for every pair, the kernels compiled as without it.

    fp8 experts: w13 / w2 in float8_e4m3fn with ``w13_scale`` / ``w2_scale`` 128 x 128 block scale_inv (the Ling fp8
    checkpoint layout, baton.ops.quant): the scales are applied in registers and the sums kept in fp32; direct up to
    ``FP8_DIRECT_MAX_PAIRS`` pairs (decode, verify), aligned past it (prefill: no dequantised copy of the experts)."""
    num_tokens, hidden = x.shape
    num_experts, two_inter, _ = w13.shape
    top_k = topk_ids.shape[1]
    assert w13.shape[2] == hidden and w2.shape == (num_experts, hidden, two_inter // 2)
    assert w13.stride(-1) == 1 and w2.stride(-1) == 1, "expert weights must be contiguous along their last dim"
    assert topk_ids.shape == topk_weights.shape and topk_ids.shape[0] == num_tokens
    fp8 = w13_scale is not None
    if fp8 and mode is None and not act_fp8 and num_tokens * top_k <= FP8_F16_MAX_PAIRS \
            and get_config(num_tokens, "fp8_f16").preferred:
        mode = "f16"  # this GPU's table prefers the fp16 MMA to the direct kernels at this T
    if act_fp8 or mode == "f16":  # tensor-core fp8 experts: e4m3 (w8a8) or fp16 (w8a16) activations per 128-K group
        assert fp8 and w2_scale is not None, "act_fp8 and mode 'f16' need fp8 experts (w13_scale, w2_scale)"
        if out is None:
            out = _empty((num_tokens, hidden), x.dtype, x.device)
        if num_tokens == 0:
            return out
        cfg = config if config is not None else get_config(num_tokens, "fp8_w8a8" if act_fp8 else "fp8_f16")
        return fused_experts_w8a8(
            x.contiguous(), w13, w2, topk_ids.contiguous(), topk_weights.contiguous(), swiglu_limit,
            residual.contiguous() if residual is not None else None,
            shared_out.contiguous() if shared_out is not None else None, w13_scale, w2_scale, out, cfg,
            pdl_enabled(x.device), align, act="e4m3" if act_fp8 else "f16", shared_limit=shared_limit,
            shared_id=shared_id)
    if fp8:
        mode = mode or ("direct" if num_tokens * top_k <= FP8_DIRECT_MAX_PAIRS else "aligned")
    else:
        mode = mode or default_mode(num_tokens)
    if mode not in ("direct", "aligned", "hybrid"):
        raise ValueError(f"unknown MoE mode {mode!r}")
    direct_kind = "fp8" if fp8 else "direct"  # the table of the direct kernels' tiles
    if config is not None:
        cfg = config
    elif mode == "direct":
        cfg = get_config(num_tokens, direct_kind)
    else:
        cfg = get_config(num_tokens, "fp8_aligned" if fp8 else "aligned")
    direct_cfg = cfg if mode != "hybrid" or config is not None else get_config(num_tokens, direct_kind)
    if fp8:  # a tile that crosses a scale block is refused here, before any kernel (the alignment too) is launched
        (_scale_args if mode == "direct" else _aligned_scale_args)(w13_scale, cfg.up)
        (_aligned_scale_args if mode == "aligned" else _scale_args)(w2_scale, direct_cfg.down)
    if out is None:
        out = _empty((num_tokens, hidden), x.dtype, x.device)
    if num_tokens == 0:
        return out
    x = x.contiguous()
    topk_ids = topk_ids.contiguous()
    topk_weights = topk_weights.contiguous()
    residual = residual.contiguous() if residual is not None else None
    shared_out = shared_out.contiguous() if shared_out is not None else None
    flat_ids = topk_ids.view(-1)
    pdl = pdl_enabled(x.device)

    if mode == "direct":
        act = moe_up_direct_fwd(x, w13, flat_ids, top_k, swiglu_limit, cfg.up, pdl, w13_scale, shared_limit,
                                shared_id)
        return moe_down_direct_fwd(act, w2, topk_ids, topk_weights, shared_out, residual, out, cfg.down, pdl,
                                   w2_scale)

    align = align or ("triton" if flat_ids.numel() <= MAX_ALIGN_PAIRS else "torch")
    if align == "triton":
        al = moe_align_fwd(flat_ids, num_experts, cfg.block_m, pdl)
    else:
        al = moe_align_torch(flat_ids, num_experts, cfg.block_m)
    act = moe_up_aligned_fwd(x, w13, al, top_k, swiglu_limit, cfg.up, pdl, w13_scale, shared_limit, shared_id)
    if mode == "hybrid":
        return moe_down_direct_fwd(act, w2, topk_ids, topk_weights, shared_out, residual, out, direct_cfg.down, pdl,
                                   w2_scale)
    y = moe_down_aligned_fwd(act, w2, topk_weights.view(-1), al, cfg.down, pdl, w2_scale, x.dtype)
    return moe_combine_fwd(y, flat_ids, top_k, shared_out, residual, out, cfg.combine, pdl)
