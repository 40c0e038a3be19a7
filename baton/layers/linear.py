"""Bias-free linear layers, and fused projections whose weight stacks several checkpoint tensors by rows.

``FusedLinear`` keeps the checkpoint names of its parts in ``hf_row_splits`` so that loading and saving see
the published layout (e.g. q_proj / k_proj / v_proj) while the forward runs one GEMV.
"""

from __future__ import annotations

import torch
from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose weight is ``[out, in]``, as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)


class FusedLinear(Linear):
    """Rows of several checkpoint projections stacked: ``parts`` is [(checkpoint name, rows), ...], the names
    relative to this module's parent (e.g. "q_proj" for ``...self_attn.q_proj.weight``)."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], device=None, dtype=None) -> None:
        super().__init__(in_features, sum(rows for _, rows in parts), device=device, dtype=dtype)
        self.parts = list(parts)
        self.hf_row_splits = {"weight": [(f"{name}.weight", rows) for name, rows in parts]}

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split([rows for _, rows in self.parts], dim=-1)
