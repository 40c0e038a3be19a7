"""Forward passes of one model over its own cache, in the five modes (eager path).

The runner owns the ForwardContext construction: positions are ``start_pos .. start_pos + T - 1`` on the
model's device. The CUDA-graph runner (engine/graphs.py) replays the same forwards over static buffers.
"""

from __future__ import annotations

import torch

from baton.cache.model_cache import ModelCache
from baton.layers.context import ForwardContext
from baton.types import ForwardMode


class ModelRunner:
    def __init__(self, cache: ModelCache, device: torch.device) -> None:
        self.cache = cache
        self.device = device

    def context(self, mode: ForwardMode, start_pos: int, num_tokens: int,
                capture: tuple[int, ...] = ()) -> ForwardContext:
        if start_pos + num_tokens > self.cache.max_len:
            raise ValueError(f"sequence of {start_pos + num_tokens} tokens exceeds the cache ({self.cache.max_len})")
        positions = torch.arange(start_pos, start_pos + num_tokens, device=self.device)
        return ForwardContext(mode, positions, self.cache, kv_len=start_pos + num_tokens, capture_layer_ids=capture)
