"""Verification of a draft chain against the target, with no host reads (all results are device tensors).

Greedy: accept while the draft equals the target argmax; the bonus is the target argmax after the last
match. Sampled: exact chain rejection sampling (Leviathan et al.): accept draft d_i with probability
min(1, p_i(d_i) / q_i(d_i)); on the first rejection sample from normalise(max(p_i - q_i, 0)); if all k are
accepted, sample the bonus from p_k. A draft proposed by argmax has a one-hot q, which turns the same rule
into the "target-only" rule (accept with probability p(d), resample from p with d removed): both are
lossless.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.ops.sampling import sample_from_probs


@dataclass
class Verdict:
    num_accepted: torch.Tensor  # [] int64: accepted drafts a (0..k); the step commits a + 1 tokens
    bonus: torch.Tensor  # [] int64: the token after the accepted drafts (correction or bonus)
    accepted_tokens: torch.Tensor  # [k + 1] int64: drafts[:a] then bonus at index a (rest: garbage)


def _assemble(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    out = torch.cat([draft_tokens, draft_tokens.new_zeros(1)])
    return out.scatter(0, num_accepted.reshape(1), bonus.reshape(1))


def greedy_verify(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> Verdict:
    """draft_tokens [k], target_logits [k+1, V] (row i scores the token after chain position i)."""
    return greedy_verify_tokens(draft_tokens, target_logits.argmax(-1))


def _within(limit: torch.Tensor | None, k: int, device: torch.device) -> torch.Tensor | bool:
    """[k] bool: draft i may be accepted (i < limit); True without a limit."""
    if limit is None:
        return True
    return torch.arange(k, device=device) < limit.reshape(())


def greedy_verify_tokens(draft_tokens: torch.Tensor, predict: torch.Tensor,
                         limit: torch.Tensor | None = None) -> Verdict:
    """draft_tokens [k], predict [k+1]: the target's argmax after each chain position (e.g. from
    ``CausalLM.greedy_tokens``, which needs no full logits under tensor parallelism). ``limit`` (a device
    scalar <= k): only the first ``limit`` drafts may be accepted, as if only they had been verified."""
    k = draft_tokens.shape[0]
    match = ((predict[:k] == draft_tokens) & _within(limit, k, draft_tokens.device)).long()
    num_accepted = match.cumprod(0).sum()
    bonus = predict.gather(0, num_accepted.reshape(1))[0]
    return Verdict(num_accepted, bonus, _assemble(draft_tokens, num_accepted, bonus))


def rejection_verify(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     generator: torch.Generator | None, limit: torch.Tensor | None = None) -> Verdict:
    """draft_tokens [k]; draft_probs [k, V] (the distributions the drafts were drawn from) or None for
    argmax drafts (one-hot q); target_probs [k+1, V] after temperature / top-k / top-p. ``limit`` (a device
    scalar <= k): only the first ``limit`` drafts are verified; stopping there, the next token is drawn from p
    itself (the unverified draft's q plays no part), so the rule stays exact."""
    k, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = F.one_hot(draft_tokens, vocab).to(target_probs.dtype)
    within = _within(limit, k, draft_tokens.device)
    if limit is not None:
        draft_probs = draft_probs * within[:, None]  # rows past the limit: no proposal, residual = p
    p_d = target_probs[:k].gather(1, draft_tokens[:, None])[:, 0]
    q_d = draft_probs.gather(1, draft_tokens[:, None])[:, 0]
    u = torch.rand(k, generator=generator, device=target_probs.device, dtype=torch.float32)
    accept = ((u * q_d < p_d) & within).long()
    num_accepted = accept.cumprod(0).sum()
    q_pad = torch.cat([draft_probs, draft_probs.new_zeros(1, vocab)])  # row k: bonus, residual = p
    idx = num_accepted.reshape(1)
    p_row = target_probs.index_select(0, idx)
    residual = (p_row - q_pad.index_select(0, idx)).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_row)
    bonus = sample_from_probs(residual, generator)[0]
    return Verdict(num_accepted, bonus, _assemble(draft_tokens, num_accepted, bonus))


def verdict_from(draft_tokens: torch.Tensor, num_accepted: torch.Tensor, bonus: torch.Tensor) -> Verdict:
    """A verdict with a given accepted count (device tensor) and bonus token."""
    a = num_accepted.reshape(())
    return Verdict(a, bonus, _assemble(draft_tokens, a, bonus))
