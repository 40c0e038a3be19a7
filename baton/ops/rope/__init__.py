"""Rotary position embedding math (the one implementation both RotaryEmbedding and the PyTorch fallback of the
fused RoPE + cache-write op use): rotate-half ("neox", Llama) or interleaved pairs ("GPT-J", Ling MLA)."""

from __future__ import annotations

import torch


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] -> cos, sin [T, rotary_dim / 2] (fp32 angles ``position * inv_freq``)."""
    freqs = positions.float()[:, None] * inv_freq.float()[None, :]
    return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate the first 2 * cos.shape[-1] dims of x ([T, rotary] or [T, H, D]) in fp32; the rest pass through.
    Returns a new tensor in x's dtype."""
    half = cos.shape[-1]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    xf = x[..., : 2 * half].float()
    if interleaved:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    out = out.to(x.dtype)
    return out if x.shape[-1] == 2 * half else torch.cat([out, x[..., 2 * half :]], dim=-1)
