"""All per-layer caches of one model for one sequence, allocated once for the longest context."""

from __future__ import annotations

import torch

from baton.cache.kv import KVCache, MLACache
from baton.cache.state import KDAState
from baton.ops.state_commit import StagedCommit


class ModelCache:
    def __init__(self, layers: dict[int, KVCache | MLACache | KDAState], max_len: int) -> None:
        self.layers = layers
        self.max_len = max_len
        # every KDA layer's (staged, persistent) pairs, committed in one launch per dtype on CUDA
        self._commit = StagedCommit([(t, p) for s in self.kda_states()
                                     for t, p in ((s.staged_recurrent, s.recurrent), (s.staged_conv, s.conv))])

    def __getitem__(self, layer_id: int) -> KVCache | MLACache | KDAState:
        return self.layers[layer_id]

    def kda_states(self) -> list[KDAState]:
        return [c for c in self.layers.values() if isinstance(c, KDAState)]

    def commit(self, index: torch.Tensor) -> None:
        """Commit the staged linear-attention state of chain position ``index`` in every KDA layer (what
        ``KDAState.commit`` does for one layer; baton.ops.state_commit)."""
        self._commit(index)

    def row_buffers(self) -> list[torch.Tensor]:
        """The position-indexed buffers (dim 0 = position) of every attention layer: GQA K and V, MLA latent."""
        out: list[torch.Tensor] = []
        for c in self.layers.values():
            if isinstance(c, KVCache):
                out += [c.k, c.v]
            elif isinstance(c, MLACache):
                out.append(c.latent)
        return out

    def state_buffers(self) -> list[torch.Tensor]:
        """The persistent recurrent state of every KDA layer (recurrent and short-conv), which a prefix cache must
        snapshot whole (the staged verify states are scratch)."""
        return [t for s in self.kda_states() for t in (s.recurrent, s.conv)]

    def reset(self) -> None:
        for c in self.layers.values():
            c.reset()

    @property
    def nbytes(self) -> int:
        return sum(c.nbytes for c in self.layers.values())
