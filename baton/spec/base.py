"""The drafter interface the engine loop drives: begin after prefill, draft a chain, extend after verify."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from baton.ops.sampling import logits_to_probs, sample_from_probs
from baton.types import SamplingParams


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] int64: the proposed chain after the anchor
    probs: torch.Tensor | None  # [k, V] the distributions the tokens were drawn from; None for argmax drafts


def pick_tokens(logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] -> (tokens [N], probs [N, V] or None when greedy)."""
    if sampling.is_greedy:
        return logits.argmax(-1), None
    probs = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    return sample_from_probs(probs, generator), probs


class Drafter:
    """What a speculative drafter implements. Positions: the anchor (the last committed-but-unverified
    token, produced by the target) sits at ``anchor_pos``; the chain continues from anchor_pos + 1."""

    num_draft_tokens: int  # verify window: the anchor plus the drafts
    capture_layer_ids: tuple[int, ...] = ()  # target layers whose outputs the drafter reads

    def reset(self) -> None:
        raise NotImplementedError

    def begin(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor, captured: list[torch.Tensor],
              first_token: torch.Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> None:
        """After prefill: the target's hidden states / captured features for the prompt and its first token."""
        raise NotImplementedError

    def draft(self, anchor: torch.Tensor, anchor_pos: int, sampling: SamplingParams,
              generator: torch.Generator | None) -> Draft:
        raise NotImplementedError

    def extend(self, accepted_tokens: torch.Tensor, target_hidden: torch.Tensor, captured: list[torch.Tensor],
               num_accepted: int, anchor_pos: int, sampling: SamplingParams,
               generator: torch.Generator | None) -> None:
        """After the verdict: ``accepted_tokens[:a+1]`` are the accepted drafts then the bonus; the target's
        verify rows ``0..a`` (anchor and accepted drafts) are now committed."""
        raise NotImplementedError
