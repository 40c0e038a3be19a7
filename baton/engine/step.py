"""The decode step program: the only one. Each step is {draft, verify, accept, commit, extend} (or one plain
decode forward) over device-resident values in the Relay, and the host reads each step's tokens one step late.

``StepProgram(..., capture=True)`` captures the step bodies as CUDA graphs once at start-up and replays them;
``capture=False`` runs the very same bodies eagerly: on the CPU, and on CUDA with ``--disable-cuda-graph``.
The drafter supplies its own bodies (``Drafter.start`` / ``draft`` / ``extend``, speculative/base.py): NEXTN
chains and DSpark / DFlash blocks, whose confidence-scheduled prefix rule sets ``relay.num_drafts`` on the device.

Every step-varying value is read from the relay on the device: positions are ``pos + arange``, attention covers
the whole preallocated cache with a position mask (uncaptured on the CPU, the host may read ``pos`` for free and
slices the cache instead: the same result), the accept count indexes the staged KDA state, the extend rows and
the draft seed. The host therefore never needs a value a step produces to launch the next one.

A depth-0 step of a speculative program is the plain decode step when the drafter can defer its extends
(``Drafter.deferred_inputs``): it keeps the inputs the drafter's extend would read for the committed position in the
relay's history ring, and the drafter catches up over the positions since its last extend in one batch (one body of
HISTORY rows, newest last, repeated rows idempotent) before the next step that drafts, or when the ring is full. So
when the depth policy turns speculation off, a step costs what plain decoding costs (plus one row copy), and the
drafter's context is whole when speculation comes back. The host counts the deferred positions (a depth-0 step
commits exactly one token), so the catch-up needs no value from the device.

The verify honours ``relay.num_drafts`` (how many of the k drafts may be accepted; k unless the drafter says
fewer): the shapes stay fixed at k + 1 rows, rows past the limit are computed and never committed.

Sampled requests (temperature > 0) run on a second set of bodies (captured at their first use). The decode
samples from ``logits_to_probs_t`` (the request's temperature / top-k / top-p / min-p in relay tensors) with the
default generator, which the engine seeds per request (graph replays advance its Philox offset, so a seed
repeats a request exactly); the drafts are the argmax ones of the greedy bodies and the verify is the exact
rejection rule with a one-hot q (lossless: ``spec.verify.rejection_verify``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from baton.engine.relay import HISTORY
from baton.layers.context import ForwardContext
from baton.ops.sampling import logits_to_probs_t, sample_from_probs
from baton.speculative.verify import greedy_verify_tokens, rejection_verify, verdict_from
from baton.types import ForwardMode

if TYPE_CHECKING:
    from baton.cache.model_cache import ModelCache
    from baton.models.base import CausalLM
    from baton.speculative.base import Drafter

log = logging.getLogger(__name__)


def capture_graph(body: Callable[[], Any], pool, before: Callable[[], Any] | None = None
                  ) -> tuple[torch.cuda.CUDAGraph, Any]:
    """``body`` captured as a CUDA graph in ``pool``: two eager warm-up runs on a side stream (the allocator,
    Triton compilation and autotuning, cuBLAS handles), then the capture; ``before`` runs ahead of each of the three
    (resetting what the body advances). Returns the graph and what the captured run of ``body`` returned (its
    static outputs). Used by the step program and the short-prefill graphs (engine/prefill_graph.py)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            if before is not None:
                before()
            body()
    torch.cuda.current_stream().wait_stream(stream)
    if before is not None:
        before()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = body()
    return graph, out


class StepProgram:
    """The decode step program of one engine: ``model`` over ``cache``, with ``drafter`` (None: plain decoding)
    proposing up to ``num_verify - 1`` drafts a step. ``depths``: the draft depths the program can run (each its
    own set of bodies over the same relay; default: only the full depth k); a step at depth d verifies the anchor
    and d drafts (d = 0: the anchor alone, and the drafter still extends over it, so it can speculate again at
    the next step). ``sim_table``: accepted-draft counts cycled by the step counter
    (``--speculative-simulate-accept-len``), or None for real verification. ``capture``: CUDA graphs (CUDA
    only); False runs the same bodies eagerly."""

    def __init__(self, model: CausalLM, cache: ModelCache, drafter: Drafter | None, num_verify: int,
                 dtype: torch.dtype, device: torch.device, *, depths: Sequence[int] | None = None,
                 sim_table: torch.Tensor | None = None, capture: bool = True) -> None:
        from baton.engine.relay import Relay

        self.model = model
        self.cache = cache
        self.drafter = drafter
        self.spec = drafter is not None
        self.num_verify = num_verify  # k + 1 (1 for plain decode)
        self.max_depth = num_verify - 1
        self.depths = tuple(sorted(set(depths))) if (depths and self.spec) else (self.max_depth,)
        if self.depths[0] < 0 or self.depths[-1] != self.max_depth:
            raise ValueError(f"depths {self.depths} must lie in [0, {self.max_depth}] and include {self.max_depth}")
        self.device = device
        feature_dim = drafter.feature_dim if drafter is not None else 0
        # depth 0 is the plain decode step, the drafter's extends deferred (module docstring)
        self.defers = self.spec and self.depths[0] == 0 and bool(drafter.deferred_inputs)
        history = drafter.deferred_inputs if self.defers else ()
        self.relay = Relay(num_verify, model.config.hidden_size, dtype, device, feature_dim, history)
        self.gap = 0  # positions committed by depth-0 steps since the drafter's last extend (host count)
        self.relay.slice_cache = not capture and device.type == "cpu"
        self.arange = torch.arange(num_verify, device=device)
        self.one = torch.ones(1, dtype=torch.long, device=device)
        self.sim_table = sim_table if self.spec else None
        if self.sim_table is not None and len(self.depths) > 1:
            raise ValueError("simulated acceptance runs at one depth (the full one)")
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._replays = {d: self._build(self._bodies(d, sampled=False)) for d in self.depths}
        self._sampled: dict[int, list] | None = None  # captured on the first sampled request
        if self.defers:
            self.history_arange = torch.arange(HISTORY, device=device)
            self.history_last = torch.full((1,), HISTORY - 1, dtype=torch.long, device=device)
            self._catch_up_replay = self._build([self._catch_up])[0]

    @property
    def replays(self) -> list:
        """The full-depth step's replays (what the census times)."""
        return self._replays[self.max_depth]

    def _bodies(self, depth: int, sampled: bool) -> list:
        if not self.spec or (depth == 0 and self.defers):
            return [self._decode_sampled if sampled else self._decode]
        rows = self.arange[: depth + 1]
        verify = self._verify_sampled if sampled else self._verify
        bodies = [lambda: self._draft(rows)] if depth > 0 else []
        return bodies + [lambda: verify(rows), lambda: self._extend(rows)]

    def _build(self, bodies) -> list:
        if not self.capture:
            return list(bodies)
        with torch.inference_mode():
            replays = [self._capture(body).replay for body in bodies]
        self.relay.pos.zero_()
        torch.cuda.synchronize(self.device)
        return replays

    def _sampled_replays(self) -> dict[int, list]:
        """The sampled program's graphs (captured now if this is the first sampled request)."""
        if self._sampled is None:
            self._sampled = {d: self._build(self._bodies(d, sampled=True)) for d in self.depths}
        return self._sampled

    def prepare_sampled(self) -> None:
        """Capture the sampled bodies if they are not yet (before a sampled request's state exists)."""
        self._sampled_replays()

    # ---- the step bodies ----

    def _decode(self) -> None:
        self._decode_step(self.model.greedy_tokens)

    def _decode_sampled(self) -> None:
        self._decode_step(lambda hidden: sample_from_probs(self._probs(hidden), None))

    def _decode_step(self, pick) -> None:
        """One plain decode step: the anchor's forward, the next token by ``pick(hidden)``, the relay updated. In a
        speculative program (depth 0, deferred extends) the position's drafter inputs also go to the history ring."""
        r = self.relay
        capture = self.drafter.capture_layer_ids if self.defers and r.hist_features is not None else ()
        ctx = ForwardContext(ForwardMode.DECODE, r.pos + self.arange[:1], self.cache, kv_len=r.kv_len(1),
                             capture_layer_ids=capture)
        hidden = self.model(r.anchor, ctx)
        r.verify_hidden[:1].copy_(hidden)  # h of the last committed position (the prefix cache's snapshot)
        token = pick(hidden)
        if self.defers:
            slot = torch.remainder(r.pos, HISTORY)
            if r.hist_hidden is not None:
                r.hist_hidden.index_copy_(0, slot, hidden)
            if r.hist_next is not None:
                r.hist_next.index_copy_(0, slot, token.reshape(1))
            if r.hist_features is not None:
                r.hist_features.index_copy_(0, slot, self.drafter.features(ctx.captured))
            r.num_accepted.zero_()  # verify_hidden[num_accepted] is the last committed position's h
        r.anchor.copy_(token)
        r.publish(token, self.one)
        r.pos.add_(1)

    def _probs(self, hidden: torch.Tensor) -> torch.Tensor:
        r = self.relay
        return logits_to_probs_t(self.model.compute_logits(hidden), r.temperature, r.top_k, r.top_p, r.min_p)

    def _draft(self, rows: torch.Tensor) -> None:
        """The drafter's body for ``rows.shape[0] - 1`` drafts; a drafter that proposes more (DSpark's block)
        has them verified only up to this depth."""
        self.drafter.draft(self.relay, rows)

    def _verify_forward(self, rows: torch.Tensor) -> torch.Tensor:
        """The target over [anchor, d drafts] at pos .. pos + d; hidden states (and tapped features) to the relay."""
        r = self.relay
        n = rows.shape[0]
        ids = torch.cat([r.anchor, r.draft_tokens[: n - 1]])
        active = r.num_drafts + 1 if self.drafter.variable_prefix and n > 1 else None  # rows past it: no experts
        ctx = ForwardContext(ForwardMode.VERIFY, r.pos + rows, self.cache, kv_len=r.kv_len(n),
                             capture_layer_ids=self.drafter.capture_layer_ids, active_rows=active)
        hidden = self.model(ids, ctx)
        r.verify_hidden[:n].copy_(hidden)
        if r.verify_features is not None:
            r.verify_features[:n].copy_(self.drafter.features(ctx.captured))
        return hidden

    def _verify(self, rows: torch.Tensor) -> None:
        r = self.relay
        drafts = r.draft_tokens[: rows.shape[0] - 1]
        predict = self.model.greedy_tokens(self._verify_forward(rows))  # [d+1]: no full logits gathered under TP
        if self.sim_table is None:
            verdict = greedy_verify_tokens(drafts, predict, r.num_drafts)
        else:
            a = self._simulated_accept()
            verdict = verdict_from(drafts, a, predict.index_select(0, a)[0])
        self._commit(verdict)

    def _verify_sampled(self, rows: torch.Tensor) -> None:
        """The sampled verify: target probabilities of the d + 1 rows, the rejection rule against argmax drafts
        (q one-hot), the correction or bonus drawn from the residual (the default generator)."""
        r = self.relay
        drafts = r.draft_tokens[: rows.shape[0] - 1]
        probs = self._probs(self._verify_forward(rows))  # [d+1, V]
        if self.sim_table is None:
            verdict = rejection_verify(drafts, None, probs, None, r.num_drafts)
        else:
            a = self._simulated_accept()
            verdict = verdict_from(drafts, a, sample_from_probs(probs.index_select(0, a), None)[0])
        self._commit(verdict)

    def _simulated_accept(self) -> torch.Tensor:
        return self.sim_table.index_select(0, torch.remainder(self.relay.step, self.sim_table.shape[0]))

    def _commit(self, verdict) -> None:
        r = self.relay
        self.cache.commit(verdict.num_accepted)
        r.extend_pos.copy_(r.pos)
        r.num_accepted.copy_(verdict.num_accepted.reshape(1))
        r.accepted_tokens[: verdict.accepted_tokens.shape[0]].copy_(verdict.accepted_tokens)
        r.publish(verdict.accepted_tokens, verdict.num_accepted + 1)
        r.pos.add_(verdict.num_accepted + 1)
        r.anchor.copy_(verdict.bonus.reshape(1))

    def _extend(self, rows: torch.Tensor) -> None:
        self.drafter.extend(self.relay, rows)

    def _catch_up(self) -> None:
        """The drafter's deferred extend over the newest ``relay.catchup_count`` committed positions (at most
        HISTORY, ending at pos - 1), from the history ring: HISTORY rows, the rows past the count repeating the
        newest position (the same writes again), so the last row is the newest."""
        r = self.relay
        i = torch.minimum(self.history_arange, r.catchup_count - 1)
        positions = (r.pos - r.catchup_count + i).clamp_min(0)
        slots = torch.remainder(positions, HISTORY)

        def rows(t):
            return None if t is None else t.index_select(0, slots)

        self.drafter.extend_rows(r, rows(r.hist_next), rows(r.hist_hidden), rows(r.hist_features), positions,
                                 self.history_last)

    # ---- capture and replay ----

    def _capture(self, body) -> torch.cuda.CUDAGraph:
        return capture_graph(body, self.pool, before=self.relay.pos.zero_)[0]

    def start(self, anchor: torch.Tensor, pos: int) -> None:
        """Load the relay after the prefill (and the drafter's begin)."""
        self.relay.reset(anchor, pos)
        self.gap = 0
        if self.spec:
            self.drafter.start(self.relay)

    def step(self, host_step: int, sampled: bool = False, depth: int | None = None) -> None:
        """Enqueue one decode step at ``depth`` (one of ``depths``; None: the full depth) and the copy of its
        committed tokens; returns without waiting."""
        replays = self._sampled_replays() if sampled else self._replays
        depth = self.max_depth if depth is None else depth
        if self.defers and self.gap and (depth > 0 or self.gap == HISTORY):
            self.flush()  # the drafter drafts next, or the history ring is full
        for replay in replays[depth]:
            replay()
        if self.defers and depth == 0:
            self.gap += 1
        self.relay.enqueue_copy(host_step)

    def flush(self) -> None:
        """Enqueue the drafter's deferred extends (no-op if none): before a step that drafts, when the history ring
        is full, and before the prefix cache copies the drafter's rows at a request's end."""
        if not self.gap:
            return
        self.relay.catchup_count.fill_(self.gap)  # a host value into the graph's input: a launch, no sync
        self._catch_up_replay()
        self.gap = 0

    def time_depths(self, repeats: int = 5) -> dict[int, float]:
        """Milliseconds of one greedy step at each depth, measured now (between requests: it runs the bodies on
        whatever the relay and caches hold, which the next request's prefill resets). The depths take turns, round
        after round (a clock or load drift then moves them alike), the first round a warm-up; the median of the
        rest."""
        import time

        samples: dict[int, list[float]] = {d: [] for d in self.depths}
        cuda = self.device.type == "cuda"
        with torch.inference_mode():
            for rnd in range(repeats + 1):
                for d in self.depths:
                    self.relay.pos.zero_()
                    self.relay.num_drafts.fill_(self.relay.max_drafts)
                    if cuda:
                        torch.cuda.synchronize(self.device)
                    t0 = time.perf_counter()
                    for replay in self._replays[d]:
                        replay()
                    if cuda:
                        torch.cuda.synchronize(self.device)
                    if rnd:
                        samples[d].append(1000 * (time.perf_counter() - t0))
        self.relay.pos.zero_()
        return {d: sorted(t)[len(t) // 2] for d, t in samples.items()}
