"""Triton decode-shape projections (x [M, K] with M = 1..32, weight [N, K] in x's dtype or fp8 e4m3 with 128 x 128
block scales) with the fusions of ``naive.py``: an RMSNorm prologue, a residual-add epilogue, and a SwiGLU epilogue
over fused gate/up rows. ``baton.ops.fp8_linear.triton.fp8_dense`` is this kernel on an fp8 weight.

Design (bandwidth-bound at batch 1; every weight byte is read exactly once):

- grid = (cdiv(N_out, BLOCK_N), SPLIT_K). A program owns BLOCK_N output columns (for SwiGLU: BLOCK_N gate rows
  and the matching BLOCK_N up rows) and one K range, which it walks in BLOCK_K chunks, contiguous along K, so each
  thread issues 16-byte loads. Rows past N are clamped to N - 1 (loads stay unmasked and vectorised; the extra
  columns are never stored).
- Four forms (``LinearConfig``):
  - GEMV (M == 1): broadcast multiply into a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced over K once at the end;
    weight tiles loaded one chunk ahead (a register double buffer).
  - rows (``dot=False``, a few rows): each chunk's row-times-tile products reduced over K, same look-ahead.
  - per-row (``dot=False, per_row=True``, a few rows): the GEMV form row by row over the chunk's tile (widened
    once), each row's chunk loaded and normalised on its own and reduced over K at once: registers of one row, and
    a whole-K chunk (BLOCK_K >= K: no loop) for the short K of small models, where the dot forms pay a pipeline's
    ramp and a split-K's second pass for a few KB of weights per program.
  - dot (``dot=True``): ``tl.dot`` of the rows padded to 16 (32 past 16 rows) times the tile, same look-ahead.
  - swap (``dot=True, swap=True``): ``tl.dot(tile, rows.T)``, the weight tile as the MMA's wide side (BLOCK_N >= 64
    takes Hopper's wgmma) and the padded rows as its narrow one; with ``num_stages`` > 1 no register look-ahead:
    the loads are software-pipelined by the compiler through shared memory (``num_stages`` deep); with 1 the
    look-ahead of the other forms (16-byte loads straight into registers, as fp8 tiles want).
- fp8 weights: the [BLOCK_N, BLOCK_K] tile is widened in registers and its block scale applied per chunk (BLOCK_K
  divides 128, so a chunk lies in one scale column; a GEMV chunk wider than 128 takes a scale per column): one
  scalar when the tile's rows share a scale row, else one per row (``row_block``: a fused weight whose parts are
  quantised each on its own and are not 128-row aligned). The GEMV widens to fp32 (e4m3 -> f16x2 in one
  conversion, then exact f16 -> f32); the swap form widens to the activations' dtype, or with ``f16=True`` to
  fp16 (one conversion per two weights, where bf16 takes three), the activation chunk scaled per row by a power
  of two into fp16's range first (exact: bf16 values have fewer mantissa bits than fp16) and the product scaled
  back.
- w8a8 (``act_fp8``, fp8 weights): the prologue's output is quantised in registers per (row, 128-column group) to
  e4m3 with power-of-two scales (``baton.ops.quant.triton.quant_e4m3_rows``, the bits of
  ``baton.ops.quant.fp8.quantize_act_e4m3``, as the MoE's w8a8 kernels do) and the swap form's
  ``tl.dot`` takes e4m3 on both sides (Hopper's fp8 wgmma, fp32 accumulation): the weight tile goes from its
  (pipelined) load to the MMA with no per-weight conversion; each chunk (BLOCK_K = 128, one group) is a fresh dot
  scaled by the weight block scale(s) times each row's group scale in fp32. One row (M = 1) takes the swap form
  too, padded to 16. Configs: the fp8 table's ``"act": "fp8"`` entries (kinds "m1", "m4" .. "m32").
- RMSNorm prologue: each program recomputes the row statistics from x (K <= ~8192, x stays in L2), then
  normalises each x chunk exactly as ``rms_norm`` does: fp32 ``x * rsqrt(mean(x^2) + eps)``, rounded to x's
  dtype, times ``norm_weight``, rounded again.
- Epilogues replicate the reference's roundings: the GEMM result is rounded to x's dtype first, then SwiGLU
  (SiLU rounded, clamp, product rounded) or the residual add (``residual + y``, rounded to the result dtype).
- Split-K (short N, long K, where cdiv(N, BLOCK_N) programs cannot fill 132 SMs): each split writes its fp32
  partial [M, BLOCK_N] to a workspace, then increments a per-column-block counter; the program that arrives
  last sums the SPLIT_K partials in a fixed order (split 0, 1, ...: deterministic, whichever program comes
  last), applies the epilogue, stores, and resets its counter to zero for the next launch. The counters are one
  persistent int32 buffer per device, so the first call with split-K on a device must come before CUDA-graph
  capture (the engine warms up before capturing).
- PDL (``USE_PDL``): the first weight tile is requested before ``gdc_wait`` (weights never depend on the
  previous kernel), and with ``prefetch`` the first bytes of each of the program's rows are prefetched into L2
  (``cp.async.bulk.prefetch``) as well; x, the residual, the outputs, the workspace and the counters are touched
  only after it. ``gdc_launch_dependents`` follows straight away so the next kernel's programs can land on SMs as
  ours drain.

Configs come from a per-GPU table (``tuned/<gpu>.json`` here for bf16 / fp16 / fp32 weights,
``baton/ops/fp8_linear/tuned/<gpu>.json`` for fp8) keyed by (row bucket, N_out, K, swiglu); an entry may say
``cublas``: that shape and bucket then runs the reference (cuBLAS ``F.linear`` and the unfused ops), which
``supports`` reports by returning False.
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
from baton.ops.quant.triton import fp16_range, quant_e4m3_rows

__all__ = [
    "LaunchPlan",
    "LinearConfig",
    "launch_plan",
    "linear",
    "linear_fwd",
    "linear_swiglu",
    "linear_swiglu_fwd",
    "pdl_enabled",
    "pick_config",
    "supports",
]

# Rows one launch takes: decode 1, a NEXTN verify 6, a DSpark verify of gamma 16 is 17; larger M goes to cuBLAS.
MAX_M = 32
NUM_SMS = 132  # H200
NUM_COUNTERS = 16384  # split-K column blocks per device (one int32 each)
SB = 128  # fp8 block-scale size (baton.ops.quant.fp8.BLOCK)

# Kernel forms (constexpr FORM) and fp8 scale modes (constexpr S_MODE).
GEMV, ROWS, DOT, SWAP, PER_ROW = 0, 1, 2, 3, 4
S_NONE, S_SCALAR, S_KVEC, S_ROWVEC = 0, 1, 2, 3


@dataclass(frozen=True)
class LinearConfig:
    """Launch parameters; the tuning sweep varies these. ``block_n`` counts output columns (for SwiGLU the
    program reads 2 * block_n weight rows). With M > 1 and ``dot`` ``block_n`` and ``block_k`` must be >= 16.

    ``swap`` (M > 1 with ``dot``): the swap-AB form, loads pipelined ``num_stages`` deep (1: register look-ahead).
    ``f16`` (fp8 weights, swap form, bf16 / fp16 rows): the MMA in fp16. ``prefetch``: bytes of each of the
    program's weight rows prefetched into L2 before the PDL wait (0: none). ``cublas``: not a Triton launch at all;
    the dispatch runs the reference (cuBLAS) for this shape and bucket. ``bits`` (fp8 weights, GEMV and rows
    forms): widen the weights by moving bits instead of conversion instructions. ``tma`` (swap form with
    ``num_stages`` > 1, Hopper+): the weight tiles come through a tensor descriptor (the copy engine, into shared
    memory, the compiler's pipeline ``num_stages`` deep) instead of per-thread loads. ``per_row`` (M > 1,
    ``dot=False``): each chunk's weight tile widened once and reduced against each row in turn (its chunk loaded on
    its own), so a verify's few rows cost the GEMV's registers, not a [rows, BLOCK_N, BLOCK_K] product's.
    ``fold`` (fp8 weights, swap form with ``f16``, a tile inside one 128-row scale block): each chunk's weight block
    scale multiplies the rows, not the product, with one power of two per row for the whole K range (from a bound
    on |rows| x the largest scale), so every chunk's MMA accumulates in place (no wait for each chunk's product)
    and the rows reach the MMA rounded once to fp16 (11 bits; bf16 rows have 8). ``pre`` (fp8 weights, swap form,
    bf16 / fp16 rows): the rows' prologue (RMSNorm, then a power of two per row into fp16's range: exact for bf16
    rows) runs once, in ``rows_f16_kernel`` (one program a row), not in every chunk of every program; the GEMM
    streams fp16 rows against the weight tiles widened by the packed e4m3 -> fp16 conversion alone, and its epilogue
    multiplies each row back by its power of two before the roundings. Two launches instead of one."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 1
    dot: bool = True  # M > 1: tl.dot over 16 padded rows; False: the GEMV form over next_pow2(M) rows
    swap: bool = False
    f16: bool = False
    prefetch: int = 0
    cublas: bool = False
    bits: bool = False
    tma: bool = False  # swap form, num_stages > 1: weight tiles through the tensor-memory accelerator (Hopper+)
    per_row: bool = False  # M > 1 with dot=False: the GEMV form once per row over the same weight tile
    fold: bool = False  # fp8, swap form with f16 and one scale row a tile: the block scales folded into the rows
    pre: bool = False  # fp8, swap form (M > 1): the rows' prologue in a kernel of its own (rows_f16_kernel)


# Measured winners, (kind, N_out, K, swiglu) -> config. Kind "gemv" is M == 1; "m4", "m8", "m16", "m32" are the
# row buckets M = 2..4, 5..8, 9..16, 17..32; "dot" (M = 2..32, tl.dot) is what a bucket without an entry falls
# back to, and what tables written before the buckets hold. Entries set here take precedence; the rest come from
# the table of the current GPU (``tuned/<gpu name>.json``, written by ``benchmarks/bench_decode_gemm.py --tune
# --write-table``). Shapes in neither take ``_heuristic_config``. A bucket entry may choose ``dot=False``: the
# verify's rows then take the GEMV form with every row in registers.
ROW_BUCKETS = (4, 8, 16, 32)
TUNED: dict[tuple[str, int, int, bool], LinearConfig] = {}
TUNED_FP8: dict[tuple[str, int, int, bool], LinearConfig] = {}
TUNED_W8A8: dict[tuple[str, int, int, bool], LinearConfig] = {}  # fp8 weights, fp8 activations (kinds m1, m4..m32)
TUNED_DIR = Path(__file__).with_name("tuned")
TUNED_FP8_DIR = Path(__file__).parents[1] / "fp8_linear" / "tuned"


def table_path(device_name: str, directory: Path | None = None) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return (TUNED_DIR if directory is None else directory) / f"{slug}.json"


def read_table(path: Path, act_fp8: bool = False) -> dict[tuple[str, int, int, bool], LinearConfig]:
    """The table's entries of one activation mode: w8a16 / plain (entries without ``"act"``), or with
    ``act_fp8`` the w8a8 ones (``"act": "fp8"``, fp8 table only; kinds "m1" and the row buckets "m4" .. "m32")."""
    with open(path) as f:
        data = json.load(f)
    return {(e["kind"], int(e["n_out"]), int(e["k"]), bool(e["swiglu"])): LinearConfig(**e["config"])
            for e in data["entries"] if (e.get("act") == "fp8") == act_fp8}


@functools.cache
def _device_table(device_name: str, fp8: bool = False,
                  act_fp8: bool = False) -> dict[tuple[str, int, int, bool], LinearConfig]:
    path = table_path(device_name, TUNED_FP8_DIR if fp8 else TUNED_DIR)
    return read_table(path, act_fp8) if path.is_file() else {}


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


def _fill_split(n_blocks: int, k: int, block_k: int, target: int = 2 * NUM_SMS, most: int = 8) -> int:
    """K splits that bring ``n_blocks`` column blocks to about ``target`` programs (1 when they already do)."""
    if n_blocks >= target:
        return 1
    return max(1, min(most, k // block_k, triton.cdiv(target, n_blocks)))


def _heuristic_config(m: int, n_out: int, k: int, swiglu: bool, fp8: bool = False) -> LinearConfig:
    """Bucket rules for shapes no table names. M == 1: a tile of ~8K weight elements (64 per thread at 4 warps:
    eight 16-byte loads for bf16, ~190 registers with the look-ahead tile and the [BLOCK_N, BLOCK_K] accumulator),
    BLOCK_N shrunk until there are >= 2 programs per SM (fp8: one 128-column scale block per chunk). M > 1: the
    swap form, 64 columns by 128, four stages, K split when the column blocks alone leave SMs idle."""
    rows_per_col = 2 if swiglu else 1
    target = 2 * NUM_SMS
    if m == 1:
        if fp8:
            block_k = min(SB, _pow2_at_least(k))
        elif k <= 1024:
            block_k = _pow2_at_least(k)  # one chunk
        else:
            block_k = next((b for b in (1024, 512, 256) if k % b == 0), 512)
        block_n = max(2, min(64, 8192 // (block_k * rows_per_col)))
        while block_n > 2 and triton.cdiv(n_out, block_n) < target:
            block_n //= 2
        return LinearConfig(block_n, block_k, 1, 4, 1)
    block_k = 128 if k >= 128 else max(16, _pow2_at_least(k))
    block_n = 64 if n_out >= 64 * NUM_SMS // 2 else 32 if n_out >= 32 else 16
    split_k = _fill_split(triton.cdiv(n_out, block_n), k, block_k)
    return LinearConfig(block_n, block_k, split_k, 4, 4 if block_n * block_k <= 8192 else 3, True, True)


def _act8_heuristic(m: int, n_out: int, k: int, swiglu: bool) -> LinearConfig:
    """w8a8 without a table entry: the swap form, BLOCK_K one activation group (128), 128 columns (64, 32 for
    narrow shapes), four stages, K split until there are ~2 programs per SM."""
    block_n = 128 if n_out >= 128 * NUM_SMS else 64 if n_out >= 64 * 16 else 32
    split_k = _fill_split(triton.cdiv(n_out, block_n), k, SB)
    return LinearConfig(block_n, SB, split_k, 4, 4, True, True)


def table_kinds(m: int, act_fp8: bool = False) -> tuple[str, ...]:
    """The table kinds a call with ``m`` rows looks up, in order: its own, then (M > 1) the "dot" fallback.
    w8a8 (``act_fp8``, the fp8 table's ``"act": "fp8"`` entries): "m1" for one row, else its bucket, no fallback."""
    if m == 1:
        return ("m1",) if act_fp8 else ("gemv",)
    bucket = next(b for b in ROW_BUCKETS if m <= b) if m <= ROW_BUCKETS[-1] else ROW_BUCKETS[-1]
    return (f"m{bucket}",) if act_fp8 else (f"m{bucket}", "dot")


def pick_config(m: int, n_out: int, k: int, swiglu: bool = False, fp8: bool = False,
                act_fp8: bool = False, device_name: str | None = None) -> LinearConfig:
    """The config for x [m, k] and n_out output columns: a tuned entry if the shape has one, else the buckets.
    ``fp8``: the fp8 weights' table; ``act_fp8``: its w8a8 entries (always a swap-form config, BLOCK_K 128).
    ``device_name``: that GPU's tables instead of the current one's (tools that compile for a GPU they are not
    on)."""
    name = device_name or _current_device_name()
    table = _device_table(name, fp8) if name else {}
    tuned = TUNED_FP8 if fp8 else TUNED
    if act_fp8:
        table = _device_table(name, True, True) if name else {}
        for kind in table_kinds(m, True):
            cfg = TUNED_W8A8.get((kind, n_out, k, swiglu)) or table.get((kind, n_out, k, swiglu))
            if cfg is not None and cfg.dot and cfg.swap and cfg.block_k == SB and not cfg.cublas:
                return cfg
        return _act8_heuristic(m, n_out, k, swiglu)
    for kind in table_kinds(m):
        key = (kind, n_out, k, swiglu)
        cfg = tuned.get(key) or table.get(key)
        if cfg is not None and (cfg.dot or kind != "dot") and not (cfg.cublas and kind == "dot"):
            return cfg
    return _heuristic_config(m, n_out, k, swiglu, fp8)


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
def _prefetch_l2(ptrs, nbytes: tl.constexpr):
    """``cp.async.bulk.prefetch.L2``: ``nbytes`` from each address of ``ptrs`` (16-byte aligned) into L2."""
    addr = ptrs.to(tl.int64)
    size = tl.full(addr.shape, nbytes, tl.int32)
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;", "=r,l,r",
                              [addr, size], dtype=tl.int32, is_pure=False, pack=1)


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
              HAS_NORM: tl.constexpr, NEED_AMAX: tl.constexpr = False, k_lo=0, K_PER_SPLIT: tl.constexpr = 1):
    """RMSNorm's 1 / rms of each row of x (the prologue's statistics, over K in STATS_BK chunks; zeros without a
    norm) and, with NEED_AMAX, each row's max |x| (over K with a norm, else over the split's columns from
    ``k_lo``; zeros without)."""
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    amax = tl.zeros([BLOCK_M], dtype=tl.float32)
    if HAS_NORM:
        sumsq = tl.zeros([BLOCK_M], dtype=tl.float32)
        for c in tl.static_range(0, K, STATS_BK):
            offs_s = c + tl.arange(0, STATS_BK)
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_s[None, :],
                         mask=m_mask[:, None] & (offs_s < K)[None, :], other=0.0).to(tl.float32)
            sumsq += tl.sum(xs * xs, axis=1)
            if NEED_AMAX:
                amax = tl.maximum(amax, tl.max(tl.abs(xs), axis=1))
        rstd = tl.rsqrt(sumsq / K + eps)
    elif NEED_AMAX:
        for c in tl.static_range(0, K_PER_SPLIT, STATS_BK):
            offs_s = k_lo + c + tl.arange(0, STATS_BK)
            xs = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_s[None, :],
                         mask=m_mask[:, None] & (offs_s < K)[None, :], other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(xs), axis=1))
    return rstd, amax


@triton.jit
def _fold_scales(nw_ptr, s_base, amax, k_lo, k_hi, rstd, K_PER_SPLIT: tl.constexpr, STATS_BK: tl.constexpr,
                 SB: tl.constexpr, NS_P2: tl.constexpr, HAS_NORM: tl.constexpr):
    """FOLD: (down, up) [BLOCK_M], powers of two per row such that |prologue(x) x block scale| x down < 2^15 over
    the split's columns [k_lo, k_hi) (``s_base``: the tile's scale row): the bound ``amax`` (each row's max |x|)
    x rstd x max|norm weight| x 1.01 (the prologue's two roundings) x the split's largest scale (NS_P2: a power of
    two >= the scale columns a split can touch)."""
    bound = amax * 1.01
    if HAS_NORM:
        wmax = 0.0
        for c in tl.static_range(0, K_PER_SPLIT, STATS_BK):
            offs_s = k_lo + c + tl.arange(0, STATS_BK)
            nw = tl.load(nw_ptr + offs_s, mask=offs_s < k_hi, other=0.0).to(tl.float32)
            wmax = tl.maximum(wmax, tl.max(tl.abs(nw), axis=0))
        bound = bound * rstd * wmax
    cols = k_lo // SB + tl.arange(0, NS_P2)
    sc = tl.load(s_base + cols, mask=cols * SB < k_hi, other=0.0)
    return fp16_range(bound * tl.max(tl.abs(sc), axis=0))


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
def _load_s(s_base, k0, k_hi, BLOCK_K: tl.constexpr, SB: tl.constexpr, S_MODE: tl.constexpr):
    """The fp8 block scales of the chunk at k0: a scalar (S_SCALAR; ``s_base`` the tile's scale row), one per
    column (S_KVEC, a chunk wider than a scale block), or one per row (S_ROWVEC; ``s_base`` [BLOCK_N] pointers).
    Chunks past ``k_hi`` (the last split's empty ones) read nothing. No scales (S_NONE): 1."""
    if S_MODE == 0:
        s = 1.0
    elif S_MODE == 2:
        offs_k = k0 + tl.arange(0, BLOCK_K)
        s = tl.load(s_base + offs_k // SB, mask=offs_k < k_hi, other=0.0)
    else:
        s = tl.load(s_base + k0 // SB, mask=k0 < k_hi, other=0.0)
    return s


@triton.jit
def _e4m3_bits(w):
    """fp8 e4m3 -> fp32 by moving bits (sign to bit 31, exponent and mantissa to bits 20..26): the value times
    2^-120 for every finite code, subnormal ones included (integer ops only, no conversion instructions)."""
    u = w.to(tl.uint8, bitcast=True).to(tl.uint32)
    return (((u & 0x80) << 24) | ((u & 0x7F) << 20)).to(tl.float32, bitcast=True)


@triton.jit
def _act_quant(h, ACT_FP8: tl.constexpr, INTERPRET: tl.constexpr):
    """w8a8: the chunk [BLOCK_M, 128] (one 128-wide K group: BLOCK_K is 128) of prologue output quantised per row to
    e4m3 with a power-of-two scale (``quant_e4m3_rows``; the interpreter gets the e4m3 values in fp32). Returns
    (q, scale [BLOCK_M]); otherwise (h, 1)."""
    if ACT_FP8:
        if INTERPRET:
            q, sx = quant_e4m3_rows(h.to(tl.float32), False)
        else:
            q, sx = quant_e4m3_rows(h.to(tl.float32), True)
    else:
        q = h
        sx = 1.0
    return q, sx


@triton.jit
def _mac(acc, h, w, s, FORM: tl.constexpr, S_MODE: tl.constexpr, DOT_F16: tl.constexpr, BITS: tl.constexpr,
         DOT_PRECISION: tl.constexpr, INTERPRET: tl.constexpr, sx, ACT_FP8: tl.constexpr, FOLD: tl.constexpr = False,
         down=1.0):
    """One chunk into the accumulator. GEMV: acc [BLOCK_N, BLOCK_K] += the products (reduced after the loop);
    rows / dot: acc [BLOCK_M, BLOCK_N] += h @ w.T; swap: acc [BLOCK_N, BLOCK_M] += w @ h.T. ``s``: the fp8 chunk's
    scales (S_MODE), ignored for S_NONE. BITS (fp8, GEMV and rows forms): widen with ``_e4m3_bits`` and fold its
    2^120 into the scale. The interpreter's dot multiplies bf16 / fp16 bit patterns as integers, so there it runs on
    exact fp32 copies. FOLD (swap form, DOT_F16, S_SCALAR): ``down`` [BLOCK_M] is each row's power of two for the
    whole K range; the chunk's rows times scale times ``down``, rounded to fp16, accumulate in place (the caller
    multiplies the result by 1 / ``down``)."""
    if BITS:
        s = s * 1.329227995784916e36  # 2^120
    if FOLD:
        hs = (h.to(tl.float32) * (down * s)[:, None]).to(tl.float16)
        if INTERPRET:
            acc = tl.dot(w.to(tl.float32), tl.trans(hs.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(w.to(tl.float16), tl.trans(hs), acc)
    elif ACT_FP8:
        # w8a8 (swap form only): e4m3 tile x e4m3 rows -> fp32 on the MMA (wgmma / QGMMA), no per-weight widening;
        # the chunk's product times the weight block scale(s) and each row's activation group scale, in fp32
        if INTERPRET:
            part = tl.dot(w.to(tl.float32), tl.trans(h.to(tl.float32)), input_precision="ieee")
        else:
            part = tl.dot(w, tl.trans(h))
        if S_MODE == 3:
            acc += (part * s[:, None]) * sx[None, :]
        else:
            acc += part * (sx * s)[None, :]
    elif FORM == 0:
        if BITS:
            wf = _e4m3_bits(w)
        else:
            wf = w.to(tl.float32)
        hf = h.to(tl.float32)  # [1, BLOCK_K]
        if S_MODE == 1:
            acc = acc + wf * (hf * s)
        elif S_MODE == 2:
            acc = acc + wf * (hf * s[None, :])
        elif S_MODE == 3:
            acc = acc + (wf * s[:, None]) * hf
        else:
            acc = acc + wf * hf
    elif FORM == 1:
        hf = h.to(tl.float32)
        if S_MODE == 2:
            hf = hf * s[None, :]
        if BITS:
            wf = _e4m3_bits(w)
        else:
            wf = w.to(tl.float32)
        part = tl.sum(hf[:, None, :] * wf[None, :, :], axis=2)  # [BLOCK_M, BLOCK_N]
        if S_MODE == 1:
            part = part * s
        elif S_MODE == 3:
            part = part * s[None, :]
        acc = acc + part
    elif FORM == 2:
        if S_MODE == 0:
            if INTERPRET:
                acc = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(h, tl.trans(w), acc, input_precision=DOT_PRECISION)
        else:
            if INTERPRET or DOT_PRECISION == "ieee":
                part = tl.dot(h.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(h, tl.trans(w.to(h.dtype)))
            if S_MODE == 3:
                acc += part * s[None, :]
            else:
                acc += part * s
    else:
        if S_MODE == 0:
            if INTERPRET:
                acc = tl.dot(w.to(tl.float32), tl.trans(h.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(w, tl.trans(h), acc, input_precision=DOT_PRECISION)
        else:
            if DOT_F16:
                # each row of the chunk times 2^-e into [2^14, 2^15) at its largest: exact in fp16
                hf = h.to(tl.float32)
                down, up = fp16_range(tl.max(tl.abs(hf), axis=1))  # [BLOCK_M]
                hs = (hf * down[:, None]).to(tl.float16)
                if INTERPRET:
                    part = tl.dot(w.to(tl.float32), tl.trans(hs.to(tl.float32)), input_precision="ieee")
                else:
                    part = tl.dot(w.to(tl.float16), tl.trans(hs))
                part = part * up[None, :]
            elif INTERPRET or DOT_PRECISION == "ieee":
                part = tl.dot(w.to(tl.float32), tl.trans(h.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(w.to(h.dtype), tl.trans(h))
            if S_MODE == 3:
                acc += part * s[:, None]
            else:
                acc += part * s
    return acc


@triton.jit
def _mac_rows(acc, acc_up, x_ptr, nw_ptr, rstd, offs_m, offs_k, k_hi, stride_xm, M, w, w_up, s, s_u,
              BLOCK_M: tl.constexpr, SWIGLU: tl.constexpr, HAS_NORM: tl.constexpr, H_DTYPE: tl.constexpr,
              S_MODE: tl.constexpr, BITS: tl.constexpr, INTERPRET: tl.constexpr):
    """The per-row form's chunk: the tile (and the up tile) widened once; then for each row r < M its chunk,
    normalised exactly as ``_load_h`` does, reduced against it into row r of acc [BLOCK_M, BLOCK_N]. fp8 scales as
    the rows form (S_KVEC on the row's chunk, S_SCALAR / S_ROWVEC on the product)."""
    if BITS:
        wf = _e4m3_bits(w)
        s = s * 1.329227995784916e36  # 2^120
    else:
        wf = w.to(tl.float32)
    uf = wf
    if SWIGLU:
        if BITS:
            uf = _e4m3_bits(w_up)
            s_u = s_u * 1.329227995784916e36
        else:
            uf = w_up.to(tl.float32)
    k_mask = offs_k < k_hi
    if HAS_NORM:
        nw = tl.load(nw_ptr + offs_k, mask=k_mask, other=0.0).to(tl.float32)
    for r in tl.static_range(BLOCK_M):
        if r < M:
            x = tl.load(x_ptr + r * stride_xm + offs_k, mask=k_mask, other=0.0)
            if HAS_NORM:
                rs = tl.sum(tl.where(offs_m == r, rstd, 0.0), axis=0)
                y = _round(x.to(tl.float32) * rs, x.dtype, INTERPRET)
                h = _round(y * nw, H_DTYPE, INTERPRET)
            else:
                h = x.to(tl.float32)
            hg = h
            if S_MODE == 2:
                hg = h * s
            part = tl.sum(wf * hg[None, :], axis=1)  # [BLOCK_N]
            if S_MODE == 1 or S_MODE == 3:
                part = part * s
            acc = tl.where(offs_m[:, None] == r, acc + part[None, :], acc)
            if SWIGLU:
                hu = h
                if S_MODE == 2:
                    hu = h * s_u
                part_u = tl.sum(uf * hu[None, :], axis=1)
                if S_MODE == 1 or S_MODE == 3:
                    part_u = part_u * s_u
                acc_up = tl.where(offs_m[:, None] == r, acc_up + part_u[None, :], acc_up)
    return acc, acc_up


@triton.jit
def _epilogue(acc, acc_up, out_ptr, res_ptr, offs_m, offs_n, M, N_OUT, stride_om, stride_rm, limit,
              Y_DTYPE: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
              INTERPRET: tl.constexpr, ROW_UP: tl.constexpr = False, up_ptr=None):
    """Round the GEMM result to x's dtype as F.linear does, then SwiGLU or ``residual + y``; store [M, N_OUT].
    ROW_UP: the rows came pre-scaled (``rows_f16_kernel``): each row's power of two ``up_ptr[m]`` first (exact)."""
    OUT_DTYPE: tl.constexpr = out_ptr.dtype.element_ty
    if ROW_UP:
        rup = tl.load(up_ptr + offs_m, mask=offs_m < M, other=1.0)[:, None]
        acc = acc * rup
        acc_up = acc_up * rup
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
def rows_f16_kernel(x_ptr, nw_ptr, h_ptr, up_ptr, stride_xm, eps, K: tl.constexpr, BLOCK: tl.constexpr,
                    HAS_NORM: tl.constexpr, USE_PDL: tl.constexpr, INTERPRET: tl.constexpr):
    """``pre``: one program a row of x [M, K]: the prologue ``_load_h`` computes (RMSNorm with its two roundings to
    x's dtype, or x itself), then that row times 2^-e into [2^14, 2^15) at its largest, stored as fp16 ``h``
    [M, K] (exact for bf16 values above 2^-29 of the row's largest), and 2^e in ``up`` [M] fp32."""
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < K
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + row * stride_xm + offs, mask=mask, other=0.0)
    h = x.to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(h * h, axis=0) / K + eps)
        nw = tl.load(nw_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = _round(h * rstd, x.dtype, INTERPRET)
        h = _round(y * nw, x.dtype, INTERPRET)
    down, up = fp16_range(tl.max(tl.abs(h), axis=0))
    tl.store(h_ptr + row * K + offs, (h * down).to(tl.float16), mask=mask)
    tl.store(up_ptr + row, up)


@triton.jit
def linear_kernel(
    x_ptr, w_ptr, w_desc, s_ptr, rb_ptr, nw_ptr, res_ptr, out_ptr, part_ptr, count_ptr, up_ptr,
    M, N_OUT,
    stride_xm, stride_wn, stride_sn, stride_rm, stride_om,
    eps, limit,
    K: tl.constexpr, K_PER_SPLIT: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_BK: tl.constexpr,
    HAS_NORM: tl.constexpr, HAS_RES: tl.constexpr, SWIGLU: tl.constexpr, HAS_LIMIT: tl.constexpr,
    FORM: tl.constexpr, S_MODE: tl.constexpr, ROW_MAP: tl.constexpr, SB: tl.constexpr, DOT_F16: tl.constexpr,
    BITS: tl.constexpr, PREFETCH: tl.constexpr, LOOKAHEAD: tl.constexpr, DOT_PRECISION: tl.constexpr,
    USE_PDL: tl.constexpr, INTERPRET: tl.constexpr, ACT_FP8: tl.constexpr = False, W_TMA: tl.constexpr = False,
    FOLD: tl.constexpr = False, NS_P2: tl.constexpr = 1, ROW_UP: tl.constexpr = False, ROW_DTYPE: tl.constexpr = None,
):
    """out[M, N_OUT] = epilogue(prologue(x) @ dequantise(w).T). w has N_OUT rows (2 * N_OUT for SwiGLU: gate then
    up); fp8 (S_MODE > 0) with scales ``s_ptr`` [row blocks, cdiv(K, SB)] and, with ROW_MAP, each row's scale row
    ``rb_ptr[row]``."""
    # ROW_UP: x is the fp16 rows of ``rows_f16_kernel`` (each row times its 2^-e); the result is rounded to the
    # original activations' dtype, ROW_DTYPE, after the rows' 2^e (``up_ptr``)
    Y_DTYPE: tl.constexpr = ROW_DTYPE if ROW_UP else x_ptr.dtype.element_ty
    H_DTYPE: tl.constexpr = x_ptr.dtype.element_ty if S_MODE > 0 else w_ptr.dtype.element_ty
    K_MASK: tl.constexpr = (K % BLOCK_K != 0) or (K_PER_SPLIT % BLOCK_K != 0)
    N_CHUNKS: tl.constexpr = K_PER_SPLIT // BLOCK_K  # the last split may run a few empty (fully masked) chunks
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

    # Weights never depend on the previous kernel: request the first tile (and prefetch more) before waiting.
    if PREFETCH > 0:
        _prefetch_l2(w_ptr + row_off + k_lo, PREFETCH)
        if SWIGLU:
            _prefetch_l2(w_ptr + up_off + k_lo, PREFETCH)
    if W_TMA:  # rows past the weight's end and columns past K arrive as zeros
        w = w_desc.load([pid_n * BLOCK_N, k_lo])  # [BLOCK_N, BLOCK_K]
        w_up = w
        if SWIGLU:
            w_up = w_desc.load([pid_n * BLOCK_N + N_OUT, k_lo])
    else:
        w = _load_w(w_ptr, row_off, k_lo, k_hi, BLOCK_K, K_MASK)  # [BLOCK_N, BLOCK_K]
        w_up = w
        if SWIGLU:
            w_up = _load_w(w_ptr, up_off, k_lo, k_hi, BLOCK_K, K_MASK)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    rstd, amax = _row_rstd(x_ptr, offs_m, m_mask, stride_xm, K, eps, BLOCK_M, STATS_BK, HAS_NORM, FOLD, k_lo,
                           K_PER_SPLIT)

    # fp8 scales: the tile's scale row (scalar / per-column modes) or each row's (per-row mode)
    if S_MODE == 3:
        if ROW_MAP:
            s_base = s_ptr + tl.load(rb_ptr + rows).to(tl.int64) * stride_sn
        else:
            s_base = s_ptr + (rows // SB) * stride_sn
        s_up = s_base
        if SWIGLU:
            if ROW_MAP:
                s_up = s_ptr + tl.load(rb_ptr + rows + N_OUT).to(tl.int64) * stride_sn
            else:
                s_up = s_ptr + ((rows + N_OUT) // SB) * stride_sn
    else:
        s_base = s_ptr + ((pid_n * BLOCK_N) // SB) * stride_sn
        s_up = s_ptr + ((pid_n * BLOCK_N + N_OUT) // SB) * stride_sn

    down = 1.0
    up = 1.0
    down_u = 1.0
    up_u = 1.0
    if FOLD:
        down, up = _fold_scales(nw_ptr, s_base, amax, k_lo, k_hi, rstd, K_PER_SPLIT, STATS_BK, SB, NS_P2, HAS_NORM)
        if SWIGLU:
            down_u, up_u = _fold_scales(nw_ptr, s_up, amax, k_lo, k_hi, rstd, K_PER_SPLIT, STATS_BK, SB, NS_P2,
                                        HAS_NORM)

    if FORM == 3:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif FORM == 0:
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = acc
    if not LOOKAHEAD:
        # The chunk loaded before the wait, then a plain loop that the compiler pipelines (num_stages).
        h = _load_h(x_ptr, nw_ptr, offs_m, k_lo + tl.arange(0, BLOCK_K), m_mask, k_hi, rstd, stride_xm, HAS_NORM,
                    H_DTYPE, INTERPRET)
        h, sx = _act_quant(h, ACT_FP8, INTERPRET)
        s0 = _load_s(s_base, k_lo, k_hi, BLOCK_K, SB, S_MODE)
        acc = _mac(acc, h, w, s0, FORM, S_MODE, DOT_F16, BITS, DOT_PRECISION, INTERPRET, sx, ACT_FP8, FOLD, down)
        if SWIGLU:
            su0 = _load_s(s_up, k_lo, k_hi, BLOCK_K, SB, S_MODE)
            acc_up = _mac(acc_up, h, w_up, su0, FORM, S_MODE, DOT_F16, BITS, DOT_PRECISION, INTERPRET, sx, ACT_FP8,
                            FOLD, down_u)
        for i in range(1, N_CHUNKS):
            k0 = k_lo + i * BLOCK_K
            if W_TMA:
                w = w_desc.load([pid_n * BLOCK_N, k0])
            else:
                w = _load_w(w_ptr, row_off, k0, k_hi, BLOCK_K, K_MASK)
            h = _load_h(x_ptr, nw_ptr, offs_m, k0 + tl.arange(0, BLOCK_K), m_mask, k_hi, rstd, stride_xm, HAS_NORM,
                        H_DTYPE, INTERPRET)
            h, sx = _act_quant(h, ACT_FP8, INTERPRET)
            s = _load_s(s_base, k0, k_hi, BLOCK_K, SB, S_MODE)
            acc = _mac(acc, h, w, s, FORM, S_MODE, DOT_F16, BITS, DOT_PRECISION, INTERPRET, sx, ACT_FP8, FOLD,
                           down)
            if SWIGLU:
                if W_TMA:
                    w_up = w_desc.load([pid_n * BLOCK_N + N_OUT, k0])
                else:
                    w_up = _load_w(w_ptr, up_off, k0, k_hi, BLOCK_K, K_MASK)
                s_u = _load_s(s_up, k0, k_hi, BLOCK_K, SB, S_MODE)
                acc_up = _mac(acc_up, h, w_up, s_u, FORM, S_MODE, DOT_F16, BITS, DOT_PRECISION, INTERPRET, sx, ACT_FP8,
                              FOLD, down_u)
        if FOLD:
            acc = acc * up[None, :]
            acc_up = acc_up * up_u[None, :]
        acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
        if SWIGLU:
            acc_up = tl.trans(acc_up)
        else:
            acc_up = acc
    else:
        for i in range(0, N_CHUNKS):
            k0 = k_lo + i * BLOCK_K
            w_next = _load_w(w_ptr, row_off, k0 + BLOCK_K, k_hi, BLOCK_K, K_MASK)  # look-ahead; zeros past k_hi
            if SWIGLU:
                w_up_next = _load_w(w_ptr, up_off, k0 + BLOCK_K, k_hi, BLOCK_K, K_MASK)
            if FORM == 4:
                s = _load_s(s_base, k0, k_hi, BLOCK_K, SB, S_MODE)
                s_u = s
                if SWIGLU:
                    s_u = _load_s(s_up, k0, k_hi, BLOCK_K, SB, S_MODE)
                acc, acc_up = _mac_rows(acc, acc_up, x_ptr, nw_ptr, rstd, offs_m, k0 + tl.arange(0, BLOCK_K), k_hi,
                                        stride_xm, M, w, w_up, s, s_u, BLOCK_M, SWIGLU, HAS_NORM, H_DTYPE, S_MODE,
                                        BITS, INTERPRET)
            else:
                h = _load_h(x_ptr, nw_ptr, offs_m, k0 + tl.arange(0, BLOCK_K), m_mask, k_hi, rstd, stride_xm,
                            HAS_NORM, H_DTYPE, INTERPRET)
                h, sx = _act_quant(h, ACT_FP8, INTERPRET)
                s = _load_s(s_base, k0, k_hi, BLOCK_K, SB, S_MODE)
                acc = _mac(acc, h, w, s, FORM, S_MODE, DOT_F16, BITS, DOT_PRECISION, INTERPRET, sx, ACT_FP8, FOLD,
                           down)
                if SWIGLU:
                    s_u = _load_s(s_up, k0, k_hi, BLOCK_K, SB, S_MODE)
                    acc_up = _mac(acc_up, h, w_up, s_u, FORM, S_MODE, DOT_F16, BITS, DOT_PRECISION, INTERPRET, sx,
                                  ACT_FP8, FOLD, down_u)
            w = w_next
            if SWIGLU:
                w_up = w_up_next
        if FORM == 0:
            acc = tl.sum(acc, axis=1)[None, :]  # [1, BLOCK_N]
            if SWIGLU:
                acc_up = tl.sum(acc_up, axis=1)[None, :]
            else:
                acc_up = acc  # same shape on both sides of the split-K branch below
        elif FORM == 3:
            if FOLD:
                acc = acc * up[None, :]
                acc_up = acc_up * up_u[None, :]
            acc = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
            if SWIGLU:
                acc_up = tl.trans(acc_up)
            else:
                acc_up = acc

    if SPLIT_K == 1:
        _epilogue(acc, acc_up, out_ptr, res_ptr, offs_m, offs_n, M, N_OUT, stride_om, stride_rm, limit,
                  Y_DTYPE, HAS_RES, SWIGLU, HAS_LIMIT, INTERPRET, ROW_UP, up_ptr)
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
            for sp in tl.static_range(SPLIT_K):  # fixed order: the result does not depend on who came last
                acc += tl.load(part + sp * M * n_rows, mask=pm, other=0.0, cache_modifier=".cg")
                if SWIGLU:
                    acc_up += tl.load(part + sp * M * n_rows + N_OUT, mask=pm, other=0.0, cache_modifier=".cg")
            tl.store(count_ptr + pid_n, 0)
            _epilogue(acc, acc_up, out_ptr, res_ptr, offs_m, offs_n, M, N_OUT, stride_om, stride_rm, limit,
                      Y_DTYPE, HAS_RES, SWIGLU, HAS_LIMIT, INTERPRET, ROW_UP, up_ptr)


def supports(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
             residual: torch.Tensor | None = None, swiglu: bool = False) -> bool:
    """Whether the Triton path takes this call: CUDA or interpreter-resident tensors of one float dtype,
    at most MAX_M rows, the residual (if any) shaped like the output, and no table entry that names cuBLAS for
    the shape."""
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1] or x.numel() == 0:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32) or weight.dtype != x.dtype:
        return False
    if norm_weight is not None and (norm_weight.dtype != x.dtype or norm_weight.shape != (x.shape[-1],)):
        return False
    m = x.numel() // x.shape[-1]
    if m > MAX_M or (swiglu and weight.shape[0] % 2):
        return False
    n_out = weight.shape[0] // 2 if swiglu else weight.shape[0]
    if residual is not None:
        if residual.shape != (*x.shape[:-1], n_out) or not residual.dtype.is_floating_point:
            return False
    return not pick_config(m, n_out, x.shape[-1], swiglu).cublas


def _scale_mode(fp8: bool, form: int, cfg_block_n: int, block_k: int, n_out: int, swiglu: bool,
                row_map: bool) -> int:
    if not fp8:
        return S_NONE
    if row_map or SB % cfg_block_n or (swiglu and n_out % SB):
        return S_ROWVEC
    if block_k > SB:
        return S_KVEC
    return S_SCALAR


def _weight_descriptor(weight: torch.Tensor, block_n: int, block_k: int):
    """A tensor descriptor of ``weight`` [rows, K] for [block_n, block_k] tiles, or None where TMA cannot take it
    (alignment, box sizes, a GPU before Hopper). Made per launch: a few Python attributes (a CUDA graph keeps the
    encoded descriptor it captured; the weight never moves)."""
    esize = weight.element_size()
    if (weight.data_ptr() % 16 or (weight.stride(0) * esize) % 16 or block_n > 256 or block_k > 256
            or block_k * esize < 16):
        return None
    if not env.triton_interpret() and _capability(weight.device.index or 0)[0] < 9:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(weight, shape=list(weight.shape), strides=[weight.stride(0), 1],
                            block_shape=[block_n, block_k])


def _launch(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
            residual: torch.Tensor | None, swiglu: bool, limit: float, config: LinearConfig | None,
            use_pdl: bool | None, scale: torch.Tensor | None = None,
            row_block: torch.Tensor | None = None, act_fp8: bool = False) -> torch.Tensor:
    """One launch of ``linear_kernel`` (``launch_plan``'s)."""
    plan = launch_plan(x, weight, norm_weight, eps, residual, swiglu, limit, config, use_pdl, scale, row_block,
                       act_fp8)
    if plan.pre is not None:
        grid, args, kwargs = plan.pre
        rows_f16_kernel[grid](*args, **kwargs)
    linear_kernel[plan.grid](*plan.args, **plan.kwargs)
    return plan.out.reshape(*x.shape[:-1], plan.out.shape[-1])


@dataclass(frozen=True)
class LaunchPlan:
    """What one call launches: the grid, ``linear_kernel``'s positional arguments and its keyword arguments
    (constexprs, ``num_warps``, ``num_stages``, ``launch_pdl``), and the output tensor [M, N_out] it writes.
    ``benchmarks/ops/sass_linear.py`` compiles the same plan for a GPU target without launching it."""

    grid: tuple[int, int]
    args: tuple
    kwargs: dict
    out: torch.Tensor
    pre: tuple | None = None  # ``pre`` configs: (grid, args, kwargs) of rows_f16_kernel, launched first


def launch_plan(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
                residual: torch.Tensor | None, swiglu: bool, limit: float, config: LinearConfig | None,
                use_pdl: bool | None, scale: torch.Tensor | None = None,
                row_block: torch.Tensor | None = None, act_fp8: bool = False) -> LaunchPlan:
    """The launch of ``linear_kernel`` for these operands; ``scale`` (fp32 [row blocks, cdiv(K, 128)]) marks an fp8
    weight; ``act_fp8`` (fp8 weights only): w8a8, the rows quantised per 128-column group in the prologue and the
    swap form's MMA in fp8 at every M (M = 1 too: the rows padded to 16), chunks of exactly one group
    (BLOCK_K = 128)."""
    fp8 = scale is not None
    assert fp8 or not act_fp8, "act_fp8 needs an fp8 weight"
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
    cfg = config or pick_config(m, n_out, k, swiglu, fp8, act_fp8)
    use_dot = (m > 1 or act_fp8) and cfg.dot
    form = (SWAP if cfg.swap else DOT) if use_dot else ((PER_ROW if cfg.per_row else ROWS) if m > 1 else GEMV)
    block_m = max(16, _pow2_at_least(m)) if use_dot else _pow2_at_least(m)
    block_k = cfg.block_k
    if act_fp8:
        assert form == SWAP and block_k == SB, "w8a8 takes the swap form with BLOCK_K = 128 (one activation group)"
    if fp8 and block_k > SB and (form in (DOT, SWAP) or row_block is not None or SB % cfg.block_n
                                 or (swiglu and n_out % SB)):
        block_k = SB  # these forms need a chunk inside one scale column
    if use_dot:
        assert cfg.block_n >= 16 and block_k >= 16, "tl.dot needs BLOCK_N, BLOCK_K >= 16"
    s_mode = _scale_mode(fp8, form, cfg.block_n, block_k, n_out, swiglu, row_block is not None)
    n_blocks = triton.cdiv(n_out, cfg.block_n)
    k_per_split = triton.cdiv(triton.cdiv(k, cfg.split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if split_k > 1 and n_blocks > NUM_COUNTERS:
        split_k, k_per_split = 1, triton.cdiv(k, block_k) * block_k
    if split_k > 1:
        part = torch.empty((split_k, m, weight.shape[0]), dtype=torch.float32, device=x.device)  # [S, M, N_rows]
        counters = _split_counters(x.device)
    else:
        part = counters = out  # unused
    pdl = pdl_enabled(x.device) if use_pdl is None else use_pdl
    prefetch = 0
    if cfg.prefetch and pdl and not env.triton_interpret():
        esize = weight.element_size()
        last = k - (split_k - 1) * k_per_split  # the shortest split's columns
        prefetch = min(cfg.prefetch, last * esize) // 16 * 16
        if weight.data_ptr() % 16 or (weight.stride(0) * esize) % 16 or (k_per_split * esize) % 16:
            prefetch = 0
    lookahead = not (form == SWAP and cfg.num_stages > 1)
    w_desc = _weight_descriptor(weight, cfg.block_n, block_k) if cfg.tma and not lookahead else None
    if w_desc is not None:
        prefetch = 0
    extra = {"launch_pdl": True} if pdl else {}
    rows = bool(fp8 and cfg.pre and form == SWAP and x.dtype in (torch.bfloat16, torch.float16) and not act_fp8)
    dot_f16 = bool(fp8 and cfg.f16 and form == SWAP and x.dtype != torch.float32 and not act_fp8 and not rows)
    fold = bool(dot_f16 and cfg.fold and s_mode == S_SCALAR)
    pre, up = None, out
    if rows:  # the prologue once (rows_f16_kernel), then the GEMM on its fp16 rows with no prologue of its own
        h16 = torch.empty((m, k), dtype=torch.float16, device=x.device)
        up = torch.empty((m,), dtype=torch.float32, device=x.device)
        block = _pow2_at_least(k)
        pre = ((m,), (x2, x2 if norm_weight is None else norm_weight, h16, up, x2.stride(0), float(eps)),
               dict(K=k, BLOCK=block, HAS_NORM=norm_weight is not None, USE_PDL=pdl,
                    INTERPRET=env.triton_interpret(), num_warps=8 if block > 2048 else 4, **extra))
        x2, norm_weight = h16, None
    args = (
        x2, weight, w_desc, out if scale is None else scale, out if row_block is None else row_block,
        x2 if norm_weight is None else norm_weight, res2, out, part, counters, up,
        m, n_out,
        x2.stride(0), weight.stride(0), 0 if scale is None else scale.stride(0), res2.stride(0), out.stride(0),
        float(eps), float(limit),
    )
    kwargs = dict(
        K=k, K_PER_SPLIT=k_per_split, SPLIT_K=split_k,
        BLOCK_M=block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k,
        STATS_BK=min(_pow2_at_least(k), 8192 // block_m),
        HAS_NORM=norm_weight is not None, HAS_RES=residual is not None, SWIGLU=swiglu, HAS_LIMIT=limit > 0,
        FORM=form, S_MODE=s_mode, ROW_MAP=row_block is not None, SB=SB, DOT_F16=dot_f16,
        BITS=bool(fp8 and cfg.bits and form in (GEMV, ROWS, PER_ROW)), PREFETCH=prefetch,
        LOOKAHEAD=lookahead,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", USE_PDL=pdl,
        INTERPRET=env.triton_interpret(), ACT_FP8=act_fp8, W_TMA=w_desc is not None, FOLD=fold,
        NS_P2=_pow2_at_least(triton.cdiv(k_per_split, SB) + 1) if fold else 1,
        ROW_UP=rows, ROW_DTYPE=(tl.bfloat16 if x.dtype == torch.bfloat16 else tl.float16) if rows else None,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
    )
    return LaunchPlan((n_blocks, split_k), args, kwargs, out, pre)


def linear_fwd(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               residual: torch.Tensor | None = None, config: LinearConfig | None = None,
               use_pdl: bool | None = None) -> torch.Tensor:
    """``[residual +] (rms_norm(x) if norm_weight else x) @ weight.T``. x [M, K] (M <= 32), weight [N, K] -> [M, N].
    ``config`` overrides the table; ``use_pdl`` overrides ``pdl_enabled()``."""
    return _launch(x, weight, norm_weight, eps, residual, False, 0.0, config, use_pdl)


def linear_swiglu_fwd(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None,
                      eps: float = 1e-6, limit: float = 0.0, config: LinearConfig | None = None,
                      use_pdl: bool | None = None) -> torch.Tensor:
    """``swiglu((rms_norm(x) if norm_weight else x) @ weight.T, limit)``; weight [2I, K] holds gate rows then up
    rows. x [M, K] (M <= 32) -> [M, I]."""
    return _launch(x, weight, norm_weight, eps, None, True, limit, config, use_pdl)


def linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """Same signature and result as ``naive.linear``."""
    return linear_fwd(x, weight, norm_weight, eps, residual)


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  limit: float = 0.0) -> torch.Tensor:
    """Same signature and result as ``naive.linear_swiglu``."""
    return linear_swiglu_fwd(x, weight, norm_weight, eps, limit)
