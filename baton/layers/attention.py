"""Grouped-query attention (Llama) over a preallocated KV cache, rotate-half RoPE, fused q/k/v projection.

Under tensor parallelism each rank holds ``num_heads / tp`` query heads and ``num_kv_heads / tp`` KV heads (both
must divide), their q/k/v rows and KV cache, and the matching columns of o_proj (row-parallel)."""

from __future__ import annotations

import torch
from torch import nn

from baton.cache.kv import KVCache
from baton.layers.context import ForwardContext
from baton.layers.linear import FusedLinear, RowParallelLinear, shard_count
from baton.layers.norm import RMSNorm
from baton.layers.rope import RotaryEmbedding
from baton.ops.attention import rope_cache_attention


class GQAttention(nn.Module):
    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = shard_count(num_heads, "num_attention_heads")  # this rank's heads
        self.num_kv_heads = shard_count(num_kv_heads, "num_key_value_heads")
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        q_rows, kv_rows = num_heads * head_dim, num_kv_heads * head_dim
        self.qkv_proj = FusedLinear(hidden_size, [("q_proj", q_rows), ("k_proj", kv_rows), ("v_proj", kv_rows)],
                                    device=device, dtype=dtype)
        self.o_proj = RowParallelLinear(q_rows, hidden_size, device=device, dtype=dtype)
        self.rope = rope

    def forward(self, x: torch.Tensor, ctx: ForwardContext, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] o_proj(attention(norm(x)))``."""
        t = x.shape[0]
        qkv = self.qkv_proj.linear(x, None if norm is None else norm.weight, 1e-6 if norm is None else norm.eps)
        q, k, v = self.qkv_proj.split(qkv)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        cache: KVCache = ctx.cache[self.layer_id]
        o = rope_cache_attention(q, k, v, ctx.positions, self.rope.inv_freq, cache.k, cache.v, self.scale,
                                 ctx.kv_len)
        return self.o_proj.project(o.reshape(t, self.num_heads * self.head_dim), residual)

    def make_cache(self, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(max_len, self.num_kv_heads, self.head_dim, dtype, device)
