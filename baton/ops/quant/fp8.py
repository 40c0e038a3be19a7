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
