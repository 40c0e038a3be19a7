"""fp8 (e4m3) weights with 128 x 128 block scales, the layout of the published Ling / DeepSeek fp8 checkpoints:
``weight`` in float8_e4m3fn plus ``weight_scale_inv`` (fp32, one value per 128 x 128 block), with
``dequantized = weight.float() * weight_scale_inv[block]``. Works on [N, K] matrices and [E, N, K] expert stacks
(blocks never straddle experts); N and K need not be multiples of the block."""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
BLOCK = 128


def scale_shape(shape: tuple[int, ...], block: int = BLOCK) -> tuple[int, ...]:
    """[..., N, K] -> [..., ceil(N/block), ceil(K/block)]."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block), math.ceil(k / block))


def _blocked(w: torch.Tensor, block: int) -> tuple[torch.Tensor, int, int]:
    """Pad [..., N, K] to block multiples and view as [..., nb, block, kb, block]."""
    *lead, n, k = w.shape
    pn, pk = math.ceil(n / block) * block - n, math.ceil(k / block) * block - k
    wp = torch.nn.functional.pad(w, (0, pk, 0, pn)) if pn or pk else w
    nb, kb = wp.shape[-2] // block, wp.shape[-1] // block
    return wp.reshape(*lead, nb, block, kb, block), n, k


def quantize_fp8_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] (any float dtype) -> (fp8 weight [..., N, K], fp32 scale_inv [..., ceil(N/b), ceil(K/b)])."""
    blocks, n, k = _blocked(w.float(), block)
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True).clamp_min(1e-12)  # [..., nb, 1, kb, 1]
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*w.shape[:-2], blocks.shape[-4] * block, blocks.shape[-2] * block)[..., :n, :k]
    return q.contiguous(), scale_inv.squeeze(-1).squeeze(-2).contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                         block: int = BLOCK) -> torch.Tensor:
    """The reference dequantisation: fp8 [..., N, K] x per-block scale_inv -> ``dtype`` [..., N, K]."""
    blocks, n, k = _blocked(q.float(), block)
    out = blocks * scale_inv[..., :, None, :, None]
    out = out.reshape(*q.shape[:-2], blocks.shape[-4] * block, blocks.shape[-2] * block)[..., :n, :k]
    return out.to(dtype)


def quantize_fp8_gate_up(w13: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused [..., 2I, K] gate|up rows quantised as the checkpoint stores them, each half on its own: returns fp8
    [..., 2I, K] and scale_inv [..., 2 * ceil(I/b), ceil(K/b)] (gate blocks, then up blocks)."""
    gate, up = w13.chunk(2, dim=-2)
    (qg, sg), (qu, su) = quantize_fp8_block(gate, block), quantize_fp8_block(up, block)
    return torch.cat([qg, qu], dim=-2), torch.cat([sg, su], dim=-2)


def dequantize_fp8_gate_up(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                           block: int = BLOCK) -> torch.Tensor:
    qg, qu = q.chunk(2, dim=-2)
    sg, su = scale_inv.chunk(2, dim=-2)
    return torch.cat([dequantize_fp8_block(qg, sg, dtype, block), dequantize_fp8_block(qu, su, dtype, block)], -2)


def part_blocks(rows: list[int], block: int = BLOCK) -> int:
    """Scale rows of a fused weight whose row parts (``rows``, each a checkpoint tensor) are quantised each on
    its own: ``sum(ceil(r / block))``."""
    return sum(math.ceil(r / block) for r in rows)


def row_block_map(rows: list[int], block: int = BLOCK) -> list[int] | None:
    """The scale row of every weight row of a fused weight whose parts (``rows``) are quantised each on its own;
    None when ``row // block`` is that row already (every part but the last a multiple of ``block`` rows)."""
    if all(r % block == 0 for r in rows[:-1]):
        return None
    out: list[int] = []
    first = 0
    for r in rows:
        out += [first + i // block for i in range(r)]
        first += math.ceil(r / block)
    return out


def quantize_fp8_parts(w: torch.Tensor, rows: list[int], block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] made of row parts ``rows`` (summing to N) -> (fp8 [N, K], scale_inv [part_blocks(rows), ceil(K/b)]),
    each part block-quantised on its own (the layout of a fused projection whose parts are checkpoint tensors)."""
    parts = [quantize_fp8_block(p, block) for p in w.split(rows, dim=0)]
    return torch.cat([q for q, _ in parts]), torch.cat([s for _, s in parts])


def dequantize_fp8_rows(q: torch.Tensor, scale_inv: torch.Tensor, row_block: torch.Tensor | None = None,
                        dtype: torch.dtype = torch.bfloat16, block: int = BLOCK) -> torch.Tensor:
    """``dequantize_fp8_block`` of a [N, K] weight whose weight row ``r`` takes scale row ``row_block[r]`` (a fused
    weight of parts not aligned to the block; ``row_block_map``); None: row ``r // block``."""
    if row_block is None:
        return dequantize_fp8_block(q, scale_inv, dtype, block)
    k = q.shape[-1]
    s = scale_inv[row_block.long()].repeat_interleave(block, dim=-1)[:, :k]  # [N, K]
    return (q.float() * s).to(dtype)


# ---- w8a8: activations quantised at run time ----

ACT_GROUP = 128  # activations are quantised per (row, 128 consecutive K) group, as the 128 x 128 weight blocks
_TINY_AMAX = 1e-30  # floor of a group's amax (an all-zero group): its scale stays a normal power of two


def quantize_act_e4m3(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] float8_e4m3fn, scale [..., ceil(K/group)] fp32) with x ~= q * scale per group.

    The scale is the smallest power of two ``2^s`` with ``amax / 2^s <= 448`` (amax of the group in fp32, floored at
    1e-30), found from amax's exponent and mantissa bits, so ``x * 2^-s`` is exact and only the cast to e4m3
    (round to nearest even) rounds: the Triton kernels (``baton.ops.quant.triton.quant_e4m3_rows``) compute the
    same bits. Every w8a8 path (dense projections and MoE experts) quantises its activations with it."""
    xf = x.float()
    k = xf.shape[-1]
    pad = (-k) % group
    xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    g = xp.reshape(*xf.shape[:-1], -1, group)
    amax = g.abs().amax(-1).clamp_min(_TINY_AMAX)
    bits = amax.contiguous().view(torch.int32)
    s = ((bits >> 23) & 0xFF) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)  # 448 = 1.75 * 2^8
    scale = ((s + 127) << 23).view(torch.float32)
    inv = ((127 - s) << 23).view(torch.float32)
    q = (g * inv[..., None]).to(torch.float8_e4m3fn).reshape(*xf.shape[:-1], -1)[..., :k]
    return q, scale


def dequantize_act_e4m3(q: torch.Tensor, scale: torch.Tensor, group: int = ACT_GROUP) -> torch.Tensor:
    """fp32 [..., K] = q * its group's scale (``quantize_act_e4m3``'s inverse, exact)."""
    k = q.shape[-1]
    return q.float() * scale.repeat_interleave(group, dim=-1)[..., :k]


def scale_act_f16(x: torch.Tensor, group: int = ACT_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (q [..., K] float16, scale [..., ceil(K/group)] fp32) with x ~= q * scale per group: the fp16
    rows of the w8a16 fp16 MMA (fp8 weights widened to fp16, exact). The scale is the power of two ``2^e`` that
    brings the group's amax (fp32) into [2^14, 2^15), e clamped to +-100 (a zero group: q zeros), from amax's
    exponent bits, so ``x * 2^-e`` is exact and only the cast to fp16 (round to nearest even) rounds: exact for a
    bf16 x down to 2^-24 of the group's amax, 11 significant bits for fp32. The Triton kernels
    (``baton.ops.quant.triton.f16_rows``) compute the same bits."""
    xf = x.float()
    k = xf.shape[-1]
    pad = (-k) % group
    xp = torch.nn.functional.pad(xf, (0, pad)) if pad else xf
    g = xp.reshape(*xf.shape[:-1], -1, group)
    bits = g.abs().amax(-1).contiguous().view(torch.int32)
    e = (((bits >> 23) & 0xFF) - 141).clamp(-100, 100)
    scale = ((127 + e) << 23).view(torch.float32)
    inv = ((127 - e) << 23).view(torch.float32)
    q = (g * inv[..., None]).to(torch.float16).reshape(*xf.shape[:-1], -1)[..., :k]
    return q, scale
