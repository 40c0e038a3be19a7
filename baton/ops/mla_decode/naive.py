"""Reference weight-absorbed MLA attention over the latent cache (MQA with one 576-wide key, 512-wide value).

score(i, j) = (q_lat_i . c_j + q_rope_i . k_rope_j) * scale over keys j <= position_i, per head.
"""

from __future__ import annotations

import torch

from baton.ops.attention.naive import causal_mask


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
               kv_lora_rank: int, scale: float) -> torch.Tensor:
    """q_lat [T, H, C], q_rope [T, H, R], latent [S, C + R] -> o_lat [T, H, C] (in q_lat's dtype)."""
    c = latent[:, :kv_lora_rank].float()  # [S, C]
    k_rope = latent[:, kv_lora_rank:].float()  # [S, R]
    scores = torch.einsum("thc,sc->hts", q_lat.float(), c) + torch.einsum("thr,sr->hts", q_rope.float(), k_rope)
    scores = scores * scale
    mask = causal_mask(q_positions, latent.shape[0])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hts,sc->thc", probs, c).to(q_lat.dtype)
