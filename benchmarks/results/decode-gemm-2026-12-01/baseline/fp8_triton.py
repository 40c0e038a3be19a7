"""fp8 (e4m3) weight x bf16 / fp32 rows -> fp32, the 128 x 128 block scales applied in registers.

One program per BLOCK_N output rows (BLOCK_N divides 128: the program's rows share one row of scales) walks K in
chunks of BLOCK_K (dividing 128: a chunk lies in one scale block, so its scale is one scalar):
- one row (M == 1, a NEXTN draft step): the [BLOCK_N, BLOCK_K] products are summed in fp32 registers, the scale
  folded into the activation chunk, one reduction after the loop;
- a few rows (a DSpark block, up to ``MAX_M``): ``tl.dot`` over a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile, the
  weights widened to the activations' dtype, each chunk's product scaled once.

The weight bytes are half a bf16 matrix's; the floor of a pass is N * K bytes / bandwidth. PDL (SM90+): the first
weight chunk is requested before waiting on the previous kernel, whose output (x) is read after the wait.

``fp8_dense`` (``fp8_dense_kernel``): the same walk for the dense projections of ``--quantization fp8`` with the
fusions of ``baton.ops.linear.triton`` (its prologue / epilogue helpers, so the same roundings): an RMSNorm prologue,
a residual or SwiGLU epilogue (gate and up rows read together), out in x's dtype, up to ``DENSE_MAX_M`` rows. A
fused weight whose parts (checkpoint tensors, quantised each on its own) do not start on a 128-row block passes a
row -> scale-row map and takes one scale per row of the tile instead of one per tile. No split-K yet: short-N
shapes take narrow column blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from decode_gemm_baseline_linear import _epilogue, _load_h, _row_rstd, pdl_enabled
from baton.ops.quant.fp8 import BLOCK as SB
from baton.ops.quant.fp8 import FP8_DTYPE

MAX_M = 16


@triton.jit
def fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, M, N, K: tl.constexpr, stride_xm, stride_wn, stride_sn,
                      stride_om, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SB: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, USE_PDL: tl.constexpr):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N - 1).to(tl.int64)  # clamped: the loads need no row mask
    w_ptrs = w_ptr + rows[:, None] * stride_wn + tl.arange(0, BLOCK_K)[None, :]  # [BLOCK_N, BLOCK_K]
    s_row = s_ptr + ((pid * BLOCK_N) // SB) * stride_sn
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)  # the weights never wait on the previous kernel
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        k_mask = kk < K
        s = tl.load(s_row + k0 // SB)
        if USE_DOT:
            x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :], mask=m_mask[:, None] & k_mask[None, :],
                        other=0.0)
            if DOT_FP32:  # fp32 rows; and always in the interpreter, whose dot reads low-precision operands as raw bits
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x.to(tl.bfloat16), tl.trans(w.to(tl.bfloat16)))
            acc += part * s
        else:
            x = tl.load(x_ptr + kk, mask=k_mask, other=0.0).to(tl.float32)
            acc += w.to(tl.float32) * (x * s)[None, :]
        kn = kk + BLOCK_K
        w = tl.load(w_ptrs + k0 + BLOCK_K, mask=(kn < K)[None, :], other=0.0)  # the next chunk (zeros past K)
    if USE_DOT:
        y = acc
    else:
        y = tl.sum(acc, axis=1)[None, :]
    mask = m_mask[:, None] & (offs_n < N)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y, mask=mask)


def pick_tiles(m: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for ``m`` rows. One row: the sweep's winner at the Ling lm_head
    (``python -m baton.ops.fp8_linear.bench --shapes 157184x2560 78592x2560 --rows 1 --sweep`` on an H200,
    2026-11-30: 136.6 us at 157184 x 2560 against 142.7 us for (64, 128, 4, 3), and 79.0 against 83.0 us at TP2's
    half; the floor is 83.8 and 41.9 us). More rows: not swept yet."""
    return (32, 128, 4, 2) if m == 1 else (64, 128, 4, 2)


def supports(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> bool:
    return (x.dim() == 2 and 1 <= x.shape[0] <= MAX_M and weight.dtype == FP8_DTYPE and weight.dim() == 2
            and x.shape[1] == weight.shape[1] and weight.stride(1) == 1 and x.dtype in (torch.bfloat16, torch.float32)
            and scale_inv.dtype == torch.float32 and scale_inv.shape == (triton.cdiv(weight.shape[0], SB),
                                                                        triton.cdiv(weight.shape[1], SB)))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               tiles: tuple[int, int, int, int] | None = None, pdl: bool | None = None) -> torch.Tensor:
    """x [M <= MAX_M, K], weight [N, K] fp8, scale_inv [ceil(N/128), ceil(K/128)] fp32 -> fp32 [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, num_warps, num_stages = tiles or pick_tiles(m)
    assert SB % block_n == 0 and SB % block_k == 0, "fp8 tiles: BLOCK_N and BLOCK_K must divide the 128 x 128 blocks"
    x = x.contiguous()
    scale_inv = scale_inv.contiguous()
    out = torch.empty(m, n, dtype=torch.float32, device=x.device)
    use_dot = m > 1
    pdl = pdl_enabled(x.device) if pdl is None else pdl
    interpreting = x.device.type != "cuda"
    kw = {"launch_pdl": True} if pdl else {}
    fp8_linear_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale_inv, out, m, n, k, x.stride(0), weight.stride(0), scale_inv.stride(0), out.stride(0),
        BLOCK_M=max(16, triton.next_power_of_2(m)) if use_dot else 1, BLOCK_N=block_n, BLOCK_K=block_k, SB=SB,
        USE_DOT=use_dot, DOT_FP32=interpreting or x.dtype == torch.float32, USE_PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, **kw,
    )
    return out


# ---- dense projections under --quantization fp8: the fusions of baton.ops.linear on an fp8 weight ----

# Rows one dense launch takes: a DSpark verify of gamma 16 is 17 rows; past this the dispatch dequantises the weight
# and runs cuBLAS (prefill), which reads the weight three times over (fp8, the fp32 dequantised copy, bf16).
DENSE_MAX_M = 32


@triton.jit
def fp8_dense_kernel(x_ptr, w_ptr, s_ptr, rb_ptr, nw_ptr, res_ptr, out_ptr, M, N_OUT, stride_xm, stride_wn,
                     stride_sn, stride_rm, stride_om, eps, limit, K: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SB: tl.constexpr, STATS_BK: tl.constexpr,
                     HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
                     ROW_MAP: tl.constexpr, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, USE_PDL: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """out[M, N_OUT] = epilogue(prologue(x) @ dequantise(w).T), the epilogue and prologue those of
    ``baton.ops.linear.triton.linear_kernel`` (its helpers: the same roundings). w has N_OUT rows (2 * N_OUT for
    SwiGLU: gate then up). The scale of a [BLOCK_N, BLOCK_K] tile: one scalar (row ``row // SB``; BLOCK_N and
    BLOCK_K divide SB) or, with ROW_MAP, one per row (``rb_ptr[row]``: a fused weight whose parts are not
    SB-aligned)."""
    Y_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)  # clamped: the loads need no row mask
    offs_k = tl.arange(0, BLOCK_K)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_ptrs = w_ptr + rows[:, None] * stride_wn + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    up_ptrs = w_ptrs + N_OUT * stride_wn
    if ROW_MAP:
        s_row = s_ptr + tl.load(rb_ptr + rows).to(tl.int64) * stride_sn  # [BLOCK_N]
    else:
        s_row = s_ptr + ((pid * BLOCK_N) // SB) * stride_sn
    s_up = s_row
    if SWIGLU:
        if ROW_MAP:
            s_up = s_ptr + tl.load(rb_ptr + rows + N_OUT).to(tl.int64) * stride_sn
        else:
            s_up = s_ptr + ((pid * BLOCK_N + N_OUT) // SB) * stride_sn
    w = tl.load(w_ptrs, mask=(offs_k < K)[None, :], other=0.0)  # the weights never wait on the previous kernel
    w_up = w
    if SWIGLU:
        w_up = tl.load(up_ptrs, mask=(offs_k < K)[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    rstd = _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, STATS_BK, HAS_NORM)

    if USE_DOT:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = acc
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + offs_k
        kn = kk + BLOCK_K
        w_next = tl.load(w_ptrs + k0 + BLOCK_K, mask=(kn < K)[None, :], other=0.0)  # look-ahead; zeros past K
        if SWIGLU:
            w_up_next = tl.load(up_ptrs + k0 + BLOCK_K, mask=(kn < K)[None, :], other=0.0)
        h = _load_h(x_ptr, nw_ptr, offs_m, kk, m_mask, K, rstd, stride_xm, HAS_NORM, Y_DTYPE, INTERPRET)
        s = tl.load(s_row + k0 // SB)
        acc = _fp8_mac(acc, h, w, s, USE_DOT, DOT_FP32, ROW_MAP)
        w = w_next
        if SWIGLU:
            acc_up = _fp8_mac(acc_up, h, w_up, tl.load(s_up + k0 // SB), USE_DOT, DOT_FP32, ROW_MAP)
            w_up = w_up_next
    if not USE_DOT:
        acc = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        if SWIGLU:
            acc_up = tl.sum(acc_up, axis=1)[None, :]
        else:
            acc_up = acc
    _epilogue(acc, acc_up, out_ptr, res_ptr, offs_m, offs_n, M, N_OUT, stride_om, stride_rm, limit,
              Y_DTYPE, HAS_RES, SWIGLU, HAS_LIMIT, INTERPRET)


@triton.jit
def _fp8_mac(acc, h, w, s, USE_DOT: tl.constexpr, DOT_FP32: tl.constexpr, ROW_MAP: tl.constexpr):
    """acc += (h @ w.T) * s: through tl.dot ([BLOCK_M, BLOCK_N], each chunk's product scaled once), or (M == 1) the
    [BLOCK_N, BLOCK_K] products with the scale folded into the activation chunk (per row with ROW_MAP)."""
    if USE_DOT:
        if DOT_FP32:  # fp32 rows; and always in the interpreter, whose dot reads low-precision operands as raw bits
            part = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:  # bf16 / fp16 rows: the fp8 weights widen exactly
            part = tl.dot(h, tl.trans(w.to(h.dtype)))
        if ROW_MAP:
            acc += part * s[None, :]
        else:
            acc += part * s
    else:
        if ROW_MAP:
            acc += (w.to(tl.float32) * s[:, None]) * h.to(tl.float32)
        else:
            acc += w.to(tl.float32) * (h.to(tl.float32) * s)
    return acc


def pick_dense_tiles(m: int, n_out: int, swiglu: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of a dense fp8 projection with ``n_out`` outputs: BLOCK_K one
    scale block wide; BLOCK_N shrunk until there are about two programs per SM (no split-K: the short-N, long-K
    shapes, o_proj / dense / down_proj at N = 2560, take narrow column blocks instead). Not swept yet."""
    if m == 1:
        block_n = 32 if not swiglu else 16
        while block_n > 4 and triton.cdiv(n_out, block_n) < 2 * 132:
            block_n //= 2
        return block_n, 128, 4, 2
    block_n = 32 if triton.cdiv(n_out, 32) >= 132 and not swiglu else 16
    return block_n, 128, 4, 2


def supports_dense(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, swiglu: bool = False) -> bool:
    """Whether the Triton path takes this call: 1..DENSE_MAX_M rows of bf16 / fp32 (fp16), a contiguous fp8 weight, fp32
    scales of the weight's blocks (with ``row_block``: as many scale rows as it names), the norm weight in x's
    dtype, the residual shaped like the output."""
    if x.dim() < 1 or x.numel() == 0 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != FP8_DTYPE:
        return False
    if weight.stride(1) != 1 or scale_inv.dtype != torch.float32 or scale_inv.dim() != 2 or scale_inv.stride(1) != 1:
        return False
    if scale_inv.shape[1] != triton.cdiv(weight.shape[1], SB):
        return False
    if row_block is None and scale_inv.shape[0] != triton.cdiv(weight.shape[0], SB):
        return False
    if row_block is not None and (row_block.shape != (weight.shape[0],) or row_block.dtype != torch.int32
                                  or row_block.stride(0) != 1):
        return False
    if not 1 <= x.numel() // x.shape[-1] <= DENSE_MAX_M or (swiglu and weight.shape[0] % 2):
        return False
    if swiglu and row_block is None and (weight.shape[0] // 2) % SB:
        return False  # the up rows' blocks start inside a block: the scalar scale per tile does not hold
    if norm_weight is not None and (norm_weight.dtype != x.dtype or norm_weight.shape != (x.shape[-1],)):
        return False
    if residual is not None:
        n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
        if residual.shape != (*x.shape[:-1], n_out) or not residual.dtype.is_floating_point:
            return False
    return True


def fp8_dense(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, row_block: torch.Tensor | None = None,
              norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
              swiglu: bool = False, limit: float = 0.0, tiles: tuple[int, int, int, int] | None = None,
              pdl: bool | None = None) -> torch.Tensor:
    """``naive.fp8_dense_linear`` (``swiglu``: ``naive.fp8_dense_linear_swiglu``) in one launch. x [..., K] with
    at most DENSE_MAX_M rows; the result has x's dtype (promoted with the residual's), as ``baton.ops.linear``."""
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    assert 1 <= m <= DENSE_MAX_M, f"fp8_dense takes 1..{DENSE_MAX_M} rows, got {m}"
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    block_n, block_k, num_warps, num_stages = tiles or pick_dense_tiles(m, n_out, swiglu)
    assert SB % block_n == 0 and SB % block_k == 0, "fp8 tiles: BLOCK_N and BLOCK_K must divide the 128 x 128 blocks"
    use_dot = m > 1
    if use_dot:
        assert block_n >= 16 and block_k >= 16, "tl.dot needs BLOCK_N, BLOCK_K >= 16"
    assert row_block is not None or not swiglu or n_out % SB == 0, "fp8 SwiGLU: unaligned gate rows need row_block"
    out_dtype = x.dtype if residual is None else torch.promote_types(residual.dtype, x.dtype)
    out = torch.empty((m, n_out), dtype=out_dtype, device=x.device)
    res2 = out
    if residual is not None:
        res2 = residual.reshape(m, n_out)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
    pdl = pdl_enabled(x.device) if pdl is None else pdl
    interpreting = x.device.type != "cuda"
    block_m = max(16, triton.next_power_of_2(m)) if use_dot else 1
    kw = {"launch_pdl": True} if pdl else {}
    fp8_dense_kernel[(triton.cdiv(n_out, block_n),)](
        x2, weight, scale_inv, scale_inv if row_block is None else row_block,
        x2 if norm_weight is None else norm_weight, res2, out, m, n_out, x2.stride(0), weight.stride(0),
        scale_inv.stride(0), res2.stride(0), out.stride(0), float(eps), float(limit),
        K=k, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SB=SB,
        STATS_BK=min(triton.next_power_of_2(k), 8192 // block_m), HAS_NORM=norm_weight is not None,
        HAS_RES=residual is not None, SWIGLU=swiglu, HAS_LIMIT=limit > 0, ROW_MAP=row_block is not None,
        USE_DOT=use_dot, DOT_FP32=interpreting or x.dtype == torch.float32, USE_PDL=pdl, INTERPRET=interpreting,
        num_warps=num_warps, num_stages=num_stages, **kw,
    )
    return out.reshape(*x.shape[:-1], n_out)
