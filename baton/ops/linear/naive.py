"""Reference projections with the fusions the fast path makes: an RMSNorm prologue, a residual-add
epilogue, and a SwiGLU epilogue over fused gate/up rows. Plain PyTorch; the Triton kernels match these."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.ops.rmsnorm.naive import rms_norm


def swiglu(gate_up: torch.Tensor, limit: float = 0.0) -> torch.Tensor:
    """``silu(gate) * up`` over the last dim split in halves; with ``limit > 0`` the Ling clamp
    ``min(silu(gate), L) * clamp(up, -L, L)`` (applied after SiLU)."""
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate)
    if limit > 0:
        act = act.clamp(max=limit)
        up = up.clamp(-limit, limit)
    return act * up


def linear(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """``[residual +] (rms_norm(x) if norm_weight else x) @ weight.T``. x [M, K], weight [N, K] -> [M, N]."""
    h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
    y = F.linear(h, weight)
    return y if residual is None else residual + y


def linear_swiglu(x: torch.Tensor, weight: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                  limit: float = 0.0) -> torch.Tensor:
    """``swiglu((rms_norm(x) if norm_weight else x) @ weight.T, limit)``; weight [2I, K] holds gate rows then up
    rows. Returns [M, I]."""
    return swiglu(linear(x, weight, norm_weight, eps), limit)
