"""Weight-absorbed MLA decode/verify attention over the latent cache; ``mla_decode`` picks the implementation.

CUDA tensors take the Triton flash-decoding kernel (``triton.py``) when triton imports and
``baton.env.use_triton()`` allows; everything else the plain-PyTorch reference.
"""

from __future__ import annotations

import torch

from baton.ops.attention import triton_module
from baton.ops.mla_decode.naive import mla_decode as mla_decode_naive

__all__ = ["mla_decode"]


def mla_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, latent: torch.Tensor, q_positions: torch.Tensor,
               kv_lora_rank: int, scale: float) -> torch.Tensor:
    """q_lat [T, H, C], q_rope [T, H, R], latent [S, C + R] -> o_lat [T, H, C] (in q_lat's dtype)."""
    impl = triton_module("baton.ops.mla_decode.triton", q_lat)
    if impl is not None:
        return impl.mla_decode(q_lat, q_rope, latent, q_positions, kv_lora_rank, scale)
    return mla_decode_naive(q_lat, q_rope, latent, q_positions, kv_lora_rank, scale)
