"""fp8 (e4m3) weight x bf16 / fp32 rows -> fp32, the 128 x 128 block scales applied in registers.

One program per BLOCK_N output rows (BLOCK_N divides 128: the program's rows share one row of scales) walks K in
chunks of BLOCK_K (dividing 128: a chunk lies in one scale block, so its scale is one scalar):
- one row (M == 1, a NEXTN draft step): the [BLOCK_N, BLOCK_K] products are summed in fp32 registers, the scale
  folded into the activation chunk, one reduction after the loop;
- a few rows (a DSpark block, up to ``MAX_M``): ``tl.dot`` over a [BLOCK_M, BLOCK_K] x [BLOCK_K, BLOCK_N] tile, the
  weights widened to the activations' dtype, each chunk's product scaled once.

The weight bytes are half a bf16 matrix's; the floor of a pass is N * K bytes / bandwidth. PDL (SM90+): the first
weight chunk is requested before waiting on the previous kernel, whose output (x) is read after the wait.

``fp8_dense``: the dense projections of ``--quantization fp8`` with the fusions of ``baton.ops.linear`` (an RMSNorm
prologue, a residual or SwiGLU epilogue, out in x's dtype, up to ``DENSE_MAX_M`` rows) are
``baton.ops.linear.triton.linear_kernel`` on the fp8 weight: the same forms (GEMV, split-K, the swap-AB tl.dot
form), the block scales applied per chunk in registers, configs from the fp8 table (``tuned/<gpu>.json`` beside this
file). A fused weight whose parts (checkpoint tensors, quantised each on its own) do not start on a 128-row block
passes a row -> scale-row map and takes one scale per row of the tile instead of one per tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.ops.linear import triton as lt
from baton.ops.linear.triton import LinearConfig, pdl_enabled
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
    (``python -m benchmarks.ops.bench_fp8_linear --shapes 157184x2560 78592x2560 --rows 1 --sweep``; the figures are
    in docs/performance.md, "Notes moved from code comments"). More rows: not swept yet."""
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

# Rows one dense launch takes: a DSpark verify of gamma 16 is 17; past this the dispatch dequantises the weight
# and runs cuBLAS (prefill), which reads the weight three times over (fp8, the fp32 dequantised copy, bf16).
DENSE_MAX_M = lt.MAX_M
# Short prefills (a cached follow-up turn: ~100-250 new tokens) take the kernel in row chunks of DENSE_MAX_M, one
# launch each: the chunks after the first find most of the weight in L2 (Ling's largest dense projection is ~32 MB
# of fp8), where the dequantising reference writes and reads an fp32 and a bf16 copy of every weight per call.
# Longer prompts keep the reference (cuBLAS on the dequantised weight: its reads amortise over the rows).
DENSE_CHUNKED_MAX_M = 256


def pick_dense_config(m: int, n_out: int, k: int, swiglu: bool = False, act_fp8: bool = False) -> LinearConfig:
    """The fp8 table's entry for the shape and row bucket, else ``baton.ops.linear.triton``'s bucket rules;
    ``act_fp8``: the w8a8 entries (the swap form at every M)."""
    if act_fp8:
        return lt.pick_config(m, n_out, k, swiglu, fp8=True, act_fp8=True)
    cfg = lt.pick_config(m, n_out, k, swiglu, fp8=True)
    return lt._heuristic_config(m, n_out, k, swiglu, True) if cfg.cublas else cfg


def pick_dense_tiles(m: int, n_out: int, swiglu: bool = False, k: int = 2560) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) of ``pick_dense_config`` (what earlier benchmarks print)."""
    cfg = pick_dense_config(m, n_out, k, swiglu)
    return cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages


def supports_dense(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                   row_block: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                   residual: torch.Tensor | None = None, swiglu: bool = False) -> bool:
    """Whether the Triton path takes this call: 1..DENSE_CHUNKED_MAX_M rows of bf16 / fp32 (fp16; past DENSE_MAX_M in
    row chunks), a contiguous fp8 weight, fp32
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
    if not 1 <= x.numel() // x.shape[-1] <= DENSE_CHUNKED_MAX_M or (swiglu and weight.shape[0] % 2):
        return False
    if swiglu and row_block is None and (weight.shape[0] // 2) % SB:
        return False  # the up rows' blocks start inside a block: the weight's scale rows do not line up
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
              pdl: bool | None = None, config: LinearConfig | None = None, act_fp8: bool = False) -> torch.Tensor:
    """``naive.fp8_dense_linear`` (``swiglu``: ``naive.fp8_dense_linear_swiglu``) in one launch. x [..., K] with
    at most DENSE_MAX_M rows (up to DENSE_CHUNKED_MAX_M: one launch per DENSE_MAX_M rows); the result has x's
    dtype (promoted with the residual's), as ``baton.ops.linear``.
    ``config`` (or the older ``tiles``: (BLOCK_N, BLOCK_K, num_warps, num_stages) of the look-ahead forms, no
    split) overrides the table. ``act_fp8``: w8a8 (the rows quantised to e4m3 per 128-column group after the
    prologue, fp8 x fp8 MMA; the same arithmetic as the reference with ``act_fp8=True``); a ``config`` then must be
    a swap-form one with BLOCK_K 128."""
    m = x.numel() // x.shape[-1]
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if DENSE_MAX_M < m <= DENSE_CHUNKED_MAX_M:  # a short prefill: one launch per DENSE_MAX_M rows
        x2 = x.reshape(m, x.shape[-1])
        r2 = None if residual is None else residual.reshape(m, n_out)
        parts = [fp8_dense(x2[i:i + DENSE_MAX_M], weight, scale_inv, row_block, norm_weight, eps,
                           None if r2 is None else r2[i:i + DENSE_MAX_M], swiglu, limit, tiles, pdl, config, act_fp8)
                 for i in range(0, m, DENSE_MAX_M)]
        return torch.cat(parts).reshape(*x.shape[:-1], n_out)
    assert 1 <= m <= DENSE_MAX_M, f"fp8_dense takes 1..{DENSE_CHUNKED_MAX_M} rows, got {m}"
    assert row_block is not None or not swiglu or n_out % SB == 0, "fp8 SwiGLU: unaligned gate rows need row_block"
    if config is None and tiles is not None:
        block_n, block_k, num_warps, num_stages = tiles
        config = LinearConfig(block_n, block_k, 1, num_warps, num_stages)
    if config is None:
        config = pick_dense_config(m, n_out, x.shape[-1], swiglu, act_fp8)
    if m > 1 and config.dot:
        assert config.block_n >= 16 and config.block_k >= 16, "tl.dot needs BLOCK_N, BLOCK_K >= 16"
    return lt._launch(x, weight, norm_weight, eps, residual, swiglu, limit, config, pdl, scale_inv.contiguous(),
                      row_block, act_fp8)
