"""What one forward pass needs to know besides its input tokens: the mode, the positions, the caches.

Positions live in a device tensor so that a captured CUDA graph can replay with new positions. ``kv_len``
is a host integer where the host knows it (the prefill; decode steps uncaptured on the CPU): attention slices
the cache; None (inside a graph, or on CUDA) covers the whole preallocated cache with a position mask instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from baton.types import ForwardMode

if TYPE_CHECKING:
    from baton.cache.model_cache import ModelCache


@dataclass
class ForwardContext:
    mode: ForwardMode
    positions: torch.Tensor  # [T] int64, absolute position of each input token
    cache: ModelCache
    kv_len: int | None = None  # host-known bound on the cache rows this forward reads (None: the whole cache)
    capture_layer_ids: tuple[int, ...] = ()  # decoder layers whose outputs to keep (DSpark features)
    captured: list[torch.Tensor] = field(default_factory=list)  # filled in layer-id order
    # A verify whose drafter shortened the prefix on the device: rows >= active_rows ([1] int64) are computed but
    # never committed, so the MoE routes them to no expert (reads no weights for them). In a PREFILL, the rows
    # past it are a captured short prefill's padding (engine/prefill_graph.py): KDA passes its states through them
    # unchanged too. None: every row counts.
    active_rows: torch.Tensor | None = None

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]

    @property
    def stages_state(self) -> bool:
        """Verify runs the linear-attention recurrence without touching the persistent state."""
        return self.mode is ForwardMode.VERIFY


class ModelRunner:
    """One model's cache and the ForwardContext of a forward at host-known positions ``start_pos ..
    start_pos + T - 1`` (the prefill, a drafter's begin, training, tests). Decode steps run in the step program
    (engine/step.py), whose positions come from the relay."""

    def __init__(self, cache: ModelCache, device: torch.device) -> None:
        self.cache = cache
        self.device = device

    def context(self, mode: ForwardMode, start_pos: int, num_tokens: int,
                capture: tuple[int, ...] = ()) -> ForwardContext:
        if start_pos + num_tokens > self.cache.max_len:
            raise ValueError(f"sequence of {start_pos + num_tokens} tokens exceeds the cache ({self.cache.max_len})")
        positions = torch.arange(start_pos, start_pos + num_tokens, device=self.device)
        return ForwardContext(mode, positions, self.cache, kv_len=start_pos + num_tokens, capture_layer_ids=capture)
