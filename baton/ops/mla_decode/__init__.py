"""Weight-absorbed MLA decode/verify attention over the latent cache; ``mla_decode`` picks the implementation.

CUDA tensors take the Triton flash-decoding kernel (``triton.py``) when triton imports and
``baton.env.use_triton()`` allows; everything else the plain-PyTorch reference.
"""

from __future__ import annotations

import torch

from baton.ops.attention import triton_module
from baton.ops.mla_decode.naive import apply_head_gate, head_gate
from baton.ops.mla_decode.naive import mla_decode as mla_decode_naive

__all__ = ["apply_head_gate", "head_gate", "mla_decode"]


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
               kv_lora_rank: int, scale: float, gate_logits: torch.Tensor | None = None) -> torch.Tensor:
    """q_lat [T, H, C], q_rope [T, H, R], latent [S, C + R], gate_logits [T, H] or None -> o_lat [T, H, C] (in
    q_lat's dtype), gated by sigmoid(gate_logits) per (token, head) in fp32 before the rounding. q_lat, q_rope
    and gate_logits may be strided views with a contiguous last dim. On CUDA: one Triton launch, two with
    split-KV (the reduction, which then applies the gate)."""
    impl = triton_module("baton.ops.mla_decode.triton", q_lat)
    if impl is not None:
        return impl.mla_decode(q_lat, q_rope, latent, q_positions, kv_lora_rank, scale, gate_logits)
    return mla_decode_naive(q_lat, q_rope, latent, q_positions, kv_lora_rank, scale, gate_logits)
