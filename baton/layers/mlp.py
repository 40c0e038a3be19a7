"""SwiGLU MLP with fused gate/up weights and the optional post-SiLU clamp (Ling's swiglu limit).

Under tensor parallelism the intermediate dimension is split: gate_up_proj holds this rank's gate rows then its
up rows (column-parallel), down_proj the matching columns (row-parallel, summed over ranks)."""

from __future__ import annotations

import torch
from torch import nn

from baton.layers.linear import FusedLinear, RowParallelLinear
from baton.layers.norm import RMSNorm
from baton.ops.linear import swiglu

__all__ = ["MLP", "swiglu"]


class MLP(nn.Module):
    """``down(swiglu(gate_up(x)))``; the checkpoint's gate_proj and up_proj are fused into ``gate_up_proj``.

    With ``norm`` the input is RMS-normalised first; with ``residual`` the output is added to it (the fast
    path folds both into the projections). ``fp8``: both projections in fp8 with 128 x 128 block scales
    (``--quantization fp8``), the gate and up halves quantised each on its own."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float = 0.0,
                 device=None, dtype=None, fp8: bool = False) -> None:
        super().__init__()
        self.swiglu_limit = swiglu_limit
        self.gate_up_proj = FusedLinear(hidden_size, [("gate_proj", intermediate_size), ("up_proj", intermediate_size)],
                                        device=device, dtype=dtype, fp8=fp8)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, device=device, dtype=dtype, fp8=fp8)

    def forward(self, x: torch.Tensor, norm: RMSNorm | None = None, residual: torch.Tensor | None = None,
                reduce: bool = True) -> torch.Tensor:
        """``reduce=False`` (tensor parallel) returns this rank's partial sum, for a caller that reduces once."""
        act = self.gate_up_proj.linear_swiglu(x, None if norm is None else norm.weight,
                                              1e-6 if norm is None else norm.eps, self.swiglu_limit)
        return self.down_proj.project(act, residual, reduce)
