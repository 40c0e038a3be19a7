"""GGUF block formats as PyTorch tensors, the layout baton keeps them in, and the plain-PyTorch references of the
quantized CPU ops.

Q4_1 (``block_q4_1``, 20 bytes per 32 weights): fp16 scale ``d``, fp16 minimum ``m``, 16 bytes of 4-bit codes
whose low nibbles are weights 0..15 of the block and high nibbles weights 16..31; ``w = d * q + m``.
Q8_0 (``block_q8_0``, 34 bytes per 32 weights): fp16 scale ``d`` and 32 int8 codes; ``w = d * q``.

baton keeps every byte of the file as it is, regrouped once at load ("x4", the layout of kernels.c): rows by groups
of 4 (the last group zero-padded), each group one contiguous run of memory, ``packed`` uint8 [ceil(N/4), K/32 * 80]
(Q4_1) or [ceil(N/4), K/32 * 136] (Q8_0), as many bytes per weight as the file: first, per block, the 4 rows' fp16
``d`` (Q4_1: then their fp16 ``m``), then, per block, the 4 rows' code bytes. Every op computes in fp32, and the
dequantised value ``d * q + m`` is the one gguf-py's ``dequantize`` computes (``d * q`` is exact in fp32, so it is
rounded once).
"""

from __future__ import annotations

import torch

GROUP = 32  # weights per block, both formats
ROWS = 4  # rows per group of the x4 layout
Q4_1_BLOCK_BYTES = 20
Q8_0_BLOCK_BYTES = 34
X4_BYTES = {"q4_1": 80, "q8_0": 136}  # bytes of one block of a group of 4 rows
FORMATS = tuple(X4_BYTES)


def in_features(fmt: str, packed: torch.Tensor) -> int:
    """K of an x4-packed [N, K] matrix."""
    return packed.shape[1] // X4_BYTES[fmt] * GROUP


def _fp16_at(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """Bytes ``start:start+2`` of each block ([..., block_bytes] uint8) as fp16 [...]."""
    return blocks[..., start : start + 2].contiguous().view(torch.float16)[..., 0]


def unpack_q4_1(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """GGUF Q4_1 rows (uint8 [N, K/32 * 20]) -> (codes uint8 [N, K/32, 16], d fp32 [N, K/32], m fp32 [N, K/32])."""
    blocks = raw.reshape(raw.shape[0], -1, Q4_1_BLOCK_BYTES)
    return blocks[..., 4:].contiguous(), _fp16_at(blocks, 0).float(), _fp16_at(blocks, 2).float()


def unpack_q8_0(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF Q8_0 rows (uint8 [N, K/32 * 34]) -> (codes int8 [N, K/32, 32], d fp32 [N, K/32])."""
    blocks = raw.reshape(raw.shape[0], -1, Q8_0_BLOCK_BYTES)
    return blocks[..., 2:].contiguous().view(torch.int8), _fp16_at(blocks, 0).float()


def _groups(blocks: torch.Tensor) -> torch.Tensor:
    """[N, B, bytes] -> [ceil(N/4), B, 4, bytes] (zero rows padding the last group)."""
    n, b, nbytes = blocks.shape
    pad = -n % ROWS
    if pad:
        blocks = torch.cat([blocks, blocks.new_zeros(pad, b, nbytes)])
    return blocks.reshape(-1, ROWS, b, nbytes).transpose(1, 2)


def pack(fmt: str, raw: torch.Tensor) -> torch.Tensor:
    """The file's block rows (uint8 [N, K/32 * block bytes]) -> the x4 layout (uint8 [ceil(N/4), K/32 * 80 or 136])."""
    size = Q4_1_BLOCK_BYTES if fmt == "q4_1" else Q8_0_BLOCK_BYTES
    g = _groups(raw.reshape(raw.shape[0], -1, size))  # [G, B, 4, size]
    nscales = 2 if fmt == "q4_1" else 1  # d (and m), fp16 each
    scales = [g[..., 2 * i : 2 * i + 2].reshape(*g.shape[:2], -1) for i in range(nscales)]  # [G, B, 8] each
    codes = g[..., 2 * nscales :].reshape(g.shape[0], -1)  # [G, B * 4 * codes]
    return torch.cat([torch.cat(scales, dim=-1).reshape(g.shape[0], -1), codes], dim=-1).contiguous()


def _ungroup(x: torch.Tensor, n: int) -> torch.Tensor:
    """[G, B, 4, ...] -> [n, B, ...]."""
    return x.transpose(1, 2).reshape(-1, *x.shape[1:2], *x.shape[3:])[:n]


def unpack_x4(fmt: str, packed: torch.Tensor, n: int) -> tuple[torch.Tensor, ...]:
    """The x4 layout back to (codes [n, B, 16 or 32], d fp32 [n, B][, m fp32 [n, B]])."""
    g = packed.shape[0]
    b = packed.shape[1] // X4_BYTES[fmt]
    nscales = 2 if fmt == "q4_1" else 1
    scales = packed[:, : b * 8 * nscales].reshape(g, b, nscales, 8).contiguous().view(torch.float16)  # [G,B,s,4]
    codes = packed[:, b * 8 * nscales :].reshape(g, b, ROWS, -1)
    d = _ungroup(scales[:, :, 0], n).float()
    if fmt == "q4_1":
        return _ungroup(codes, n), d, _ungroup(scales[:, :, 1], n).float()
    return _ungroup(codes, n).contiguous().view(torch.int8), d


def dequantize_q4_1_blocks(codes: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """(codes [N, B, 16], d, m [N, B]) -> fp32 [N, K]: ``d * q + m`` per block (weight j < 16 of a block in the low
    nibble of byte j, j >= 16 in the high nibble of byte j - 16)."""
    q = torch.cat([codes & 15, codes >> 4], dim=-1).float()  # [N, B, 32]
    return (q * d.float()[..., None] + m.float()[..., None]).reshape(codes.shape[0], -1)


def dequantize_q8_0_blocks(codes: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """(codes int8 [N, B, 32], d [N, B]) -> fp32 [N, K]: ``d * q`` per block."""
    return (codes.float() * d.float()[..., None]).reshape(codes.shape[0], -1)


def dequantize(fmt: str, packed: torch.Tensor, n: int) -> torch.Tensor:
    """The x4 layout -> fp32 [n, K]."""
    blocks = unpack_x4(fmt, packed, n)
    return dequantize_q4_1_blocks(*blocks) if fmt == "q4_1" else dequantize_q8_0_blocks(*blocks)


def linear(fmt: str, x: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """x [M, K] -> fp32 x @ dequantize(...).T [M, n]."""
    return x.float() @ dequantize(fmt, packed, n).t()


def embedding(fmt: str, ids: torch.Tensor, packed: torch.Tensor, n: int) -> torch.Tensor:
    """Rows ``ids`` (any shape) of the dequantised matrix: fp32 [*ids.shape, K]."""
    flat = ids.reshape(-1)
    if flat.numel() and not bool(((flat >= 0) & (flat < n)).all()):
        raise IndexError(f"token id out of range [0, {n})")
    return dequantize(fmt, packed, n)[flat].reshape(*ids.shape, -1)
