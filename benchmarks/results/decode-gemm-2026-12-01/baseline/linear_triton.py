"""Triton decode-shape projections (x [M, K] with M = 1..16, weight [N, K]) with the fusions of ``naive.py``:
an RMSNorm prologue, a residual-add epilogue, and a SwiGLU epilogue over fused gate/up rows.

Design (bandwidth-bound at batch 1; every weight byte is read exactly once):

- grid = (cdiv(N_out, BLOCK_N), SPLIT_K). A program owns BLOCK_N output columns (for SwiGLU: BLOCK_N gate rows
  and the matching BLOCK_N up rows) and one K range, which it walks in BLOCK_K chunks. Weight tiles
  [BLOCK_N, BLOCK_K] are loaded one chunk ahead (register double buffer), contiguous along K, so each thread
  issues 16-byte loads. Rows past N are clamped to N - 1 (loads stay unmasked and vectorised; the extra
  columns are never stored).
- M == 1 (decode): broadcast multiply into a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced over K once at the
  end. M = 2..16 (verify): ``tl.dot`` with M padded to 16 (masked rows are zeros).
- RMSNorm prologue: each program recomputes the row statistics from x (K <= ~8192, x stays in L2), then
  normalises each x chunk exactly as ``rms_norm`` does: fp32 ``x * rsqrt(mean(x^2) + eps)``, rounded to x's
  dtype, times ``norm_weight``, rounded again.
- Epilogues replicate the reference's roundings: the GEMM result is rounded to x's dtype first, then SwiGLU
  (SiLU rounded, clamp, product rounded) or the residual add (``residual + y``, rounded to the result dtype).
- Split-K (short N, long K, where cdiv(N, BLOCK_N) programs cannot fill 132 SMs): each split writes its fp32
  partial [M, BLOCK_N] to a workspace, then increments a per-column-block counter; the program that arrives
  last sums the SPLIT_K partials in a fixed order (deterministic), applies the epilogue, stores, and resets its
  counter to zero for the next launch. The counters are one persistent int32 buffer per device, so the first
  call with split-K on a device must come before CUDA-graph capture (the engine warms up before capturing).
- PDL (``USE_PDL``): the first weight tile is requested before ``gdc_wait`` (weights never depend on the
  previous kernel); x, the residual, the outputs, the workspace and the counters are touched only after it.
  ``gdc_launch_dependents`` follows straight away so the next kernel's programs can land on SMs as ours drain.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

from baton import env

__all__ = [
    "LinearConfig",
    "linear",
    "linear_fwd",
    "linear_swiglu",
    "linear_swiglu_fwd",
    "pdl_enabled",
    "pick_config",
    "supports",
]

MAX_M = 16  # rows handled by one launch (decode 1, speculative verify up to 16); larger M goes to cuBLAS
NUM_SMS = 132  # H200
NUM_COUNTERS = 16384  # split-K column blocks per device (one int32 each)


@dataclass(frozen=True)
class LinearConfig:
    """Launch parameters; the tuning sweep varies these. ``block_n`` counts output columns (for SwiGLU the
    program reads 2 * block_n weight rows). With M > 1 ``block_n`` and ``block_k`` must be >= 16."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = True  # M > 1: tl.dot over 16 padded rows; False: the GEMV form over next_pow2(M) rows


# Measured winners, (kind, N_out, K, swiglu) -> config. Kind "gemv" is M == 1; "m4", "m8", "m16" are the row
# buckets M = 2..4, 5..8, 9..16; "dot" (M = 2..16, tl.dot) is what a bucket without an entry falls back to, and
# what tables written before the buckets hold. Entries set here take precedence; the rest come from the table of
# the current GPU (``tuned/<gpu name>.json``, written by ``python -m baton.ops.linear.bench --tune
# --write-table``). Shapes in neither take ``_heuristic_config``. A bucket entry may choose ``dot=False``: the
# verify's rows then take the GEMV form with every row in registers, not tl.dot over 16 padded rows (on the H200
# a SmolLM2 NEXTN verify at M = 4 spent 2.3x the plain step's linear time through tl.dot, 2026-11-30 census).
ROW_BUCKETS = (4, 8, 16)
TUNED: dict[tuple[str, int, int, bool], LinearConfig] = {}
TUNED_DIR = Path(__file__).with_name("tuned")


def table_path(device_name: str) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return TUNED_DIR / f"{slug}.json"


def read_table(path: Path) -> dict[tuple[str, int, int, bool], LinearConfig]:
    with open(path) as f:
        data = json.load(f)
    return {(e["kind"], int(e["n_out"]), int(e["k"]), bool(e["swiglu"])): LinearConfig(**e["config"])
            for e in data["entries"]}


@functools.cache
def _device_table(device_name: str) -> dict[tuple[str, int, int, bool], LinearConfig]:
    path = table_path(device_name)
    return read_table(path) if path.is_file() else {}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def _current_device_name() -> str | None:
    """The current GPU's name (read once per device: ``pick_config`` runs on every eager launch)."""
    if env.triton_interpret() or not torch.cuda.is_available():
        return None
    return _device_name(torch.cuda.current_device())


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_enabled(device: torch.device | None = None) -> bool:
    """Programmatic dependent launch: only on CUDA with SM90+, outside the interpreter, and ``env.use_pdl()``."""
    if device is not None and device.type != "cuda":
        return False
    if env.triton_interpret() or not env.use_pdl() or not torch.cuda.is_available():
        return False
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    return _capability(index)[0] >= 9


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _heuristic_config(m: int, n_out: int, k: int, swiglu: bool) -> LinearConfig:
    """Bucket rules. M == 1: a tile of ~8K weight elements (64 per thread at 4 warps: eight 16-byte loads for
    bf16, ~190 registers with the look-ahead tile and the [BLOCK_N, BLOCK_K] accumulator), BLOCK_N shrunk until
    there are >= 2 programs per SM. M > 1 (tl.dot, BLOCK_N >= 16): a 4K-element tile (8K tiles reach 255
    registers and spill), and K split when the column blocks alone leave SMs idle."""
    rows_per_col = 2 if swiglu else 1
    target = 2 * NUM_SMS
    if m == 1:
        if k <= 1024:
            block_k = _pow2_at_least(k)  # one chunk
        else:
            block_k = next((b for b in (1024, 512, 256) if k % b == 0), 512)
        block_n = max(2, min(64, 8192 // (block_k * rows_per_col)))
        while block_n > 2 and triton.cdiv(n_out, block_n) < target:
            block_n //= 2
        return LinearConfig(block_n, block_k, 1, 4, 1)
    block_k = 128 if k >= 128 else max(16, _pow2_at_least(k))
    block_n = 32 if n_out >= 4096 and not swiglu else 16
    n_blocks = triton.cdiv(n_out, block_n)
    split_k = 1
    if n_blocks < target:
        split_k = max(1, min(8, triton.cdiv(k, block_k), triton.cdiv(target, n_blocks)))
    return LinearConfig(block_n, block_k, split_k, 4, 1)


def pick_config(m: int, n_out: int, k: int, swiglu: bool = False) -> LinearConfig:
    """The config for x [m, k] and n_out output columns: a tuned entry if the shape has one, else the buckets."""
    name = _current_device_name()
    table = _device_table(name) if name else {}
    for kind in table_kinds(m):
        key = (kind, n_out, k, swiglu)
        cfg = TUNED.get(key) or table.get(key)
        if cfg is not None and (cfg.dot or kind != "dot"):
            return cfg
    return _heuristic_config(m, n_out, k, swiglu)


def table_kinds(m: int) -> tuple[str, ...]:
    """The table kinds a call with ``m`` rows looks up, in order: its own, then (M > 1) the "dot" fallback."""
    if m == 1:
        return ("gemv",)
    bucket = next(b for b in ROW_BUCKETS if m <= b) if m <= ROW_BUCKETS[-1] else ROW_BUCKETS[-1]
    return (f"m{bucket}", "dot")


_counters: dict[torch.device, torch.Tensor] = {}


def _split_counters(device: torch.device) -> torch.Tensor:
    """Per-device split-K arrival counters; all zero between launches (the last arriver resets its own)."""
    buf = _counters.get(device)
    if buf is None:
        buf = _counters[device] = torch.zeros(NUM_COUNTERS, dtype=torch.int32, device=device)
    return buf


@triton.jit
def _load_w(w_ptr, row_off, k0, k_hi, BLOCK_K: tl.constexpr, K_MASK: tl.constexpr):
    """Weight tile [BLOCK_N, BLOCK_K] of columns k0.., at precomputed row offsets, zero past ``k_hi``. When chunks
    never straddle ``k_hi`` (K_MASK false) the predicate is one scalar for the tile, so loads stay 16 bytes wide."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = w_ptr + row_off[:, None] + offs_k[None, :]
    if K_MASK:
        w = tl.load(ptrs, mask=(offs_k < k_hi)[None, :], other=0.0)
    else:
        w = tl.load(ptrs, mask=k0 < k_hi, other=0.0)
    return w


@triton.jit
def _round(x, DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """fp32 ``x`` rounded to DTYPE (to nearest even) and returned as fp32. Triton's CPU interpreter truncates
    fp32 -> bf16 casts, so there the rounding is done on the bits (finite values; tests only)."""
    if INTERPRET and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
        y = bits.to(tl.float32, bitcast=True)
    else:
        y = x.to(DTYPE).to(tl.float32)
    return y


@triton.jit
def _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K: tl.constexpr, eps, BLOCK_M: tl.constexpr, STATS_BK: tl.constexpr,
              HAS_NORM: tl.constexpr):
    """RMSNorm's 1 / rms of each row of x (the prologue's statistics, over K in STATS_BK chunks); zeros without a
    norm."""
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in tl.static_range(0, K, STATS_BK):
            offs_s = c + tl.arange(0, STATS_BK)
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_s[None, :],
                         mask=m_mask[:, None] & (offs_s < K)[None, :], other=0.0).to(tl.float32)
            sumsq += tl.sum(xs * xs, axis=1)
        rstd = tl.rsqrt(sumsq / K + eps)
    return rstd


@triton.jit
def _load_h(x_ptr, nw_ptr, offs_m, offs_k, m_mask, k_hi, rstd, stride_xm,
            HAS_NORM: tl.constexpr, H_DTYPE: tl.constexpr, INTERPRET: tl.constexpr):
    """x chunk [BLOCK_M, BLOCK_K], RMS-normalised like ``rms_norm`` when HAS_NORM (fp32 scale, round to x's
    dtype, times the norm weight, round to the GEMM input dtype). Masked elements are 0."""
    k_mask = offs_k < k_hi
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :], mask=m_mask[:, None] & k_mask[None, :],
                other=0.0)
    if HAS_NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0)
        y = _round(x.to(tl.float32) * rstd[:, None], x.dtype, INTERPRET)
        x = _round(y * nw.to(tl.float32)[None, :], H_DTYPE, INTERPRET).to(H_DTYPE)
    return x


@triton.jit
def _mac(acc, h, w, USE_DOT: tl.constexpr, ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
         INTERPRET: tl.constexpr):
    """acc += h @ w.T: [BLOCK_M, BLOCK_N] through tl.dot; or, without it, [BLOCK_M, BLOCK_N] from each chunk's
    row-times-tile products reduced over K (ROWS: a few rows), or (M == 1) the [BLOCK_N, BLOCK_K] partial
    products, reduced once after the loop. The interpreter's dot multiplies bf16 bit patterns as integers, so
    there it runs on exact fp32 copies."""
    if USE_DOT:
        if INTERPRET:
            acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
    elif ROWS:
        acc = acc + tl.sum(h.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    else:
        acc = acc + w.to(tl.float32) * h.to(tl.float32)
    return acc


@triton.jit
def _epilogue(acc, acc_up, out_ptr, res_ptr, offs_m, offs_n, M, N_OUT, stride_om, stride_rm, limit,
              Y_DTYPE: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
              INTERPRET: tl.constexpr):
    """Round the GEMM result to x's dtype as F.linear does, then SwiGLU or ``residual + y``; store [M, N_OUT]."""
    OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    y = _round(acc, Y_DTYPE, INTERPRET)
    if SWIGLU:
        up = _round(acc_up, Y_DTYPE, INTERPRET)
        act = _round(y / (1.0 + tl.exp(-y)), Y_DTYPE, INTERPRET)  # F.silu, rounded to the tensor's dtype
        if HAS_LIMIT:
            act = tl.minimum(act, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        y = act * up
    mask = (offs_m < M)[:, None] & (offs_n < N_OUT)[None, :]
    if HAS_RES:
        res = tl.load(res_ptr + offs_m[:, None] * stride_rm + offs_n[None, :], mask=mask, other=0.0)
        y = y + res.to(tl.float32)
    if INTERPRET:
        y = _round(y, OUT_DTYPE, INTERPRET)
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], y.to(OUT_DTYPE), mask=mask)


@triton.jit
def linear_kernel(
    x_ptr, w_ptr, nw_ptr, res_ptr, out_ptr, part_ptr, count_ptr,
    M, N_OUT,
    stride_xm, stride_wn, stride_rm, stride_om,
    eps, limit,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_BK: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    USE_DOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_PDL: tl.constexpr, INTERPRET: tl.constexpr,
):
    """out[M, N_OUT] = epilogue(prologue(x) @ w.T). w has N_OUT rows (2 * N_OUT for SwiGLU: gate then up)."""
    Y_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    H_DTYPE: tl.constexpr = w_ptr.dtype.element_ty
    K_MASK: tl.constexpr = (K % BLOCK_K != 0) or (K_PER_SPLIT % BLOCK_K != 0)
    ROWS: tl.constexpr = (BLOCK_M > 1) and not USE_DOT  # a few rows, GEMV form
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    rows = tl.minimum(offs_n, N_OUT - 1).to(tl.int64)  # clamped: loads need no row mask
    row_off = rows * stride_wn
    up_off = (rows + N_OUT) * stride_wn
    offs_m = tl.arange(0, BLOCK_M)  # [BLOCK_M]
    m_mask = offs_m < M
    k_lo = pid_k * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)

    # Weights never depend on the previous kernel: request the first tile before waiting on it.
    w = _load_w(w_ptr, row_off, k_lo, k_hi, BLOCK_K, K_MASK)  # [BLOCK_N, BLOCK_K]
    w_up = w
    if SWIGLU:
        w_up = _load_w(w_ptr, up_off, k_lo, k_hi, BLOCK_K, K_MASK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    rstd = _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, STATS_BK, HAS_NORM)

    if USE_DOT or ROWS:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc_up = acc
    for i in range(0, K_PER_SPLIT // BLOCK_K):  # the last split may run a few empty (fully masked) chunks
        k0 = k_lo + i * BLOCK_K
        w_next = _load_w(w_ptr, row_off, k0 + BLOCK_K, k_hi, BLOCK_K, K_MASK)  # look-ahead; zeros past k_hi
        if SWIGLU:
            w_up_next = _load_w(w_ptr, up_off, k0 + BLOCK_K, k_hi, BLOCK_K, K_MASK)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        h = _load_h(x_ptr, nw_ptr, offs_m, offs_k, m_mask, k_hi, rstd, stride_xm, HAS_NORM, H_DTYPE, INTERPRET)
        acc = _mac(acc, h, w, USE_DOT, ROWS, DOT_PRECISION, INTERPRET)
        w = w_next
        if SWIGLU:
            acc_up = _mac(acc_up, h, w_up, USE_DOT, ROWS, DOT_PRECISION, INTERPRET)
            w_up = w_up_next
    if not USE_DOT and not ROWS:
        acc = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
        if SWIGLU:
            acc_up = tl.sum(acc_up, axis=1)[None, :]
        else:
            acc_up = acc  # same shape on both sides of the split-K branch below

    if SPLIT_K == 1:
        _epilogue(acc, acc_up, out_ptr, res_ptr, offs_m, offs_n, M, N_OUT, stride_om, stride_rm, limit,
                  Y_DTYPE, HAS_RES, SWIGLU, HAS_LIMIT, INTERPRET)
    else:
        # part [SPLIT_K, M, N_ROWS] fp32, N_ROWS = N_OUT (2 * N_OUT for SwiGLU, up partials at N_OUT + n).
        n_rows = N_OUT * 2 if SWIGLU else N_OUT
        pm = (offs_m < M)[:, None] & (offs_n < N_OUT)[None, :]
        part = part_ptr + offs_m[:, None] * n_rows + offs_n[None, :]
        tl.store(part + pid_k * M * n_rows, acc, mask=pm)
        if SWIGLU:
            tl.store(part + pid_k * M * n_rows + N_OUT, acc_up, mask=pm)
        tl.debug_barrier()  # every thread's partial is issued before the release below
        arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == SPLIT_K - 1:
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            acc_up = acc
            for s in tl.static_range(SPLIT_K):  # fixed order: the result does not depend on who came last
                acc += tl.load(part + s * M * n_rows, mask=pm, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(part + s * M * n_rows + N_OUT, mask=pm, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            _epilogue(acc, acc_up, out_ptr, res_ptr, offs_m, offs_n, M, N_OUT, stride_om, stride_rm, limit,
                      Y_DTYPE, HAS_RES, SWIGLU, HAS_LIMIT, INTERPRET)


def supports(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, swiglu: bool = False) -> bool:
    """Whether the Triton path takes this call: CUDA or interpreter-resident tensors of one float dtype,
    at most MAX_M rows, the residual (if any) shaped like the output."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        return False
    if norm_weight is not None and (norm_weight.dtype != x.dtype or norm_weight.shape != (x.shape[-1],)):
        return False
    if x.numel() // x.shape[-1] > MAX_M or (swiglu and weight.shape[0] % 2):
        return False
    if residual is not None:
        n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
        if residual.shape != (*x.shape[:-1], n_out) or not residual.dtype.is_floating_point:
            return False
    return True


def _launch(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
            residual: torch.Tensor | None, swiglu: bool, limit: float, config: LinearConfig | None,
            use_pdl: bool | None) -> torch.Tensor:
    k = x.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m = x2.shape[0]
    assert 1 <= m <= MAX_M, f"linear_fwd takes 1..{MAX_M} rows, got {m}"
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    out_dtype = x.dtype if residual is None else torch.promote_types(residual.dtype, x.dtype)
    out = torch.empty((m, n_out), dtype=out_dtype, device=x.device)  # [M, N_out]
    res2 = out
    if residual is not None:
        res2 = residual.reshape(m, n_out)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
    cfg = config or pick_config(m, n_out, k, swiglu)
    use_dot = m > 1 and cfg.dot
    block_m = 16 if use_dot else _pow2_at_least(m)
    if use_dot:
        assert cfg.block_n >= 16 and cfg.block_k >= 16, "tl.dot needs BLOCK_N, BLOCK_K >= 16"
    n_blocks = triton.cdiv(n_out, cfg.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), cfg.block_k) * cfg.block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k > 1 and n_blocks > NUM_COUNTERS:
        split_k, k_per_split = 1, triton.cdiv(k, cfg.block_k) * cfg.block_k
    if split_k > 1:
        part = torch.empty((split_k, m, weight.shape[0]), dtype=torch.float32, device=x.device)  # [S, M, N_rows]
        counters = _split_counters(x.device)
    else:
        part = counters = out  # unused
    pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    extra = {"launch_pdl": True} if pdl else {}
    linear_kernel[(n_blocks, split_k)](
        x2, weight, x2 if norm_weight is None else norm_weight, res2, out, part, counters,
        m, n_out,
        x2.stride(0), weight.stride(0), res2.stride(0), out.stride(0),
        float(eps), float(limit),
        K=k, K_PER_SPLIT=k_per_split, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        STATS_BK=min(_pow2_at_least(k), 8192 // block_m),
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, SWIGLU=swiglu, HAS_LIMIT=limit > 0,
        USE_DOT=use_dot, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        INTERPRET=env.triton_interpret(),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )
    return out.reshape(*x.shape[:-1], n_out)


def linear_fwd(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               residual: torch.Tensor | None = None, config: LinearConfig | None = None,
               use_pdl: bool | None = None) -> torch.Tensor:
    """``[residual +] (rms_norm(x) if norm_weight else x) @ weight.T``. x [M, K] (M <= 16), weight [N, K] -> [M, N].
    ``config`` overrides the table; ``use_pdl`` overrides ``pdl_enabled()``."""
    return _launch(x, weight, norm_weight, eps, residual, False, 0.0, config, use_pdl)


def linear_swiglu_fwd(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, limit: float = 0.0, config: LinearConfig | None = None,
                      use_pdl: bool | None = None) -> torch.Tensor:
    """``swiglu((rms_norm(x) if norm_weight else x) @ weight.T, limit)``; weight [2I, K] holds gate rows then up
    rows. x [M, K] (M <= 16) -> [M, I]."""
    return _launch(x, weight, norm_weight, eps, None, True, limit, config, use_pdl)


def linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature and result as ``naive.linear``."""
    return linear_fwd(x, weight, norm_weight, eps, residual)


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  limit: float = 0.0) -> torch.Tensor:
    """Same signature and result as ``naive.linear_swiglu``."""
    return linear_swiglu_fwd(x, weight, norm_weight, eps, limit)
