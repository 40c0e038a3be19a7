"""NEXTN / MTP chain drafter (SGLang's NEXTN and EAGLE with topk=1).

Convention: the draft's cache row at position i holds the pair (target hidden h_i, token_{i+1}) and its
output predicts token_{i+2}. After the target commits up to position P-1 and produces the anchor at P, the
row at P-1 gives the first draft d1 (position P+1); each further draft forward feeds the draft's own
hidden state back with the token it just proposed. ``extend`` replays the accepted prefix with the
target's real verify hidden states, overwriting the rows the chain wrote, so the next round starts right.
"""

from __future__ import annotations

import torch

from baton.engine.runner import ModelRunner
from baton.layers.context import ForwardContext
from baton.models.base import CausalLM
from baton.models.nextn import NextNLayer
from baton.spec.base import Draft, Drafter, pick_tokens
from baton.types import ForwardMode, SamplingParams


class NextNDrafter(Drafter):
    def __init__(self, target: CausalLM, head: NextNLayer, num_steps: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.target, self.head = target, head
        self.num_steps = num_steps
        self.num_draft_tokens = num_steps + 1
        self.runner = ModelRunner(head.make_cache(max_len, dtype, device), device)
        self._first: torch.Tensor | None = None  # [1] the next round's first draft
        self._first_probs: torch.Tensor | None = None  # [1, V]
        self._hidden: torch.Tensor | None = None  # [1, d] draft hidden that produced it

    def reset(self) -> None:
        self.runner.cache.reset()
        self._first = self._first_probs = self._hidden = None

    def _forward(self, mode: ForwardMode, next_ids: torch.Tensor, hidden: torch.Tensor, start: int) -> torch.Tensor:
        ctx = self.runner.context(mode, start, next_ids.shape[0])
        return self.head(self.target.embed(next_ids), hidden, ctx)

    def _seed(self, draft_hidden: torch.Tensor, sampling: SamplingParams, generator) -> None:
        tok, probs = pick_tokens(self.target.compute_logits(draft_hidden, draft=True), sampling, generator)
        self._first, self._first_probs, self._hidden = tok, probs, draft_hidden

    def begin(self, prompt_ids, target_hidden, captured, first_token, sampling, generator) -> None:
        next_ids = torch.cat([prompt_ids[1:], first_token.reshape(1)])
        g = self._forward(ForwardMode.PREFILL, next_ids, target_hidden, 0)
        self._seed(g[-1:], sampling, generator)

    def draft(self, anchor, anchor_pos, sampling, generator) -> Draft:
        tokens, probs = [self._first], [self._first_probs]
        hidden = self._hidden
        for j in range(1, self.num_steps):
            hidden = self._forward(ForwardMode.DRAFT, tokens[-1], hidden, anchor_pos + j - 1)
            tok, p = pick_tokens(self.target.compute_logits(hidden, draft=True), sampling, generator)
            tokens.append(tok)
            probs.append(p)
        q = None if probs[0] is None else torch.cat(probs)
        return Draft(torch.cat(tokens), q)

    def extend(self, accepted_tokens, target_hidden, captured, num_accepted, anchor_pos, sampling,
               generator) -> None:
        n = num_accepted + 1
        g = self._forward(ForwardMode.EXTEND, accepted_tokens[:n], target_hidden[:n], anchor_pos)
        self._seed(g[-1:], sampling, generator)

    # ---- CUDA-graph bodies (engine/graphs.py): every step-varying value comes from the relay ----

    def _graph_forward(self, mode: ForwardMode, next_ids, hidden, positions) -> torch.Tensor:
        ctx = ForwardContext(mode, positions, self.runner.cache, kv_len=None)
        return self.head(self.target.embed(next_ids), hidden, ctx)

    def graph_start(self, relay) -> None:
        """The graph chain drafts by argmax (its verify takes q one-hot, also for sampled requests), so the
        first draft is the argmax too, even when ``begin`` sampled one for the eager path."""
        relay.first_draft.copy_(self.target.greedy_tokens(self._hidden, draft=True).reshape(1))
        relay.draft_hidden.copy_(self._hidden)

    def graph_draft(self, relay, arange) -> None:
        """All chain forwards of one step (greedy): the first draft came from the last extend."""
        tokens, hidden = [relay.first_draft], relay.draft_hidden
        for j in range(1, self.num_steps):
            hidden = self._graph_forward(ForwardMode.DRAFT, tokens[-1], hidden, relay.pos + (j - 1))
            tokens.append(self.target.greedy_tokens(hidden, draft=True))
        relay.draft_tokens.copy_(torch.cat(tokens))

    def graph_extend(self, relay, arange) -> None:
        """Replay every verify row (rows past the accept count are overwritten before they are read); row
        ``num_accepted`` seeds the next round."""
        g = self._graph_forward(ForwardMode.EXTEND, relay.accepted_tokens, relay.verify_hidden,
                                relay.extend_pos + arange)
        row = g.index_select(0, relay.num_accepted)
        relay.draft_hidden.copy_(row)
        relay.first_draft.copy_(self.target.greedy_tokens(row, draft=True))
