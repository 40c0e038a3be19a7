"""SwiGLU MLP with fused gate/up weights and the optional post-SiLU clamp (Ling's swiglu limit)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton.layers.linear import Linear


def swiglu(gate_up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` over the last dim split in halves; with ``limit > 0`` the Ling clamp
    ``min(silu(gate), L) * clamp(up, -L, L)`` (applied after SiLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act * up


class MLP(nn.Module):
    """``down(swiglu(gate_up(x)))``; the checkpoint's gate_proj and up_proj are fused into ``gate_up_proj``."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, device=device, dtype=dtype)
        self.down_proj = Linear(intermediate_size, hidden_size, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_up_proj(x), self.swiglu_limit))
