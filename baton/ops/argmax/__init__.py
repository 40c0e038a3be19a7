"""Argmax over logits rows, and the greedy DSpark Markov chain; ``argmax_rows`` / ``markov_greedy`` pick the
implementation for the device.

CUDA tensors take the vocabulary-parallel Triton kernels (``triton.py``) when triton imports and
``baton.env.use_triton()`` allows; everything else the plain-PyTorch reference (``naive.py``). Triton is imported
on the first CUDA call, never by importing this package.
"""

from __future__ import annotations

import torch

from baton.ops.argmax import naive
from baton.ops.attention import triton_module

__all__ = ["argmax_rows", "markov_greedy"]


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] -> [M] int64: each row's argmax, the lowest index among ties."""
    impl = triton_module("baton.ops.argmax.triton", x)
    if impl is not None and impl.supports(x):
        return impl.argmax_rows(x)
    return naive.argmax_rows(x)


def markov_greedy(base_logits: torch.Tensor, anchor: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """The greedy Markov chain of a DSpark block (``naive.markov_greedy``): base_logits [gamma, V], anchor [1],
    w1 / w2 [V, r] -> tokens [gamma] int64."""
    impl = triton_module("baton.ops.argmax.triton", base_logits)
    if impl is not None and impl.supports(base_logits):
        return impl.markov_greedy(base_logits, anchor, w1, w2)
    return naive.markov_greedy(base_logits, anchor, w1, w2)
