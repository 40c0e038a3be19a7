"""The Triton half of the activation scalings for the fp8 weights' tensor-core paths, shared by the dense linear
kernel (baton/ops/linear/triton.py) and the MoE kernels (baton/ops/moe/triton.py): w8a8's e4m3 quantisation
(``baton.ops.quant.fp8.quantize_act_e4m3``) and the fp16 rows of the w8a16 fp16 MMA (``fp16_range``, ``f16_rows``:
``baton.ops.quant.fp8.scale_act_f16``), the same bits as the PyTorch references on every path. Imported only by
those Triton modules."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def quant_e4m3_rows(v, FP8_DOT: tl.constexpr):
    """v [R, G] fp32 (one group of G columns per row) -> (v * 2^-s in e4m3 (FP8_DOT; else its value in fp32: the
    interpreter), 2^s [R]): per row the smallest power of two with amax / 2^s <= 448 (amax floored at 1e-30), from
    amax's exponent and mantissa bits, so only the cast rounds (``quantize_act_e4m3``)."""
    amax = tl.maximum(tl.max(tl.abs(v), axis=1), 1e-30)
    bits = amax.to(tl.int32, bitcast=True)
    se = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)  # 448 = 1.75 * 2^8
    scale = ((se + 127) << 23).to(tl.float32, bitcast=True)
    inv = ((127 - se) << 23).to(tl.float32, bitcast=True)
    if FP8_DOT:
        q = (v * inv[:, None]).to(tl.float8e4nv)
    else:  # the interpreter (its fp8 cast drops the carry of a round-up into the exponent): the e4m3 value in fp32
        q = e4m3_rne_fp32(v * inv[:, None])
    return q, scale


@triton.jit
def e4m3_rne_fp32(v):
    """|v| <= 448 rounded to the nearest e4m3 value (ties to even), in fp32: normals keep 3 mantissa bits (integer
    rounding of the fp32 bits, the carry into the exponent included); below 2^-6 the e4m3 subnormal step 2^-9
    (round to an integer with the 1.5 * 2^23 trick). Interpreter only (numpy evaluates it as written)."""
    bits = v.to(tl.int32, bitcast=True)
    lsb = (bits >> 20) & 1
    normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    magic = 12582912.0
    sub = ((v * 512.0 + magic) - magic) * (1.0 / 512.0)
    return tl.where(tl.abs(v) < 0.015625, sub, normal)


@triton.jit
def fp16_range(amax):
    """(down, up): the powers of two 2^-e and 2^e that bring ``amax`` into [2^14, 2^15), fp16's top binade but one
    (e clamped to +-100, so a zero ``amax`` gets 2^100 and 2^-100: its row is zeros either way). The fp16 MMA paths
    scale rows by ``down`` and results by ``up``; a bf16 value times ``down`` is exact in fp16 unless it is below
    2^-24 of ``amax`` (fp16's subnormals)."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 141
    e = tl.minimum(tl.maximum(e, -100), 100)
    down = ((127 - e) << 23).to(tl.float32, bitcast=True)
    up = ((127 + e) << 23).to(tl.float32, bitcast=True)
    return down, up


@triton.jit
def f16_rows(v, F16_DOT: tl.constexpr):
    """v [R, G] fp32 (one group of G columns per row) -> (v * 2^-e rounded to fp16 (F16_DOT; else that value in
    fp32: the interpreter), 2^e [R]) with e from ``fp16_range`` of each row's amax (``scale_act_f16``)."""
    down, up = fp16_range(tl.max(tl.abs(v), axis=1))
    q = (v * down[:, None]).to(tl.float16)
    if not F16_DOT:
        q = q.to(tl.float32)
    return q, up
