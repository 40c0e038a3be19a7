"""Reference attention over a position-indexed cache (plain PyTorch, fp32 softmax).

Key j is visible to query i when ``j <= q_positions[i]``; keys are cache rows, so row index = position.
"""

from __future__ import annotations

import torch


def causal_mask(q_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    keys = torch.arange(num_keys, device=q_positions.device)
    return keys[None, :] <= q_positions[:, None]  # [T, S]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [T, H, Dv]. ``mask`` [T, S] overrides the causal one."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        rep = num_heads // num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if mask is None:
        mask = causal_mask(q_positions, k.shape[0])
    scores = torch.einsum("thd,shd->hts", q.float(), k.float()) * scale  # [H, T, S]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hts,shd->thd", probs, v.float())
    return out.to(q.dtype)
