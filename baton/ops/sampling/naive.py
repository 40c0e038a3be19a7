"""Reference logits processing and sampling: temperature, top-k, top-p, min-p, seeded draws.

Everything is tensor-in / tensor-out with no host reads, so the same functions run inside CUDA graphs
(``logits_to_probs_t`` takes its settings as device tensors for that).
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


def logits_to_probs_t(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                      min_p: torch.Tensor) -> torch.Tensor:
    """``logits_to_probs`` with the parameters as device tensors ([1] each; top_k int, <= 0 = off), so one
    captured graph serves every request's settings. One descending sort does top-k (by rank), top-p and min-p;
    the result equals ``logits_to_probs`` except on exact ties at the top-k boundary (broken by the sort)."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    rank = torch.arange(probs.shape[-1], device=probs.device)
    keep = (top_k <= 0) | (rank < top_k)  # [V]
    sorted_probs = sorted_probs * keep
    cum = sorted_probs.cumsum(-1)
    drop = (cum - sorted_probs) > top_p * cum[:, -1:]  # the smallest prefix reaching top_p (no-op at 1.0)
    drop |= sorted_probs < min_p * sorted_probs[:, :1]  # min-p against the largest
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
    return probs / probs.sum(-1, keepdim=True)


def sample_from_probs(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """probs [N, V] -> token ids [N] (int64): argmax of probs / Exp(1) noise, an exact draw (the algorithm
    ``torch.multinomial`` uses for one sample, without its host-side validity check, so it runs inside CUDA
    graphs). ``generator=None`` draws from the default generator (seeded per request on the graph path)."""
    noise = torch.empty_like(probs, dtype=torch.float32).exponential_(1.0, generator=generator)
    return (probs.float() / noise).argmax(-1)
