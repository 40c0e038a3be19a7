"""Rotary position embedding: rotate-half (Llama, "neox") and interleaved pairs (Ling MLA, "GPT-J").

Angles are computed from the position tensor on the device each call, so the same code runs eagerly and
inside CUDA graphs with no host-side position bookkeeping.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.config import ConfigError
from baton.ops.rope import apply_rope, rope_cos_sin


class RotaryEmbedding(nn.Module):
    def __init__(self, rotary_dim: int, base: float, interleaved: bool, rope_scaling: dict | None = None,
                 device=None) -> None:
        super().__init__()
        if rope_scaling:
            kind = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if kind not in (None, "default"):
                raise ConfigError(f"rope_scaling type {kind!r} is not supported yet")
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        self.base = base
        self.register_buffer("inv_freq", torch.empty(rotary_dim // 2, device=device), persistent=False)
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """(Re)compute inv_freq [rotary_dim/2]; called again after a model is materialised from meta."""
        if self.inv_freq.device.type == "meta":
            return
        exps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float64) / self.rotary_dim
        self.inv_freq.copy_((1.0 / (self.base**exps)).float())

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rope_cos_sin(positions, self.inv_freq)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H, rotary_dim] (or [T, rotary_dim]); returns the rotated tensor in x's dtype."""
        cos, sin = self.cos_sin(positions)
        return apply_rope(x, cos, sin, self.interleaved)
