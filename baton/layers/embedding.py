"""Vocab-parallel token embedding and lm_head: each rank holds a contiguous block of vocabulary rows.

The block size is ``ceil(V / tp)``; the last rank's block may run past the vocabulary, and those padding rows
are zero and never looked up (their logits are dropped or set to -inf by the model). The embedding looks up
the ids in its block, zeroes the others and sums over ranks. At one rank both are the plain layers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from baton import dist
from baton.config import ConfigError
from baton.layers.linear import Linear, Shard, quantized


class VocabShard:
    """Which vocabulary rows this rank holds: ``[start, start + valid)`` in a block of ``rows`` (padded)."""

    def __init__(self, vocab_size: int) -> None:
        rank, size = dist.tp_rank(), dist.tp_size()
        self.vocab_size, self.tp_rank, self.tp_size = vocab_size, rank, size
        self.rows = -(-vocab_size // size)
        self.start = rank * self.rows
        self.valid = min(self.rows, vocab_size - self.start)
        if self.valid <= 0:
            raise ConfigError(f"vocab_size {vocab_size} is too small for --tp-size {size}")

    def tp_shards(self) -> dict[str, Shard]:
        return {"weight": Shard(0, self.tp_rank, self.tp_size, self.valid, self.vocab_size)} if self.tp_size > 1 else {}

    def zero_padding(self, weight: torch.Tensor | None) -> None:
        if weight is not None and self.valid < self.rows and weight.device.type != "meta":
            with torch.no_grad():
                weight[self.valid :].zero_()


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, num_embeddings: int, embedding_dim: int, device=None, dtype=None) -> None:
        shard = VocabShard(num_embeddings)
        super().__init__(shard.rows, embedding_dim, device=device, dtype=dtype)
        self.vocab = shard
        self.tp_shards = shard.tp_shards()

    def reset_padding(self) -> None:
        self.vocab.zero_padding(self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        v = self.vocab
        qweight = quantized(self)  # a GGUF-quantized table (baton.layers.linear.quantize_weight_): fp32 rows
        if qweight is not None:
            return qweight.rows(input_ids)
        if v.tp_size == 1:
            return super().forward(input_ids)
        local = input_ids - v.start
        inside = (local >= 0) & (local < v.valid)
        e = F.embedding(local.clamp(0, v.valid - 1), self.weight)
        return dist.all_reduce(torch.where(inside[..., None], e, torch.zeros((), dtype=e.dtype, device=e.device)))


class ParallelLMHead(Linear):
    """The lm_head's rows (one per token) split like the embedding; logits are computed per block."""

    def __init__(self, hidden_size: int, vocab_size: int, device=None, dtype=None) -> None:
        shard = VocabShard(vocab_size)
        super().__init__(hidden_size, shard.rows, device=device, dtype=dtype)
        self.vocab = shard
        self.tp_shards = shard.tp_shards()

    def reset_padding(self) -> None:
        self.vocab.zero_padding(self.weight)
