"""Forward passes of one model over its own cache at host-known positions (the prefill, training, tests).

The runner owns that ForwardContext construction: positions are ``start_pos .. start_pos + T - 1`` on the
model's device. Decode steps run in the step program (engine/step.py), whose positions come from the relay.
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
