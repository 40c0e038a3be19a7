"""Bias-free linear layers. The tensor-parallel variants will live here too (column / row parallel)."""

from __future__ import annotations

from torch import nn


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose weight is ``[out, in]``, as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)
