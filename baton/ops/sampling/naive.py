"""Reference logits processing and sampling: temperature, top-k, top-p, min-p, seeded draws.

Everything is tensor-in / tensor-out with no host reads, so the same functions run inside CUDA graphs.
"""

from __future__ import annotations

import torch


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = -1, top_p: float = 1.0,
                    min_p: float = 0.0) -> torch.Tensor:
    """logits [N, V] -> fp32 probabilities [N, V] after temperature, top-k, top-p and min-p (in that order,
    as SGLang applies them). temperature must be > 0; greedy callers take an argmax instead."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_k > 0 and top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        cum = sorted_probs.cumsum(-1)
        drop_sorted = (cum - sorted_probs) > top_p * cum[:, -1:]  # keep the smallest prefix reaching top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if min_p > 0.0:
        probs = probs.masked_fill(probs < min_p * probs.max(-1, keepdim=True).values, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> token ids [N] (int64)."""
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
