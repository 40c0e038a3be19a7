"""NEXTN / MTP chain drafter (SGLang's NEXTN and EAGLE with topk=1).

Convention: the draft's cache row at position i holds the pair (target hidden h_i, token_{i+1}) and its
output predicts token_{i+2}. After the target commits up to position P-1 and produces the anchor at P, the
row at P-1 gives the first draft d1 (position P+1); each further draft forward feeds the draft's own
hidden state back with the token it just proposed (argmax drafts). ``extend`` replays the verify rows with the
target's real hidden states, overwriting the rows the chain wrote, so the next round starts right.
"""

from __future__ import annotations

import torch

from baton.layers.context import ForwardContext, ModelRunner
from baton.models.base import CausalLM
from baton.models.nextn import NextNLayer
from baton.speculative.base import Drafter
from baton.types import ForwardMode


class NextNDrafter(Drafter):
    def __init__(self, target: CausalLM, head: NextNLayer, num_steps: int, max_len: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.target, self.head = target, head
        self.num_steps = num_steps
        self.num_draft_tokens = num_steps + 1
        self.runner = ModelRunner(head.make_cache(max_len, dtype, device), device)
        self._hidden: torch.Tensor | None = None  # [1, d] the draft hidden state after the prompt

    supports_prefix_cache = True
    needs_prev_hidden = True

    @property
    def deferred_inputs(self) -> tuple[str, ...]:
        """Row i = (h_i, token i+1) is a function of its inputs alone for an attention head; a recurrent head's
        state would advance over the repeated rows of a deferred extend, so it extends at every step."""
        return () if self.runner.cache.state_buffers() else ("hidden", "next")

    def prefix_buffers(self) -> list[tuple[torch.Tensor, int]]:
        if self.runner.cache.state_buffers():
            return []  # a recurrent head's state would depend on the next token: not cacheable
        return [(t, 1) for t in self.runner.cache.row_buffers()]

    def begin_from(self, start, prompt_ids, target_hidden, captured, first_token, prev_hidden) -> None:
        """Rows start-1 .. N-1 (rows below start-1 came from the prefix cache): row i = (h_i, token i+1)."""
        if start == 0:
            return self.begin(prompt_ids, target_hidden, captured, first_token)
        hidden = torch.cat([prev_hidden.reshape(1, -1).to(target_hidden.dtype), target_hidden])
        next_ids = torch.cat([prompt_ids[start:], first_token.reshape(1)])
        ctx = self.runner.context(ForwardMode.PREFILL, start - 1, next_ids.shape[0])
        self._hidden = self.head(self.target.embed(next_ids), hidden, ctx)[-1:]

    def reset(self) -> None:
        self.runner.cache.reset()
        self._hidden = None

    def begin(self, prompt_ids, target_hidden, captured, first_token) -> None:
        """The head over the prompt: row i is (h_i, token i+1); its last row seeds the first draft."""
        next_ids = torch.cat([prompt_ids[1:], first_token.reshape(1)])
        ctx = self.runner.context(ForwardMode.PREFILL, 0, next_ids.shape[0])
        self._hidden = self.head(self.target.embed(next_ids), target_hidden, ctx)[-1:]

    # ---- the step bodies (engine/step.py): every step-varying value comes from the relay ----

    def _forward(self, relay, mode: ForwardMode, next_ids, hidden, positions) -> torch.Tensor:
        ctx = ForwardContext(mode, positions, self.runner.cache, kv_len=relay.kv_len(self.num_draft_tokens))
        return self.head(self.target.embed(next_ids), hidden, ctx)

    def start(self, relay) -> None:
        relay.first_draft.copy_(self.target.greedy_tokens(self._hidden, draft=True).reshape(1))
        relay.draft_hidden.copy_(self._hidden)

    def draft(self, relay, arange) -> None:
        """The chain forwards of one step, ``arange.shape[0] - 1`` drafts (the step's depth): the first draft came
        from the last extend."""
        tokens, hidden = [relay.first_draft], relay.draft_hidden
        for j in range(1, arange.shape[0] - 1):
            hidden = self._forward(relay, ForwardMode.DRAFT, tokens[-1], hidden, relay.pos + (j - 1))
            tokens.append(self.target.greedy_tokens(hidden, draft=True))
        relay.draft_tokens[: len(tokens)].copy_(torch.cat(tokens))

    def extend(self, relay, arange) -> None:
        """Replay every verify row of the step (rows past the accept count are overwritten before they are read);
        row ``num_accepted`` seeds the next round."""
        n = arange.shape[0]
        self.extend_rows(relay, relay.accepted_tokens[:n], relay.verify_hidden[:n], None, relay.extend_pos + arange,
                         relay.num_accepted)

    def extend_rows(self, relay, next_tokens, hidden, features, positions, last) -> None:
        """The head over rows (h_i, token i+1) at ``positions``; row ``last`` seeds the next round."""
        g = self._forward(relay, ForwardMode.EXTEND, next_tokens, hidden, positions)
        row = g.index_select(0, last)
        relay.draft_hidden.copy_(row)
        relay.first_draft.copy_(self.target.greedy_tokens(row, draft=True))
