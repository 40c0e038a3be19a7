"""Short prefills as CUDA graphs: a prompt (or the rest of one after a prefix-cache hit) of at most
``--cuda-graph-max-tokens-prefill`` tokens runs as the replay of a graph captured at start-up, instead of an
eager forward whose launches outnumber its GPU work.

Why: the follow-up turn of a conversation prefills only what the prefix cache does not hold, ~100-130 tokens.
Eager, that forward is host-bound: 5,242 kernels for 132 tokens of the fp8 Ling-3.0-flash shape, the GPU idle 64%
of the 181 ms (H200, benchmarks/results/h200-2026-12-02c), while its GPU work is ~96 ms.

The program is the eager prefill itself, ``model(tokens, ctx)`` in ``ForwardMode.PREFILL``, at a fixed number of
rows (a bucket: 16, 32, 64, 96, 128, 192, 256, ... up to the limit) with three device values that a replay reads:

- the tokens, the prompt's ``L`` rows first and padding after them (whatever the buffer held);
- ``start``: the first row's position (positions are ``start + arange(B)``); attention covers the whole
  preallocated cache with the causal position mask (``kv_len`` None), as the decode program's does;
- ``L`` as ``ForwardContext.active_rows``: the MoE routes the padding rows to no expert, and KDA makes them no-ops
  of its recurrence and carries the conv window of row ``L - 1`` (``KimiDeltaAttention._prefill``).

The padding rows write attention-cache rows past the prompt (positions ``start + L ..``), which the causal mask
hides and the decode steps overwrite before they become visible; every state after a replay is the state after
the ``L`` real tokens, and rows ``< L`` of the outputs are those of the unpadded forward (tested on the CPU, where
the same padded forward runs eagerly: tests/engine/test_prefill_graph.py).

Capture runs the bucket's forward twice eagerly (Triton compilation, fla-core's autotuning, cuBLAS handles) and
once under capture, all at position 0, then resets the cache: it must happen before any request (the warm-up
forwards write the live caches). The outputs (final hidden states, the drafter's tapped layers) are static
buffers, valid until the next replay; ``run`` returns copies of their first ``L`` rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from baton.engine.step import capture_graph
from baton.layers.context import ForwardContext
from baton.types import ForwardMode

if TYPE_CHECKING:
    from baton.cache.model_cache import ModelCache
    from baton.models.base import CausalLM

log = logging.getLogger(__name__)

MIN_BUCKET = 16


def prefill_buckets(max_tokens: int) -> tuple[int, ...]:
    """The captured sizes for a limit: 16, 32, 64, then 1.5x and 2x steps (96, 128, 192, 256, 384, ...) up to
    and including ``max_tokens`` (which ends the list when it is not one of them): a prefill pads by at most a
    third above 64 tokens (the fp8 dense projections read their weights once per 32 rows, so padding costs bytes).
    ``max_tokens`` <= 0: none."""
    if max_tokens <= 0:
        return ()
    sizes, p = set(), MIN_BUCKET
    while p < max_tokens:
        sizes.add(p)
        if p >= 64 and 3 * p // 2 < max_tokens:
            sizes.add(3 * p // 2)
        p *= 2
    return (*sorted(sizes), max_tokens)


class PrefillGraphs:
    """Padded prefill forwards of ``model`` over ``cache`` at each of ``buckets`` rows. ``capture`` (CUDA only):
    as CUDA graphs captured here; False runs the same padded forward eagerly (the CPU, the tests)."""

    def __init__(self, model: CausalLM, cache: ModelCache, device: torch.device, buckets: Sequence[int],
                 capture_layer_ids: tuple[int, ...] = (), capture: bool = True) -> None:
        if not buckets:
            raise ValueError("PrefillGraphs needs at least one bucket")
        self.model, self.cache, self.device = model, cache, device
        self.buckets = tuple(sorted(set(buckets)))
        self.capture_layer_ids = tuple(capture_layer_ids)
        self.capture = capture
        top = self.buckets[-1]
        if top > cache.max_len:
            raise ValueError(f"prefill bucket {top} exceeds the cache ({cache.max_len} rows)")
        self.tokens = torch.zeros(top, dtype=torch.long, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.num_valid = torch.ones(1, dtype=torch.long, device=device)
        self.arange = torch.arange(top, device=device)
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor, list[torch.Tensor]]] = {}
        if capture:
            with torch.inference_mode():
                for b in self.buckets:
                    self._graphs[b] = self._capture(b)
            cache.reset()
            torch.cuda.synchronize(device)

    def bucket(self, start: int, num_tokens: int) -> int | None:
        """The bucket a prefill of ``num_tokens`` rows at position ``start`` replays, or None: too long, or its
        padding would run past the cache (then the eager forward runs)."""
        for b in self.buckets:
            if b >= num_tokens:
                return b if start + b <= self.cache.max_len else None
        return None

    def _forward(self, b: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        ctx = ForwardContext(ForwardMode.PREFILL, self.start + self.arange[:b], self.cache, kv_len=None,
                             capture_layer_ids=self.capture_layer_ids, active_rows=self.num_valid)
        hidden = self.model(self.tokens[:b], ctx)
        return hidden, ctx.captured

    def _capture(self, b: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, list[torch.Tensor]]:
        self.start.zero_()
        self.num_valid.fill_(b)
        graph, (hidden, captured) = capture_graph(lambda: self._forward(b), self.pool)
        return graph, hidden, captured

    def run(self, tokens: torch.Tensor, start: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The prefill of ``tokens`` [L] (on the device) at positions ``start ..``: (final hidden [L, d], the tapped
        layers' outputs [L, d] each), as the eager forward returns them; the caches and states written as it
        writes them. Needs ``bucket(start, L)``."""
        n = tokens.shape[0]
        b = self.bucket(start, n)
        if b is None:
            raise ValueError(f"no prefill bucket for {n} tokens at position {start} (buckets {self.buckets})")
        self.tokens[:n].copy_(tokens)
        self.start.fill_(start)
        self.num_valid.fill_(n)
        if not self.capture:
            hidden, captured = self._forward(b)
            return hidden[:n], [c[:n] for c in captured]
        graph, hidden, captured = self._graphs[b]
        graph.replay()
        return hidden[:n].clone(), [c[:n].clone() for c in captured]
