"""Reference weight-absorbed MLA attention over the latent cache (MQA with one 576-wide key, 512-wide value),
and the one definition of Ling MLA's head-wise output gate.

score(i, j) = (q_lat_i . c_j + q_rope_i . k_rope_j) * scale over keys j <= position_i, per head; with gate
logits, o_lat[t, h] is multiplied by sigmoid(gate[t, h]) in fp32 before it is rounded to q_lat's dtype.
"""

from __future__ import annotations

import torch

from baton.ops.attention.naive import causal_mask


def head_gate(gate_logits: torch.Tensor) -> torch.Tensor:
    """sigmoid(gate_logits) in fp32 as [T, H, 1]: the factor of each (token, head) output row."""
    return torch.sigmoid(gate_logits.float())[:, :, None]


def apply_head_gate(o: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """``o`` [T, H, D] times sigmoid(gate_logits) [T, H] per (token, head), in fp32, rounded back to o's dtype.
    Because the gate is a per-head scalar and W_UV is linear, gating o_lat (``mla_decode(..., gate_logits)``)
    or the W_UV output is the same math up to where the products are rounded."""
    return (o.float() * head_gate(gate_logits)).to(o.dtype)


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
               kv_lora_rank: int, scale: float, gate_logits: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat [T, H, C], q_rope [T, H, R], latent [S, C + R], gate_logits [T, H] or None -> o_lat [T, H, C] (in
    q_lat's dtype): the fp32 attention output, times sigmoid(gate) when given, rounded once."""
    c = latent[:, :kv_lora_rank].float()  # [S, C]
    k_rope = latent[:, kv_lora_rank:].float()  # [S, R]
    scores = torch.einsum("thc,sc->hts", q_lat.float(), c) + torch.einsum("thr,sr->hts", q_rope.float(), k_rope)
    scores = scores * scale
    mask = causal_mask(q_positions, latent.shape[0])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    o_lat = torch.einsum("hts,sc->thc", probs, c)  # [T, H, C] fp32
    if gate_logits is not None:
        o_lat = o_lat * head_gate(gate_logits)
    return o_lat.to(q_lat.dtype)
