"""Decode-shape GEMMs at bandwidth (issue 22, item 2): every Ling-3.0-flash dense projection at M = 1..17 rows (decode,
the 6-row NEXTN verify, the 17-row DSpark verify), bf16 and fp8 weights, against the floor of streaming the weights
(+ fp8 scales) once at 4.2 TB/s.

    python benchmarks/bench_decode_gemm.py --json rows.json                     # what baton picks + the alternatives
    python benchmarks/bench_decode_gemm.py --tune --write-table --json rows.json
    python benchmarks/bench_decode_gemm.py ... --baseline DIR   # also an earlier commit's kernels and table

Each timing is a CUDA graph of back-to-back calls, each call on its own copy of the weights (at least 2 copies and
at least COLD_BYTES of them, several times the H200's 50 MB L2, so every call streams cold weights; x, the norm
weight and the residual stay warm, as in a step), PDL on as in production, 3 warm-up replays, the median of REPS
timed replays. Every timed implementation is first checked against an fp32 reference on the same random inputs
(relative Frobenius error; 1e-2 for bf16 activations, 6e-2 for ``torch._scaled_mm``, which quantises them to fp8).

Implementations (``impl`` in the rows):
- ``baton``: the production dispatch (``baton.ops.linear`` / ``baton.ops.fp8_linear``: the per-GPU table's config,
  or the reference when the table says ``cublas``, or when M is past the kernel's rows).
- ``before``: the same dispatch with the kernels and table of ``--baseline`` (the commit before this work).
- ``cublas``: ``F.linear(x, w)`` alone, no norm / epilogue (bf16 weights; for fp8 rows the bf16 weight, i.e. a
  dequantised cuBLAS baseline that reads twice the fp8 bytes).
- ``torch``: the reference path (``naive.py``: RMSNorm, cuBLAS, the epilogue as separate kernels; fp8: dequantise
  the weight, then that).
- ``scaled_mm``: fp8 only, ``torch._scaled_mm`` with 1x128 activation scales and the weight's 128x128 scales (the
  GEMM alone: the activation quantisation is done outside the timed graph; no fusions; not for row-mapped weights).
- ``tune:<config>``: ``--tune``'s candidates (``baton.ops.linear.triton.LinearConfig``).
- ``w8a8`` (fp8 only): the production dispatch with ``act_fp8=True`` (the rows quantised to e4m3 per 128 columns in
  the prologue, fp8 x fp8 MMAs; the fp8 table's ``"act": "fp8"`` entries); checked against the same fp32 reference
  (unquantised activations) with the tolerance of fp8 activations (6e-2). ``tune8:<config>``: its candidates.

``--tune-w8a8`` sweeps the w8a8 swap-form configs alone (M = 1 and 12 every candidate, M = 4, 6, 17 the best few);
with ``--write-table`` its winners become the fp8 table's w8a8 entries (kinds m1, m4 .. m32), every other entry kept.

``--tune`` sweeps configs per (shape, row bucket): M = 1 (the GEMV form), M = 12 (the swap-AB ``tl.dot`` form and
the older forms), then M = 4, 6 and 17 on the best of those; compiles run first in worker processes (Triton's
``warmup``, no launches, so they do not disturb the timings). ``--write-table`` writes the winners into
baton/ops/linear/tuned/<gpu>.json and baton/ops/fp8_linear/tuned/<gpu>.json (entries of other shapes stay); a
bf16 bucket whose winner is the reference path gets a ``cublas`` entry. The ``baton`` rows are then timed with the
new tables.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import dataclasses
import importlib.util
import json
import math
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BANDWIDTH = 4.2e12  # bytes/s: the H200's measured device-to-device copy rate (docs/performance.md)
COLD_BYTES = 256 * 2**20  # weight bytes cycled through per graph replay (the H200's L2 is 50 MB)
MIN_CALLS = 20  # calls per graph replay
REPS = 10
MS = (1, 2, 4, 6, 9, 12, 17)
EPS = 1e-6
TOL = {"bf16": 1e-2, "scaled_mm": 6e-2, "w8a8": 6e-2}


@dataclass(frozen=True)
class Shape:
    """One projection: weight [n, k] made of row ``parts`` (checkpoint tensors: fp8 quantises each on its own), its
    fusions, and whether the model has it in fp8 under ``--quantization fp8``."""

    name: str
    parts: tuple[int, ...]
    k: int
    norm: bool = False
    residual: bool = False
    swiglu: bool = False
    limit: float = 0.0
    fp8: bool = True
    note: str = ""

    @property
    def n(self) -> int:
        return sum(self.parts)

    @property
    def n_out(self) -> int:
        return self.n // 2 if self.swiglu else self.n


# Ling-3.0-flash at TP 1: d = 2560, 32 heads x 128 (KDA without LoRA), MLA q 32 x 192 + kv_a 512 + 64 + a head-wise
# gate (q_lora_rank is null: no q_a / q_b), experts 768 wide (one shared), 2 dense layers of 6144, vocab 157184.
SHAPES = [
    Shape("kda_in_proj", (4096,) * 5 + (32,), 2560, norm=True, note="KDA q|k|v|f|g|b, RMSNorm prologue"),
    Shape("o_proj", (2560,), 4096, residual=True, note="KDA o_proj = MLA dense (same shape), + residual"),
    Shape("mla_in_proj", (6144, 576, 32), 2560, norm=True, note="MLA q|kv_a|g; fp8 parts unaligned: a row map"),
    Shape("mla_kv_b", (8192,), 512, fp8=False, note="bf16 in the model; prefill only (decode absorbs it)"),
    Shape("shared_gate_up", (768, 768), 2560, swiglu=True, limit=7.0, note="shared expert, SwiGLU epilogue"),
    Shape("shared_down", (2560,), 768, note="shared expert down (its output joins the MoE combine)"),
    Shape("dense_gate_up", (6144, 6144), 2560, norm=True, swiglu=True, note="first 2 layers' MLP"),
    Shape("dense_down", (2560,), 6144, residual=True, note="first 2 layers' MLP, + residual"),
    Shape("eh_proj", (2560,), 5120, note="MTP layer"),
    Shape("router", (512,), 2560, fp8=False, note="bf16; the layer calls x @ w.t() (cuBLAS) today"),
    Shape("lm_head", (157184,), 2560, norm=True, fp8=False, note="bf16"),
]
# SmolLM2-135M-Instruct (the embedded model): d = 576, 9 heads + 3 KV heads of 64, MLP 1536, vocab 49152, bf16 only.
SMOL_SHAPES = [
    Shape("smol_qkv", (576, 192, 192), 576, norm=True, fp8=False, note="q|k|v, RMSNorm prologue"),
    Shape("smol_o", (576,), 576, residual=True, fp8=False, note="o_proj, + residual"),
    Shape("smol_gate_up", (1536, 1536), 576, norm=True, swiglu=True, fp8=False, note="MLP, SwiGLU epilogue"),
    Shape("smol_down", (576,), 1536, residual=True, fp8=False, note="MLP down, + residual"),
    Shape("smol_lm_head", (49152,), 576, norm=True, fp8=False, note="tied embedding"),
]
SHAPE_BY_NAME = {s.name: s for s in SHAPES + SMOL_SHAPES}
SHAPE_ORDER = [s.name for s in SHAPES + SMOL_SHAPES]


# ---- configs -------------------------------------------------------------------------------------------------

def _cfg(**kw):
    from baton.ops.linear.triton import LinearConfig

    return LinearConfig(**kw)


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _fill(n_blocks: int, k: int, block_k: int, target: int) -> int:
    if n_blocks >= target:
        return 1
    return max(1, min(16, k // block_k, math.ceil(target / n_blocks)))


def gemv_candidates(s: Shape, fp8: bool, old_table: dict | None = None) -> list:
    """M == 1: the GEMV form; tiles of 1K to 8K weight elements (small tiles keep registers low, so more programs
    per SM keep more bytes in flight), K split to fill the SMs; the earlier table's entry; fp8 also widening by
    moving bits."""
    rpc = 2 if s.swiglu else 1
    out = []
    row_map = fp8 and _row_map(s) is not None
    bks = (128,) if row_map else (128, 256, 512) if fp8 else (256, 512, 1024)
    tiles = (2048, 4096, 8192) if fp8 else (1024, 2048, 4096, 8192)
    for bk in bks:
        if bk > _pow2(s.k):
            continue
        for tile in tiles:
            bn = max(2, min(64, tile // (bk * rpc)))
            if fp8 and not row_map and bk > 128 and 128 % bn:
                continue
            nb = math.ceil(s.n_out / bn)
            for target in (264, 528):
                out.append(_cfg(block_n=bn, block_k=bk, split_k=_fill(nb, s.k, bk, target), num_warps=4,
                                num_stages=1, dot=False))
    old = (old_table or {}).get(("gemv", s.n_out, s.k, s.swiglu))
    if old is not None and not fp8:
        out.insert(0, _cfg(**{k: v for k, v in old.items() if k in ("block_n", "block_k", "split_k", "num_warps",
                                                                    "num_stages")}, dot=False))
    out = list(dict.fromkeys(out))
    if fp8:
        out += [dataclasses.replace(c, bits=True) for c in out if c.block_n * c.block_k * rpc == 4096][:3]
    return out


def swap_candidates(s: Shape, fp8: bool) -> list:
    """M > 1: the swap-AB tl.dot form (BLOCK_N >= 64 takes wgmma, narrower tiles mma.sync), loads pipelined 3-4
    deep (or, stages 1, the register look-ahead); K split to about one or two programs per SM; fp8 with the MMA in
    bf16 or fp16, and fp16 rows made once by their own kernel (``pre``). (``fold``, the block scales folded into
    the rows, measured 1.13x slower than the same tiles without it on an H100: not a candidate.)"""
    esize = 1 if fp8 else 2
    rpc = 2 if s.swiglu else 1
    tiles = [(64, 128, 4), (128, 128, 3), (128, 64, 4), (64, 128, 1), (128, 128, 1), (32, 128, 4),
             (16, 128, 4)] if fp8 else \
        [(64, 128, 4), (64, 256, 3), (128, 128, 3), (64, 64, 4), (128, 64, 4), (64, 128, 1), (32, 128, 4),
         (32, 256, 3), (16, 256, 4)]
    # two warpgroups over 128 / 256 rows: the rows' prologue (RMSNorm, the fp16 scaling) once for twice or four
    # times the weights of a 64-row tile (the sm_90 SASS of the K loop: benchmarks/ops/sass_linear.py)
    wide = [(128, 128, 4), (256, 128, 3), (128, 128, 1)] if fp8 else \
        [(128, 128, 1), (256, 128, 1), (256, 64, 3), (128, 128, 3)]
    out = []
    for bn, bk, st, nw in [t + (4,) for t in tiles] + [t + (8,) for t in wide]:
        if bk > _pow2(s.k):
            continue
        smem = st * (bn * bk * esize * rpc + 32 * bk * 2)
        if smem > 200 * 1024:
            continue
        nb = math.ceil(s.n_out / bn)
        for target in (132, 264):
            for f16 in ((False, True) if fp8 else (False,)):
                out.append(_cfg(block_n=bn, block_k=bk, split_k=_fill(nb, s.k, bk, target), num_warps=nw,
                                num_stages=st, dot=True, swap=True, f16=f16))
                if fp8 and not f16:  # the rows' prologue once, in a kernel of its own (LinearConfig.pre)
                    out.append(dataclasses.replace(out[-1], pre=True))
    return list(dict.fromkeys(out))


def _balanced_splits(n_blocks: int, k: int, block_k: int = 128, most: int = 16) -> list[int]:
    """The K splits whose program count fills whole waves best, for one and for two resident programs per SM
    (programs / (waves x slots), ties to the smaller split): the last wave of a grid barely over a multiple of the
    SMs is what a split can even out."""
    def eff(s: int, slots: int) -> float:
        progs = n_blocks * s
        return progs / (math.ceil(progs / slots) * slots)

    splits = range(1, max(1, min(most, k // block_k)) + 1)
    return [max(splits, key=lambda s: (round(eff(s, slots), 3), -s)) for slots in (132, 264)]


def w8a8_candidates(s: Shape, m17: bool = False) -> list:
    """w8a8: the swap form with BLOCK_K one activation group (128); 32..512 columns, loads pipelined 1 (register
    look-ahead) to 4 deep, 4 or 8 warps; K split to about one, two or four programs per SM, and the splits that fill
    whole waves best (``_balanced_splits``). ``m17``: the few tried at M = 17 (rows padded to 32: a compile of its
    own)."""
    rpc = 2 if s.swiglu else 1
    tiles = [(64, 4, 4), (64, 3, 4), (128, 4, 4), (128, 4, 8), (128, 3, 8), (256, 3, 8), (256, 4, 8), (256, 2, 8),
             (512, 2, 8), (32, 4, 4), (64, 1, 4), (128, 2, 8)]
    if m17:
        tiles = [(64, 4, 4), (128, 4, 4), (128, 3, 8), (256, 3, 8), (32, 4, 4), (64, 1, 4)]
    out = [] if not m17 else [_a8_default(s)]
    for bn, st, nw in tiles:
        if st * (bn * 128 * rpc + 32 * 128 * 2) > 200 * 1024:
            continue
        nb = math.ceil(s.n_out / bn)
        splits = [_fill(nb, s.k, 128, t) for t in ((264,) if m17 else (132, 264, 528))] + _balanced_splits(nb, s.k)
        for split in splits:
            out.append(_cfg(block_n=bn, block_k=128, split_k=split, num_warps=nw, num_stages=st, dot=True,
                            swap=True))
    return list(dict.fromkeys(out))


def _a8_default(s: Shape):
    from baton.ops.linear import triton as lt

    return lt._act8_heuristic(2, s.n_out, s.k, s.swiglu)


def legacy_candidates(s: Shape, fp8: bool, old_table: dict) -> list:
    """The look-ahead tl.dot form with the earlier table's configs (fp8: the earlier kernel's tiles), so a tune
    never loses them."""
    out = []
    for kind in ("m8", "m16", "dot"):
        c = old_table.get((kind, s.n_out, s.k, s.swiglu))
        if c is not None and c.get("dot", True):
            out.append(_cfg(**{k: v for k, v in c.items() if k in ("block_n", "block_k", "split_k", "num_warps",
                                                                    "num_stages")}))
    if not out:
        nb = math.ceil(s.n_out / 32)
        out.append(_cfg(block_n=32, block_k=128, split_k=_fill(nb, s.k, 128, 264), num_warps=4, num_stages=1))
    if fp8:
        out = [dataclasses.replace(c, block_k=min(c.block_k, 128)) for c in out]
        out += [_cfg(block_n=bn, block_k=128, split_k=1, num_warps=4, num_stages=2) for bn in (16, 32)]
    return list(dict.fromkeys(out))


def rows_candidates(s: Shape, fp8: bool, per_row: bool = False) -> list:
    """A few rows (M = 2..4) in the GEMV form (``dot=False``); ``per_row``: also the per-row form (the GEMV form
    row by row, any M) with the GEMV's tiles: whole-K chunks where K is short, K split to fill the SMs."""
    bk = 128 if fp8 else 256
    out = []
    for bn in (4, 8):
        nb = math.ceil(s.n_out / bn)
        out.append(_cfg(block_n=bn, block_k=bk, split_k=_fill(nb, s.k, bk, 264), num_warps=4, num_stages=1,
                        dot=False))
    if per_row:
        rpc = 2 if s.swiglu else 1
        row_map = fp8 and _row_map(s) is not None
        bks = (128,) if row_map else (128, 256, 512) if fp8 else (512, 1024, 2048)
        for bk in bks:
            if bk > 2 * _pow2(s.k) or (not fp8 and bk > _pow2(s.k) and bk != _pow2(s.k)):
                continue
            bk = min(bk, _pow2(s.k))
            for tile in (2048, 4096):
                bn = max(2, min(32, tile // (bk * rpc)))
                if fp8 and not row_map and bk > 128 and 128 % bn:
                    continue
                nb = math.ceil(s.n_out / bn)
                for target in (264, 528):
                    out.append(_cfg(block_n=bn, block_k=bk, split_k=_fill(nb, s.k, bk, target), num_warps=4,
                                    num_stages=1, dot=False, per_row=True))
    return list(dict.fromkeys(out))


def cfg_name(c) -> str:
    if c is None:
        return "default"
    form = ("prow" if c.per_row else "gemv") if not c.dot else "swap" if c.swap else "dot"
    extra = (f"-st{c.num_stages}" if c.swap or (c.dot and c.num_stages > 1) else "") + ("-f16" if c.f16 else "") \
        + ("-fold" if c.fold else "") \
        + ("-bits" if c.bits else "") + (f"-pf{c.prefetch}" if c.prefetch else "") + ("-tma" if c.tma else "") \
        + ("-pre" if c.pre else "")
    return f"{form}-{c.block_n}x{c.block_k}-s{c.split_k}-w{c.num_warps}{extra}"


# ---- weights, inputs, implementations ---------------------------------------------------------------------------

def _row_map(s: Shape):
    from baton.ops.quant import row_block_map

    return row_block_map(list(s.parts))


@dataclass
class Weights:
    bf16: list  # copies of the bf16 weight
    fp8: list  # copies of (q, scale_inv, row_block)
    w_float: torch.Tensor  # fp32 [n, k] (the reference's)
    bytes_bf16: int
    bytes_fp8: int


def make_weights(s: Shape, device: str, want_fp8: bool, copies: bool = True, empty: bool = False) -> Weights:
    """Random weights (``empty``: uninitialised ones, for compiling: nothing is launched to make them)."""
    from baton.ops.quant import part_blocks, quantize_fp8_parts

    if empty:
        wb = torch.empty(s.n, s.k, dtype=torch.bfloat16, device=device)
        fp8 = []
        if want_fp8 and s.fp8:
            rbl = _row_map(s)
            fp8 = [(torch.empty(s.n, s.k, dtype=torch.float8_e4m3fn, device=device),
                    torch.empty(part_blocks(list(s.parts)), -(-s.k // 128), dtype=torch.float32, device=device),
                    None if rbl is None else torch.tensor(rbl, dtype=torch.int32).to(device))]
        return Weights([wb], fp8, wb, 0, 0)
    gen = torch.Generator(device=device).manual_seed(s.n * 7 + s.k)
    w = torch.randn(s.n, s.k, generator=gen, device=device) * s.k**-0.5
    if s.swiglu:
        w = w * 4  # activations beyond the clamp, so the limit matters
    wb = w.to(torch.bfloat16)
    bytes_bf16 = wb.numel() * 2
    n_b = max(2, math.ceil(COLD_BYTES / bytes_bf16)) if copies else 1
    bf16 = [wb] + [wb.clone() for _ in range(n_b - 1)]
    fp8, bytes_fp8 = [], 0
    if want_fp8 and s.fp8:
        q, sc = quantize_fp8_parts(wb.float(), list(s.parts))
        rbl = _row_map(s)
        rb = None if rbl is None else torch.tensor(rbl, dtype=torch.int32, device=device)
        bytes_fp8 = q.numel() + sc.numel() * 4
        n_f = max(2, math.ceil(COLD_BYTES / bytes_fp8)) if copies else 1
        fp8 = [(q, sc, rb)] + [(q.clone(), sc.clone(), rb) for _ in range(n_f - 1)]
    return Weights(bf16, fp8, wb.float(), bytes_bf16, bytes_fp8)


def make_inputs(s: Shape, m: int, device: str, seed: int, empty: bool = False) -> dict:
    if empty:
        e = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device=device)  # noqa: E731
        return {"x": e(m, s.k), "nw": e(s.k) if s.norm else None, "res": e(m, s.n_out) if s.residual else None}
    gen = torch.Generator(device=device).manual_seed(seed)
    x = (torch.randn(m, s.k, generator=gen, device=device) * 2 + 0.1).to(torch.bfloat16)
    nw = (torch.rand(s.k, generator=gen, device=device) + 0.5).to(torch.bfloat16) if s.norm else None
    res = torch.randn(m, s.n_out, generator=gen, device=device).to(torch.bfloat16) if s.residual else None
    return {"x": x, "nw": nw, "res": res}


def reference(s: Shape, inp: dict, w: Weights, fp8: bool) -> torch.Tensor:
    """fp32: the naive path on fp32 copies (fp8: the weight dequantised to fp32)."""
    from baton.ops.fp8_linear import naive as fp8_naive
    from baton.ops.linear import naive

    x = inp["x"].float()
    nw = None if inp["nw"] is None else inp["nw"].float()
    res = None if inp["res"] is None else inp["res"].float()
    if fp8:
        q, sc, rb = w.fp8[0]
        if s.swiglu:
            return fp8_naive.fp8_dense_linear_swiglu(x, q, sc, rb, nw, EPS, s.limit)
        return fp8_naive.fp8_dense_linear(x, q, sc, rb, nw, EPS, res)
    if s.swiglu:
        return naive.linear_swiglu(x, w.w_float, nw, EPS, s.limit)
    return naive.linear(x, w.w_float, nw, EPS, res)


def _quant_rows_1x128(x: torch.Tensor):
    """x [M, K] -> (fp8 [M, K], fp32 scales [M, K/128]): per row and 128 columns, amax / 448."""
    m, k = x.shape
    g = x.float().view(m, k // 128, 128)
    sc = (g.abs().amax(-1).clamp(min=1e-12) / 448.0)
    q = (g / sc[..., None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(m, k)
    return q, sc


def impl_fn(impl: str, s: Shape, inp: dict, fp8: bool, mods: dict, cfg=None) -> Callable[[object], Callable]:
    """For ``impl``: a function of one weight copy returning the call to time."""
    from baton.ops import fp8_linear as fp8_ops
    from baton.ops import linear as ops
    from baton.ops.fp8_linear import naive as fp8_naive
    from baton.ops.linear import naive

    x, nw, res, lim = inp["x"], inp["nw"], inp["res"], s.limit
    if impl == "baton":
        if fp8:
            if s.swiglu:
                return lambda w: lambda: fp8_ops.fp8_dense_linear_swiglu(x, *w, nw, EPS, lim)
            return lambda w: lambda: fp8_ops.fp8_dense_linear(x, *w, nw, EPS, res)
        if s.swiglu:
            return lambda w: lambda: ops.linear_swiglu(x, w, nw, EPS, lim)
        return lambda w: lambda: ops.linear(x, w, nw, EPS, res)
    if impl == "w8a8":
        if s.swiglu:
            return lambda w: lambda: fp8_ops.fp8_dense_linear_swiglu(x, *w, nw, EPS, lim, act_fp8=True)
        return lambda w: lambda: fp8_ops.fp8_dense_linear(x, *w, nw, EPS, res, act_fp8=True)
    if impl == "tune8":
        from baton.ops.fp8_linear import triton as ft

        return lambda w: lambda: ft.fp8_dense(x, *w, nw, EPS, res, s.swiglu, lim, config=cfg, act_fp8=True)
    if impl == "torch":
        if fp8:
            if s.swiglu:
                return lambda w: lambda: fp8_naive.fp8_dense_linear_swiglu(x, *w, nw, EPS, lim)
            return lambda w: lambda: fp8_naive.fp8_dense_linear(x, *w, nw, EPS, res)
        if s.swiglu:
            return lambda w: lambda: naive.linear_swiglu(x, w, nw, EPS, lim)
        return lambda w: lambda: naive.linear(x, w, nw, EPS, res)
    if impl == "cublas":
        return lambda w: lambda: F.linear(x, w)
    if impl == "scaled_mm":
        xq, sa = _quant_rows_1x128(x)
        layouts = mods.setdefault("scaled_mm_layout", [None])

        def call(w):
            q, sc, _ = w
            variants = [(sa, sc.t()), (sa.t().contiguous().t(), sc.t()), (sa, sc.t().contiguous()),
                        (sa.t().contiguous().t(), sc.t().contiguous())]
            if layouts[0] is not None:
                variants = [variants[layouts[0]]]

            def run():
                return torch._scaled_mm(xq, q.t(), scale_a=variants[0][0], scale_b=variants[0][1],
                                        out_dtype=torch.bfloat16)
            if layouts[0] is None:
                err = None
                for i, (a, b) in enumerate(variants):
                    try:
                        torch._scaled_mm(xq, q.t(), scale_a=a, scale_b=b, out_dtype=torch.bfloat16)
                        layouts[0] = i
                        variants[:] = [(a, b)]
                        break
                    except Exception as e:  # noqa: BLE001 - report the last refusal
                        err = e
                else:
                    raise RuntimeError(f"torch._scaled_mm refused every scale layout: {err}")
            return run
        return call
    if impl == "before":
        old, old_fp8 = mods["before"], mods["before_fp8"]
        if fp8:
            def call_fp8(w):
                q, sc, rb = w
                if old_fp8.supports_dense(x, q, sc, rb, nw, res, s.swiglu):
                    return lambda: old_fp8.fp8_dense(x, q, sc, rb, nw, EPS, res, s.swiglu, lim)
                if s.swiglu:
                    return lambda: fp8_naive.fp8_dense_linear_swiglu(x, q, sc, rb, nw, EPS, lim)
                return lambda: fp8_naive.fp8_dense_linear(x, q, sc, rb, nw, EPS, res)
            return call_fp8

        def call_bf16(w):
            if old.supports(x, w, nw, res, s.swiglu):
                if s.swiglu:
                    return lambda: old.linear_swiglu_fwd(x, w, nw, EPS, lim)
                return lambda: old.linear_fwd(x, w, nw, EPS, res)
            if s.swiglu:
                return lambda: naive.linear_swiglu(x, w, nw, EPS, lim)
            return lambda: naive.linear(x, w, nw, EPS, res)
        return call_bf16
    if impl == "tune":
        from baton.ops.fp8_linear import triton as ft
        from baton.ops.linear import triton as lt

        if fp8:
            return lambda w: lambda: ft.fp8_dense(x, *w, nw, EPS, res, s.swiglu, lim, config=cfg)
        if s.swiglu:
            return lambda w: lambda: lt.linear_swiglu_fwd(x, w, nw, EPS, lim, config=cfg)
        return lambda w: lambda: lt.linear_fwd(x, w, nw, EPS, res, config=cfg)
    raise ValueError(impl)


# ---- timing ---------------------------------------------------------------------------------------------------

def graph_us(calls: list[Callable]) -> float:
    """Median µs per call of a CUDA graph running ``calls`` (one per weight copy) back to back, repeated to at least
    MIN_CALLS calls."""
    loops = max(1, math.ceil(MIN_CALLS / len(calls)))
    for c in calls:
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(loops):
            for c in calls:
                c()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    del graph
    return statistics.median(times) * 1e3 / (loops * len(calls))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    if not torch.isfinite(a).all():
        return float("inf")
    return ((a - b).norm() / b.norm()).item()


def measure(impl: str, s: Shape, m: int, fp8: bool, w: Weights, inp: dict, ref: torch.Tensor, mods: dict,
            cfg=None) -> dict:
    """One row: check against the reference, then time; failures are rows with ``error``."""
    from baton.ops.quant import dequantize_fp8_rows

    row = {"shape": s.name, "N": s.n, "N_out": s.n_out, "K": s.k, "M": m, "dtype": "fp8" if fp8 else "bf16",
           "impl": impl if cfg is None else f"{impl}:{cfg_name(cfg)}"}
    nbytes = w.bytes_fp8 if fp8 else w.bytes_bf16
    floor_us = nbytes / BANDWIDTH * 1e6
    row.update(bytes=nbytes, floor_us=round(floor_us, 3))
    if cfg is not None:
        row["config"] = dataclasses.asdict(cfg)
    copies = w.fp8 if fp8 and impl != "cublas" else w.bf16
    if impl == "cublas" and fp8:
        row["note"] = "bf16 weight (dequantised cuBLAS baseline)"
    try:
        make = impl_fn(impl, s, inp, fp8, mods, cfg)
        calls = [make(c) for c in copies]
        out = calls[0]()
        torch.cuda.synchronize()
        if impl == "scaled_mm":  # the GEMM alone, on the raw rows
            q, sc, rb = w.fp8[0]
            ref = inp["x"].float() @ dequantize_fp8_rows(q, sc, rb, torch.float32).t()
        if impl != "cublas":
            err = rel_err(out.float(), ref)
            tol = TOL["scaled_mm"] if impl == "scaled_mm" else TOL["w8a8"] if impl in ("w8a8", "tune8") \
                else TOL["bf16"]
            row.update(err=float(f"{err:.3g}"), ok=err < tol)
            if not err < tol:
                row["error"] = f"error {err:.3g} over {tol}"
                return row
        us = graph_us(calls)
        moved = w.bytes_bf16 if impl == "cublas" else nbytes
        row.update(us=round(us, 3), tbps=round(moved / us / 1e6, 3), x_floor=round(us / floor_us, 3))
    except Exception as e:  # noqa: BLE001 - a failing candidate is a row, not the end of the run
        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"
    return row


# ---- compile workers ------------------------------------------------------------------------------------------

class _WarmupOnly:
    """Stands in for a @triton.jit kernel: ``kernel[grid](...)`` compiles (``warmup``) and launches nothing."""

    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        return lambda *a, **kw: self.fn.warmup(*a, grid=grid, **kw)


def _load_baseline(directory: str | None) -> dict:
    mods: dict = {}
    if not directory:
        return mods
    d = Path(directory)
    for name, file, key in (("decode_gemm_baseline_linear", "linear_triton.py", "before"),
                            ("decode_gemm_baseline_fp8", "fp8_triton.py", "before_fp8")):
        spec = importlib.util.spec_from_file_location(name, d / file)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[key] = mod
    return mods


def _worker_init(baseline: str | None) -> None:
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    import torch as _torch

    from baton.ops.linear import triton as lt

    _torch.cuda.init()
    lt.linear_kernel = _WarmupOnly(lt.linear_kernel)
    lt._split_counters = lambda dev: _torch.empty(lt.NUM_COUNTERS, dtype=_torch.int32, device=dev)  # no memset
    mods = _load_baseline(baseline)
    if mods:
        old, old_fp8 = mods["before"], mods["before_fp8"]
        old.linear_kernel = _WarmupOnly(old.linear_kernel)
        old._split_counters = lambda dev: _torch.empty(old.NUM_COUNTERS, dtype=_torch.int32, device=dev)
        old_fp8.fp8_dense_kernel = _WarmupOnly(old_fp8.fp8_dense_kernel)
    globals()["_WORKER_MODS"] = mods


def _compile_group(name: str, fp8: bool, jobs: list[tuple[int, str, dict | None]],
                   device: str = "cuda") -> list[str | None]:
    """Compile ``jobs`` [(m, impl, config dict)] of one shape and dtype; returns an error (or None) per job. Jobs
    that would run the reference (cuBLAS) instead of a Triton kernel are skipped: workers launch nothing."""
    s = SHAPE_BY_NAME[name]
    w = make_weights(s, device, fp8, copies=False, empty=True)
    mods = globals().get("_WORKER_MODS", {})
    errors = []
    for m, impl, cfg in jobs:
        if impl == "before" and not fp8 and m > mods["before"].MAX_M:
            errors.append(None)
            continue
        inp = make_inputs(s, m, device, 0, empty=True)
        try:
            c = None if cfg is None else _cfg(**cfg)
            impl_fn(impl, s, inp, fp8, mods, c)(w.fp8[0] if fp8 else w.bf16[0])()
            errors.append(None)
        except Exception as e:  # noqa: BLE001
            errors.append(f"{type(e).__name__}: {str(e)[:200]}")
    return errors


# ---- the run --------------------------------------------------------------------------------------------------

@dataclass
class Plan:
    shape: Shape
    fp8: bool
    gemv: list
    swap: list
    legacy: list
    rows: list
    w8a8: list = dataclasses.field(default_factory=list)
    w8a8_m17: list = dataclasses.field(default_factory=list)


def _old_table(path: Path) -> dict:
    if not path.is_file():
        return {}
    return {(e["kind"], e["n_out"], e["k"], e["swiglu"]): e["config"] for e in json.loads(path.read_text())["entries"]}


def _with_tma(cfgs: list) -> list:
    """``cfgs`` and, for each pipelined swap-form one, the same tiles with the weights through a tensor descriptor."""
    return cfgs + [dataclasses.replace(c, tma=True) for c in cfgs if c.dot and c.swap and c.num_stages > 1]


def make_plans(shapes: list[Shape], dtypes: list[str], tune: bool, baseline: str | None,
               tune_w8a8: bool = False, tma: bool = False, per_row: bool = False) -> list[Plan]:
    old = _old_table(Path(baseline) / "tuned" / "nvidia-h200.json") if baseline else {}
    plans = []
    for s in shapes:
        for dt in dtypes:
            fp8 = dt == "fp8"
            if fp8 and not s.fp8:
                continue
            a8 = w8a8_candidates(s) if tune_w8a8 and fp8 else []
            a8_17 = w8a8_candidates(s, m17=True) if tune_w8a8 and fp8 else []
            swap = swap_candidates(s, fp8) if tune else []
            if tma:
                a8, a8_17, swap = _with_tma(a8), _with_tma(a8_17), _with_tma(swap)
            if tune:
                plans.append(Plan(s, fp8, gemv_candidates(s, fp8, old), swap,
                                  legacy_candidates(s, fp8, old), rows_candidates(s, fp8, per_row), a8, a8_17))
            else:
                plans.append(Plan(s, fp8, [], [], [], [], a8, a8_17))
    return plans


def compile_jobs(p: Plan, ms: tuple[int, ...], baseline: bool) -> list[tuple[int, str, dict | None]]:
    jobs: list[tuple[int, str, dict | None]] = []
    if baseline:
        jobs += [(m, "before", None) for m in ms]
    jobs += [(1, "tune", dataclasses.asdict(c)) for c in p.gemv]
    for m in (12, 17):
        jobs += [(m, "tune", dataclasses.asdict(c)) for c in p.swap + p.legacy]
    rows_ms = (2, 4, 6, 12, 17) if any(c.per_row for c in p.rows) else (2, 4)
    for m in rows_ms:
        jobs += [(m, "tune", dataclasses.asdict(c)) for c in p.rows if c.per_row or m <= 4]
    for m in (1, 12):  # w8a8: rows padded to 16 (M = 1 is a compile of its own: Triton specialises 1)
        jobs += [(m, "tune8", dataclasses.asdict(c)) for c in p.w8a8]
    jobs += [(17, "tune8", dataclasses.asdict(c)) for c in p.w8a8_m17]  # rows padded to 32
    jobs += [(m, "baton", None) for m in ms]  # the current tables' configs (and the bucket rules)
    if p.fp8:
        jobs += [(m, "w8a8", None) for m in ms]
    return jobs


def _best(rows: list[dict]) -> dict | None:
    ok = [r for r in rows if "us" in r]
    return min(ok, key=lambda r: r["us"]) if ok else None


def tune_plan(p: Plan, w: Weights, mods: dict, out_rows: list, deadline: float) -> dict[str, dict]:
    """The best row per bucket kind ("gemv", "m4", "m8", "m16", "m32"), each with ``config`` or ``cublas``."""
    s, fp8 = p.shape, p.fp8
    winners: dict[str, dict] = {}

    def run(m, cfgs, impl="tune"):
        inp = make_inputs(s, m, "cuda", 1000 + m)
        ref = reference(s, inp, w, fp8)
        rows = []
        for c in cfgs:
            if time.time() > deadline:
                break
            rows.append(measure(impl, s, m, fp8, w, inp, ref, mods, c))
        if not fp8:
            rows.append(measure("torch", s, m, fp8, w, inp, ref, mods))
        for r in rows:
            r["phase"] = "tune"
        out_rows.extend(rows)
        return rows

    def pick(kind, rows):
        best = _best(rows)
        if best is not None:
            winners[kind] = best

    per_row = [c for c in p.rows if c.per_row]
    pick("gemv", run(1, p.gemv))
    r12 = run(12, p.swap + p.legacy + per_row)
    pick("m16", r12)
    ranked = sorted((r for r in r12 if "us" in r and "config" in r), key=lambda r: r["us"])
    top = [_cfg(**r["config"]) for r in ranked[:3]]
    pr_top = [_cfg(**r["config"]) for r in ranked if r["config"].get("per_row")][:4]
    pick("m8", run(6, list(dict.fromkeys(top + pr_top))))
    pick("m4", run(4, list(dict.fromkeys(top + p.rows))))
    pick("m32", run(17, list(dict.fromkeys([_cfg(**r["config"]) for r in ranked[:8]] + pr_top))))
    return winners


def tune_w8a8(p: Plan, w: Weights, mods: dict, out_rows: list, deadline: float) -> dict[str, dict]:
    """w8a8: the best row per kind ("m1", "m4", "m8", "m16", "m32"): every candidate at M = 1 and 12, the best
    five of M = 12 at M = 4 and 6, ``p.w8a8_m17`` at 17."""
    s = p.shape
    winners: dict[str, dict] = {}

    def run(m, cfgs):
        inp = make_inputs(s, m, "cuda", 3000 + m)
        ref = reference(s, inp, w, True)
        rows = []
        for c in cfgs:
            if time.time() > deadline:
                break
            rows.append(measure("tune8", s, m, True, w, inp, ref, mods, c))
        for r in rows:
            r["phase"] = "tune8"
        out_rows.extend(rows)
        best = _best(rows)
        return rows, best

    for kind, m in (("m1", 1), ("m16", 12)):
        rows, best = run(m, p.w8a8)
        if best is not None:
            winners[kind] = best
        if m == 12:
            ranked = [_cfg(**r["config"]) for r in sorted((r for r in rows if "us" in r), key=lambda r: r["us"])]
    for kind, m, top in (("m4", 4, ranked[:5]), ("m8", 6, ranked[:5]), ("m32", 17, p.w8a8_m17)):
        _, best = run(m, top)
        if best is not None:
            winners[kind] = best
    return winners


def _replace_table(path: Path, data: dict) -> None:
    """Write a tuned table in one step (a temporary file renamed over it): a reader never sees half a table."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def write_w8a8_table(winners: dict, device_name: str) -> str:
    """The w8a8 winners into the fp8 table as ``"act": "fp8"`` entries: those of a tuned (n_out, k, swiglu) are
    replaced, every other entry (w8a16 ones included) stays."""
    from baton.ops.linear import triton as lt

    path = lt.table_path(device_name, lt.TUNED_FP8_DIR)
    data = json.loads(path.read_text()) if path.is_file() else {"entries": []}
    mine = {(k[0], k[1], k[2]) for k in winners}
    entries = [e for e in data["entries"] if e.get("act") != "fp8" or (e["n_out"], e["k"], e["swiglu"]) not in mine]
    for (n_out, k, swiglu, kind), row in sorted(winners.items(), key=lambda kv: str(kv[0])):
        entries.append({"kind": kind, "n_out": n_out, "k": k, "swiglu": swiglu, "act": "fp8", "config": row["config"],
                        "us": row["us"], "tbps": row["tbps"], "m": row["M"], "shape": row["shape"]})
    data.update(entries=entries, w8a8_written_by="benchmarks/bench_decode_gemm.py --tune-w8a8 --write-table",
                w8a8_torch=torch.__version__, w8a8_triton=_triton_version())
    _replace_table(path, data)
    lt._device_table.cache_clear()
    return str(path)


def write_tables(winners: dict, device_name: str) -> list[str]:
    """Merge the winners into the bf16 and fp8 tables: every entry of a tuned (n_out, k, swiglu) is replaced, except
    the fp8 table's w8a8 (``"act": "fp8"``) entries, which only ``write_w8a8_table`` replaces; the table's other
    keys (``w8a8_written_by``, ...) stay."""
    from baton.ops.linear import triton as lt

    written = []
    for fp8 in (False, True):
        path = lt.table_path(device_name, lt.TUNED_FP8_DIR if fp8 else lt.TUNED_DIR)
        data = json.loads(path.read_text()) if path.is_file() else {}
        old = data.get("entries", [])
        mine = {(k[1], k[2], k[3]) for k in winners if k[0] == fp8}
        entries = [e for e in old if e.get("act") == "fp8" or (e["n_out"], e["k"], e["swiglu"]) not in mine]
        for (is_fp8, n_out, k, swiglu, kind), row in sorted(winners.items(), key=lambda kv: str(kv[0])):
            if is_fp8 != fp8:
                continue
            if row["impl"] == "torch":
                cfg = dataclasses.asdict(_cfg(block_n=64, block_k=128, cublas=True))
            else:
                cfg = row["config"]
            entries.append({"kind": kind, "n_out": n_out, "k": k, "swiglu": swiglu, "config": cfg,
                            "us": row["us"], "tbps": row["tbps"], "m": row["M"], "shape": row["shape"]})
        data.update(device=device_name, torch=torch.__version__, triton=_triton_version(),
                    written_by="benchmarks/bench_decode_gemm.py --tune --write-table", entries=entries)
        _replace_table(path, data)
        written.append(str(path))
    lt._device_table.cache_clear()
    return written


def _triton_version() -> str:
    import triton

    return triton.__version__


def final_rows(p: Plan, w: Weights, mods: dict, ms: tuple[int, ...], impls: list[str]) -> list[dict]:
    rows = []
    for m in ms:
        inp = make_inputs(p.shape, m, "cuda", 2000 + m)
        ref = reference(p.shape, inp, w, p.fp8)
        for impl in impls:
            if impl == "scaled_mm" and (not p.fp8 or _row_map(p.shape) is not None):
                continue
            if impl == "before" and "before" not in mods:
                continue
            if impl == "w8a8" and not p.fp8:
                continue
            r = measure(impl, p.shape, m, p.fp8, w, inp, ref, mods)
            if impl in ("baton", "w8a8"):
                r["config"] = _picked(p, m, impl == "w8a8")
            r["phase"] = "final"
            rows.append(r)
    return rows


def _picked(p: Plan, m: int, act_fp8: bool = False) -> str:
    from baton.ops.linear import triton as lt

    limit = lt.MAX_M
    if m > limit:
        return "reference (M past the kernel's rows)"
    c = lt.pick_config(m, p.shape.n_out, p.shape.k, p.shape.swiglu, p.fp8, act_fp8)
    return "cublas (reference path)" if c.cublas else cfg_name(c)


def _cell(r: dict | None, fmt: str) -> str:
    """A timed row as a table cell (``fmt`` over its us, tbps and x_floor), its error, or "-" when absent."""
    if r is None:
        return "-"
    if "us" not in r:
        return f"error: {r.get('error', '?')[:40]}"
    return fmt.format(**r)


def summary(rows: list[dict]) -> str:
    """before / baton / cublas at M = 1, 6, 17 per shape and dtype."""
    final = {(r["shape"], r["dtype"], r["M"], r["impl"]): r for r in rows if r.get("phase") == "final"}
    lines = ["| shape | dtype | M | floor us | before us (TB/s, x floor) | baton us (TB/s, x floor) | cublas us | "
             "torch us |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def cell(r):
        return _cell(r, "{us:.2f} ({tbps:.2f}, {x_floor:.2f}x)")
    order = SHAPE_ORDER
    keys = sorted({(k[0], k[1], k[2]) for k in final}, key=lambda k: (order.index(k[0]), k[1], k[2]))
    for shape, dt, m in keys:
        got = {i: final.get((shape, dt, m, i)) for i in ("before", "baton", "cublas", "torch")}
        fl = next((r["floor_us"] for r in (got["baton"], got["before"]) if r), 0)
        cu, to = got["cublas"], got["torch"]
        lines.append(f"| {shape} | {dt} | {m} | {fl:.2f} | {cell(got['before'])} | {cell(got['baton'])} | "
                     f"{cu['us'] if cu and 'us' in cu else '-'} | {to['us'] if to and 'us' in to else '-'} |")
    return "\n".join(lines)


def summary_w8a8(rows: list[dict]) -> str:
    """fp8 shapes: w8a16 (``baton``) / w8a8 / cuBLAS on the bf16 weight, per M: µs, TB/s, x floor, error."""
    final = {(r["shape"], r["M"], r["impl"]): r for r in rows if r.get("phase") == "final" and r["dtype"] == "fp8"}
    lines = ["| shape | M | floor us | w8a16 us / TB/s / x floor | w8a8 us / TB/s / x floor | w8a8 vs w8a16 | "
             "cuBLAS bf16 us | err w8a16 | err w8a8 | w8a8 config |", "| --- " * 10 + "|"]

    def cell(r):
        return _cell(r, "{us:.2f} / {tbps:.2f} / {x_floor:.2f}x")
    order = SHAPE_ORDER
    for shape, m in sorted({(k[0], k[1]) for k in final}, key=lambda k: (order.index(k[0]), k[1])):
        a16, a8, cu = (final.get((shape, m, i)) for i in ("baton", "w8a8", "cublas"))
        fl = next((r["floor_us"] for r in (a16, a8) if r), 0)
        sp = f"{a16['us'] / a8['us']:.2f}x" if a16 and a8 and "us" in a16 and "us" in a8 else "-"
        lines.append(f"| {shape} | {m} | {fl:.2f} | {cell(a16)} | {cell(a8)} | {sp} | "
                     f"{cu['us'] if cu and 'us' in cu else '-'} | {a16.get('err', '-') if a16 else '-'} | "
                     f"{a8.get('err', '-') if a8 else '-'} | {a8.get('config', '-') if a8 else '-'} |")
    return "\n".join(lines)


def summary_tma(rows: list[dict]) -> str:
    """The tune's best per-thread-load config against its best tensor-descriptor one, per shape, mode and M."""
    best: dict = {}
    for r in rows:
        if r.get("phase") not in ("tune", "tune8") or "us" not in r or "config" not in r:
            continue
        mode = "w8a8" if r["phase"] == "tune8" else r["dtype"] if r["dtype"] == "bf16" else "w8a16"
        key = (r["shape"], mode, r["M"], bool(r["config"].get("tma")))
        if key not in best or r["us"] < best[key]["us"]:
            best[key] = r
    lines = ["| shape | mode | M | floor us | best loads: us / x floor (config) | best TMA: us / x floor (config) | "
             "TMA vs loads |", "| --- " * 7 + "|"]
    order = SHAPE_ORDER
    for shape, mode, m in sorted({k[:3] for k in best}, key=lambda k: (order.index(k[0]), k[1], k[2])):
        a, b = best.get((shape, mode, m, False)), best.get((shape, mode, m, True))
        if b is None:
            continue

        def cell(r):
            return "-" if r is None else f"{r['us']:.2f} / {r['x_floor']:.2f}x ({r['impl'].split(':', 1)[-1]})"
        sp = f"{a['us'] / b['us']:.2f}x" if a else "-"
        fl = (a or b)["floor_us"]
        lines.append(f"| {shape} | {mode} | {m} | {fl:.2f} | {cell(a)} | {cell(b)} | {sp} |")
    return "\n".join(lines)


def measured_bandwidth(nbytes: int = 2**30) -> float:
    """Device-to-device copy bandwidth (bytes read + written per second), median of 10 copies of ``nbytes``."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        e1.synchronize()
        times.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * nbytes / statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    global BANDWIDTH
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default="decode_gemm.json", help="rows out")
    ap.add_argument("--shapes", nargs="+", default=[s.name for s in SHAPES], choices=SHAPE_ORDER,
                    help="default: the Ling-3.0-flash shapes; smol_*: SmolLM2-135M's")
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    ap.add_argument("--m", nargs="+", type=int, default=list(MS))
    ap.add_argument("--tune", action="store_true", help="sweep configs per shape and row bucket")
    ap.add_argument("--write-table", action="store_true", help="with --tune: write the winners into the tables")
    ap.add_argument("--baseline", default=None, help="dir with linear_triton.py, fp8_triton.py, tuned/ to time too")
    ap.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    ap.add_argument("--budget-s", type=float, default=1e9, help="stop tuning (keep what was found) after this")
    ap.add_argument("--tune-w8a8", action="store_true", help="sweep the w8a8 (act_fp8) configs of the fp8 shapes")
    ap.add_argument("--impls", nargs="+", default=["before", "baton", "cublas", "torch", "scaled_mm", "w8a8"],
                    help="the implementations of the final rows")
    ap.add_argument("--tma", action="store_true",
                    help="with --tune / --tune-w8a8: every pipelined swap-form candidate also with tma=True")
    ap.add_argument("--per-row", action="store_true", help="with --tune: the per-row form's candidates at every M")
    ap.add_argument("--bandwidth", default=str(BANDWIDTH),
                    help="bytes/s of the floor (default the H200's 4.2e12), or 'measure': this GPU's copy rate")
    args = ap.parse_args(argv)
    measured = measured_bandwidth()
    BANDWIDTH = measured if args.bandwidth == "measure" else float(args.bandwidth)
    t0 = time.time()
    deadline = t0 + args.budget_s
    ms = tuple(args.m)
    shapes = [SHAPE_BY_NAME[n] for n in args.shapes]
    plans = make_plans(shapes, args.dtypes, args.tune, args.baseline, args.tune_w8a8, args.tma, args.per_row)
    mods = _load_baseline(args.baseline)
    rows: list[dict] = []
    env = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": _triton_version(),
           "cold_bytes": COLD_BYTES, "min_calls": MIN_CALLS, "reps": REPS, "bandwidth": BANDWIDTH,
           "measured_copy_bandwidth": round(measured / 1e12, 3)}
    print(json.dumps(env), flush=True)

    def dump(extra: dict | None = None) -> None:
        data = {"env": env, "args": vars(args), "elapsed_s": round(time.time() - t0, 1), "rows": rows, **(extra or {})}
        tmp = f"{args.json}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f, indent=1)
        os.replace(tmp, args.json)

    # 1. compile everything in worker processes (no launches), one future per shape and dtype
    futures = {}
    pool = None
    if args.workers > 1:
        pool = cf.ProcessPoolExecutor(args.workers, mp_context=mp.get_context("spawn"), initializer=_worker_init,
                                      initargs=(args.baseline,))
        for p in plans:
            jobs = compile_jobs(p, ms, bool(mods))
            step = max(1, math.ceil(len(jobs) / 4))  # a few chunks per group: spread over the workers
            futures[(p.shape.name, p.fp8)] = [pool.submit(_compile_group, p.shape.name, p.fp8, jobs[i:i + step])
                                              for i in range(0, len(jobs), step)]
    winners: dict = {}
    winners8: dict = {}
    impls = list(args.impls)
    for p in plans:
        tag = f"{p.shape.name}/{'fp8' if p.fp8 else 'bf16'}"
        t = time.time()
        errs = []
        for f in futures.get((p.shape.name, p.fp8), []):
            try:
                errs += [e for e in f.result() if e]
            except Exception as e:  # noqa: BLE001 - a broken worker: this process compiles what it needs
                errs.append(f"worker: {type(e).__name__}: {e}")
        print(f"[{time.time() - t0:6.1f}s] {tag}: compiled (waited {time.time() - t:.1f}s, {len(errs)} compile "
              f"errors{': ' + errs[0] if errs else ''})", flush=True)
        w = make_weights(p.shape, "cuda", p.fp8)
        if args.tune and time.time() < deadline:
            best = tune_plan(p, w, mods, rows, deadline)
            for kind, r in best.items():
                winners[(p.fp8, p.shape.n_out, p.shape.k, p.shape.swiglu, kind)] = r
            print(f"[{time.time() - t0:6.1f}s] {tag}: " + ", ".join(
                f"{k} {r['impl'].removeprefix('tune:')} {r['us']:.2f}us {r['tbps']:.2f}TB/s" for k, r in best.items()),
                flush=True)
        if args.tune_w8a8 and p.w8a8 and time.time() < deadline:
            best = tune_w8a8(p, w, mods, rows, deadline)
            for kind, r in best.items():
                winners8[(p.shape.n_out, p.shape.k, p.shape.swiglu, kind)] = r
            print(f"[{time.time() - t0:6.1f}s] {tag} w8a8: " + ", ".join(
                f"{k} {r['impl'].removeprefix('tune8:')} {r['us']:.2f}us {r['tbps']:.2f}TB/s"
                for k, r in best.items()), flush=True)
        if not args.write_table:
            rows.extend(final_rows(p, w, mods, ms, impls))
        del w
        torch.cuda.empty_cache()
        dump()
    if pool is not None:
        pool.shutdown(wait=False, cancel_futures=True)
    if args.write_table and (winners or winners8):
        written = write_tables(winners, torch.cuda.get_device_name()) if winners else []
        if winners8:
            written.append(write_w8a8_table(winners8, torch.cuda.get_device_name()))
        print(f"[{time.time() - t0:6.1f}s] tables: {written}", flush=True)
        for p in plans:
            w = make_weights(p.shape, "cuda", p.fp8)
            rows.extend(final_rows(p, w, mods, ms, impls))
            del w
            torch.cuda.empty_cache()
            dump()
    dump()
    print(summary(rows), flush=True)
    if "w8a8" in impls:
        print(summary_w8a8(rows), flush=True)
    if args.tma:
        print(summary_tma(rows), flush=True)
    print(f"[{time.time() - t0:6.1f}s] done: {len(rows)} rows in {args.json}", flush=True)


if __name__ == "__main__":
    main()
