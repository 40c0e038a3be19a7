"""Logits processing: temperature, top-k, top-p, min-p, and seeded draws."""

from __future__ import annotations

import torch

from baton.ops.sampling import logits_to_probs, sample_from_probs


def test_temperature_only_is_softmax():
    logits = torch.randn(3, 11)
    torch.testing.assert_close(logits_to_probs(logits, 0.7), torch.softmax(logits / 0.7, -1))


def test_top_k_keeps_k_largest():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0]])
    p = logits_to_probs(logits, 1.0, top_k=2)
    assert (p[0] > 0).tolist() == [False, True, False, True, False]
    torch.testing.assert_close(p.sum(-1), torch.ones(1))


def test_top_p_keeps_smallest_prefix_reaching_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    p = logits_to_probs(probs.log(), 1.0, top_p=0.75)  # 0.5 < 0.75 <= 0.8: keep the first two
    torch.testing.assert_close(p, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    p = logits_to_probs(probs.log(), 1.0, top_p=0.45)  # the top token alone reaches 0.45
    torch.testing.assert_close(p, torch.tensor([[1.0, 0.0, 0.0, 0.0]]))


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05]])
    p = logits_to_probs(probs.log(), 1.0, min_p=0.2)  # threshold 0.12
    torch.testing.assert_close(p, torch.tensor([[0.6, 0.25, 0.0, 0.0]]) / 0.85)


def test_seeded_draws_reproduce():
    probs = torch.softmax(torch.randn(4, 50), -1)
    a = sample_from_probs(probs, torch.Generator().manual_seed(5))
    b = sample_from_probs(probs, torch.Generator().manual_seed(5))
    assert torch.equal(a, b)
