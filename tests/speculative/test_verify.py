"""Verification rules. Greedy: accept while equal to the target argmax. Sampled: chain rejection sampling must
reproduce the target distribution exactly (statistical test with a fixed seed).

The bound: for an exact sampler, the empirical distribution of N i.i.d. draws over V outcomes satisfies
P(TV > eps) <= (2^V - 2) exp(-2 N eps^2) (Bretagnolle-Huber-Carol). With V = 6 and N = 20000, eps = 0.02
gives a failure probability below 1e-5. We also check that the test has power: a sampler that accepts every
draft lands far outside the bound.
"""

from __future__ import annotations

import torch

from baton.speculative.verify import greedy_verify, rejection_verify

V = 6
N = 20000
EPS = 0.02


def test_greedy_verify_counts_leading_matches():
    logits = torch.full((4, V), -1.0)
    for row, tok in enumerate([2, 4, 1, 5]):
        logits[row, tok] = 3.0
    v = greedy_verify(torch.tensor([2, 4, 0]), logits)
    assert int(v.num_accepted) == 2 and int(v.bonus) == 1
    assert v.accepted_tokens[:3].tolist() == [2, 4, 1]
    v = greedy_verify(torch.tensor([2, 4, 1]), logits)
    assert int(v.num_accepted) == 3 and int(v.bonus) == 5  # all accepted: bonus from the last row
    v = greedy_verify(torch.tensor([0, 4, 1]), logits)
    assert int(v.num_accepted) == 0 and int(v.bonus) == 2


def _tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - p).abs().sum().item()


def _simulate(p: torch.Tensor, q: torch.Tensor | None, sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """Two-position chain: returns counts of the first emitted token, and of the second given first == 0."""
    gen = torch.Generator().manual_seed(1234)
    first = torch.zeros(V)
    second_given0 = torch.zeros(V)
    for _ in range(N):
        if q is None:
            drafts = torch.tensor([0, 1])  # a deterministic (argmax-like) draft: one-hot q
        else:
            drafts = torch.stack([torch.multinomial(q[i], 1, generator=gen)[0] for i in range(2)])
        v = sampler(drafts, q, p, gen)
        a = int(v.num_accepted)
        toks = v.accepted_tokens[: a + 1].tolist()
        first[toks[0]] += 1
        if toks[0] == 0 and len(toks) > 1:
            second_given0[toks[1]] += 1
    return first, second_given0


def _targets():
    torch.manual_seed(0)
    p = torch.softmax(torch.randn(3, V) * 1.5, -1)
    near = torch.softmax(torch.log(p[:2]) + 0.3 * torch.randn(2, V), -1)
    far = torch.softmax(-torch.log(p[:2]) * 2, -1)  # mass where the target has little
    return p, near, far


def test_rejection_sampling_reproduces_target_near_and_far():
    p, near, far = _targets()
    for q in (near, far, None):
        first, second = _simulate(p, q, rejection_verify)
        assert _tv(first, p[0]) < EPS, q
        # The second token, given the first was accepted as draft 0, comes from p[1] whatever happened.
        if second.sum() > 2000:
            assert _tv(second, p[1]) < 3 * EPS * (N / second.sum().item()) ** 0.5


def test_the_statistical_test_has_power():
    p, _, far = _targets()

    def accept_all(drafts, q, target_probs, gen):
        v = rejection_verify(drafts, q, target_probs, gen)
        v.num_accepted = torch.tensor(2)
        v.accepted_tokens = torch.cat([drafts, v.bonus.reshape(1)])
        return v

    first, _ = _simulate(p, far, accept_all)
    assert _tv(first, p[0]) > 5 * EPS


def test_rejection_sampling_with_the_depth_changing_each_step():
    """Adaptive depth: the number of drafts verified changes from step to step (0, 1, 2); the first emitted token
    still follows p[0], and the second (after an accepted draft 0) p[1]."""
    p, near, far = _targets()
    depths = [2, 0, 1]
    for q in (near, None):
        gen = torch.Generator().manual_seed(99)
        first, second = torch.zeros(V), torch.zeros(V)
        for i in range(N):
            d = depths[i % 3]
            if q is None:
                drafts = torch.tensor([0, 1])[:d]
            else:
                drafts = torch.stack([torch.multinomial(q[j], 1, generator=gen)[0] for j in range(2)])[:d]
            v = rejection_verify(drafts, None if q is None else q[:d], p[: d + 1], gen)
            toks = v.accepted_tokens[: int(v.num_accepted) + 1].tolist()
            first[toks[0]] += 1
            if d > 0 and toks[0] == 0 and len(toks) > 1:
                second[toks[1]] += 1
        assert _tv(first, p[0]) < EPS, q
        if second.sum() > 2000:
            assert _tv(second, p[1]) < 3 * EPS * (N / second.sum().item()) ** 0.5
