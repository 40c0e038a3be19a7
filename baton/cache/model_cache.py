"""All per-layer caches of one model for one sequence, allocated once for the longest context."""

from __future__ import annotations

import torch

from baton.cache.kv import KVCache, MLACache
from baton.cache.state import KDAState


class ModelCache:
    def __init__(self, layers: dict[int, KVCache | MLACache | KDAState], max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len

    def __getitem__(self, layer_id: int) -> KVCache | MLACache | KDAState:
        return self.layers[layer_id]

    def kda_states(self) -> list[KDAState]:
        return [c for c in self.layers.values() if isinstance(c, KDAState)]

    def commit(self, index: torch.Tensor) -> None:
        """Commit the staged linear-attention state of chain position ``index`` in every KDA layer."""
        for state in self.kda_states():
            state.commit(index)

    def reset(self) -> None:
        for c in self.layers.values():
            c.reset()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers.values())
