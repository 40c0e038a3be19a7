"""Reference attention over a position-indexed cache (plain PyTorch, fp32 softmax).

Key j is visible to query i when ``j <= q_positions[i]``; keys are cache rows, so row index = position.
"""

from __future__ import annotations

import torch


def causal_mask(q_positions: torch.Tensor, num_keys: int) -> torch.Tensor:
    keys = torch.arange(num_keys, device=q_positions.device)
    return keys[None, :] <= q_positions[:, None]  # [T, S]


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_positions: torch.Tensor, scale: float,
              mask: torch.Tensor | None = None, block: int = 512) -> torch.Tensor:
    """q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv] -> [T, H, Dv]. ``mask`` [T, S] overrides the causal one.
    Queries are processed ``block`` rows at a time so a long prefill never materialises [H, T, S] at once."""
    num_heads, num_kv_heads = q.shape[1], k.shape[1]
    if num_heads != num_kv_heads:
        rep = num_heads // num_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    if mask is None:
        mask = causal_mask(q_positions, k.shape[0])
    kf, vf = k.float(), v.float()
    outs = []
    for start in range(0, q.shape[0], block):
        qb, mb = q[start : start + block].float(), mask[start : start + block]
        scores = torch.einsum("thd,shd->hts", qb, kf) * scale  # [H, Tb, S]
        scores = scores.masked_fill(~mb[None], float("-inf"))
        outs.append(torch.einsum("hts,shd->thd", torch.softmax(scores, dim=-1), vf))
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.to(q.dtype)
