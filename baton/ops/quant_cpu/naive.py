"""GGUF block formats as PyTorch tensors, and the plain-PyTorch references of the quantized CPU ops.

Q4_1 (``block_q4_1``, 20 bytes per 32 weights): fp16 scale ``d``, fp16 minimum ``m``, 16 bytes of 4-bit codes
whose low nibbles are weights 0..15 of the block and high nibbles weights 16..31; ``w = d * q + m``.
Q8_0 (``block_q8_0``, 34 bytes per 32 weights): fp16 scale ``d`` and 32 int8 codes; ``w = d * q``.

baton keeps the codes and the fp16 scales as the file stores them, each byte as it is; every op widens the scales
to fp32 (exact) and computes in fp32, so the dequantised value ``d * q + m`` is the one gguf-py's ``dequantize``
computes, rounded once in fp32. Q4_1 is repacked once at load so that the output rows are the fastest-moving index
(the CPU kernel vectorises across rows): ``packed`` uint8 [K/32, 16, N] (byte j of block b of row n), ``d`` / ``m``
fp16 [K/32, N]. Q8_0 keeps the file's row layout (the embedding looks rows up): ``codes`` int8 [N, K/32, 32], ``d``
fp16 [N, K/32].
"""

from __future__ import annotations

import torch

GROUP = 32  # weights per block, both formats
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_BYTES = 34


def _fp16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``start:start+2`` of each block ([N, B, block_bytes] uint8) as fp16 [N, B]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0]


def unpack_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows (uint8 [N, K/32 * 20]) -> (packed uint8 [K/32, 16, N], d fp16 [K/32, N], m fp16 [K/32, N])."""
    blocks = raw.reshape(raw.shape[0], -1, Q4_1_BLOCK_BYTES)
    packed = blocks[..., 4:].permute(1, 2, 0).contiguous()
    return packed, _fp16_at(blocks, 0).t().contiguous(), _fp16_at(blocks, 2).t().contiguous()


def unpack_q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows (uint8 [N, K/32 * 34]) -> (codes int8 [N, K/32, 32], d fp16 [N, K/32])."""
    blocks = raw.reshape(raw.shape[0], -1, Q8_0_BLOCK_BYTES)
    return blocks[..., 2:].contiguous().view(torch.int8), _fp16_at(blocks, 0)


def dequantize_q4_1(packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """-> fp32 [N, K]: ``d * q + m`` per block (weight j < 16 of a block in the low nibble of byte j, j >= 16 in
    the high nibble of byte j - 16)."""
    q = torch.cat([packed & 15, packed >> 4], dim=1).float()  # [B, 32, N]
    w = q * d.float()[:, None, :] + m.float()[:, None, :]
    return w.permute(2, 0, 1).reshape(packed.shape[2], -1)


def dequantize_q8_0(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """-> fp32 [N, K]: ``d * q`` per block."""
    w = codes.float() * d.float()[..., None]
    return w.reshape(w.shape[0], -1)


def q4_1_linear(x: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 x @ dequantize_q4_1(...).T [M, N]."""
    return x.float() @ dequantize_q4_1(packed, d, m).t()


def q8_0_linear(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """x [M, K] -> fp32 x @ dequantize_q8_0(...).T [M, N]."""
    return x.float() @ dequantize_q8_0(codes, d).t()


def q8_0_embedding(ids: torch.Tensor, codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the dequantised Q8_0 matrix: fp32 [*ids.shape, K]."""
    flat = ids.reshape(-1)
    return dequantize_q8_0(codes[flat], d[flat]).reshape(*ids.shape, -1)


def q4_1_embedding(ids: torch.Tensor, packed: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Rows ``ids`` of the dequantised Q4_1 matrix: fp32 [*ids.shape, K]."""
    flat = ids.reshape(-1)
    return dequantize_q4_1(packed[:, :, flat], d[:, flat], m[:, flat]).reshape(*ids.shape, -1)
