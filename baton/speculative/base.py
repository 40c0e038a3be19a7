"""The drafter interface the step program drives (engine/step.py): begin after the prefill, then per step a
draft body and an extend body over the device-resident Relay. Each body runs captured in a CUDA graph or
uncaptured (the CPU, ``--disable-cuda-graph``): there is one implementation of every drafter."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

from baton.ops.sampling import logits_to_probs, sample_from_probs
from baton.types import SamplingParams

if TYPE_CHECKING:
    from baton.engine.relay import Relay


def pick_tokens(logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits [N, V] -> (tokens [N], probs [N, V] or None when greedy)."""
    if sampling.is_greedy:
        return logits.argmax(-1), None
    probs = logits_to_probs(logits, sampling.temperature, sampling.top_k, sampling.top_p, sampling.min_p)
    return sample_from_probs(probs, generator), probs


class Drafter(ABC):
    """What a speculative drafter implements. Positions: the anchor (the last committed-but-unverified token,
    produced by the target) sits at ``relay.pos``; the drafts continue from ``relay.pos + 1``.

    Drafts are argmax proposals for every request: the verify treats them as one-hot q, which keeps sampled
    requests exact (speculative/verify.py). A body reads and writes relay tensors only (no host value of this
    step), so it can be captured."""

    num_draft_tokens: int  # verify window: the anchor plus the drafts (k + 1)
    capture_layer_ids: tuple[int, ...] = ()  # target layers whose outputs the drafter reads
    feature_dim: int = 0  # width of ``features(captured)`` (relay.verify_features), 0 if none
    variable_prefix: bool = False  # draft() may set relay.num_drafts below k (the verify then skips the rest)
    # Prefix cache hooks (baton/cache/prefix.py): a drafter that sets ``supports_prefix_cache`` implements
    # ``prefix_buffers`` and ``begin_from``; others run with the prefix cache off.
    supports_prefix_cache: bool = False
    needs_prev_hidden: bool = False  # begin_from(start > 0) needs the target's hidden state at start - 1
    # Deferred extends (engine/step.py): the per-position inputs ``extend_rows`` reads, a subset of ("hidden": the
    # target's final-normed hidden state h_i, "next": the token at i + 1, "features": the tapped features of i).
    # A drafter that names them lets a depth-0 step be the plain decode step (the inputs go to the relay's history
    # ring) and extends over those positions later, in one batch; empty: a depth-0 step verifies the anchor alone
    # and extends over it at once.
    deferred_inputs: tuple[str, ...] = ()

    @abstractmethod
    def reset(self) -> None:
        """Forget the request (its caches are overwritten by the next one's begin)."""

    @abstractmethod
    def begin(self, prompt_ids: torch.Tensor, target_hidden: torch.Tensor, captured: list[torch.Tensor],
              first_token: torch.Tensor) -> None:
        """After the prefill (eager, host shapes): the target's hidden states and tapped features for the prompt,
        and its first token (the anchor at ``len(prompt_ids)``)."""

    def prefix_buffers(self) -> list[tuple[torch.Tensor, int]]:
        """The per-request buffers indexed by position (dim 0), each with its shift: row i depends on the tokens up
        to i + shift (NEXTN: 1, row i pairs h_i with token i+1). The prefix cache copies their rows of a prefix and
        writes them back on a hit (in place: the step program's graphs read these very tensors)."""
        return []

    def begin_from(self, start: int, prompt_ids: torch.Tensor, target_hidden: torch.Tensor,
                   captured: list[torch.Tensor], first_token: torch.Tensor,
                   prev_hidden: torch.Tensor | None) -> None:
        """``begin`` after a prefix-cache hit: the first ``start`` positions' state came from the prefix cache
        (``prefix_buffers`` restored), ``target_hidden`` / ``captured`` cover positions start .. N-1 only (possibly
        none), ``prev_hidden`` [1, d] is the target's hidden state at start - 1."""
        if start != 0:
            raise NotImplementedError(f"{type(self).__name__} has no prefix-cache support")
        self.begin(prompt_ids, target_hidden, captured, first_token)

    def start(self, relay: Relay) -> None:
        """Load what the first draft needs into the relay (after ``relay.reset``); nothing by default."""
        return None

    @abstractmethod
    def draft(self, relay: Relay, arange: torch.Tensor) -> None:
        """Write ``relay.draft_tokens`` [k] for the anchor at ``relay.pos`` (and ``relay.num_drafts``, to verify a
        shorter prefix)."""

    @abstractmethod
    def extend(self, relay: Relay, arange: torch.Tensor) -> None:
        """After the commit: verify rows 0..``relay.num_accepted`` (``relay.verify_hidden`` /
        ``relay.verify_features``) are committed at ``relay.extend_pos`` onwards; rows past the accept count may
        be written too (they land where the next step overwrites them before reading)."""

    def extend_rows(self, relay: Relay, next_tokens: torch.Tensor | None, hidden: torch.Tensor | None,
                    features: torch.Tensor | None, positions: torch.Tensor, last: torch.Tensor) -> None:
        """Extend over committed rows at ``positions`` [n] from their ``deferred_inputs`` (the others None); row
        ``last`` ([1] int64) is the newest committed position, which seeds the next draft. The same positions may
        come more than once with the same inputs (the writes are idempotent)."""
        raise NotImplementedError(f"{type(self).__name__} does not defer its extends (deferred_inputs is empty)")

    def features(self, captured: list[torch.Tensor]) -> torch.Tensor:
        """The tapped layer outputs of a verify, in the order ``relay.verify_features`` holds them (called only
        for a drafter with ``feature_dim > 0``)."""
        raise NotImplementedError(f"{type(self).__name__} taps no target layers (feature_dim 0)")
