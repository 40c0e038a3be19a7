"""Grouped-query attention (Llama) over a preallocated KV cache, rotate-half RoPE."""

from __future__ import annotations

import torch
from torch import nn

from baton.cache.kv import KVCache
from baton.layers.context import ForwardContext
from baton.layers.linear import Linear
from baton.layers.rope import RotaryEmbedding
from baton.ops.attention import attention


class GQAttention(nn.Module):
    def __init__(self, layer_id: int, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = head_dim**-0.5
        self.q_proj = Linear(hidden_size, num_heads * head_dim, device=device, dtype=dtype)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, device=device, dtype=dtype)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, device=device, dtype=dtype)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, device=device, dtype=dtype)
        self.rope = rope

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)
        q, k = self.rope(ctx.positions, q), self.rope(ctx.positions, k)
        cache: KVCache = ctx.cache[self.layer_id]
        cache.write(ctx.positions, k, v)
        k_all, v_all = cache.view(ctx.kv_len)
        o = attention(q, k_all, v_all, ctx.positions, self.scale)
        return self.o_proj(o.reshape(t, self.num_heads * self.head_dim))

    def make_cache(self, max_len: int, dtype: torch.dtype, device) -> KVCache:
        return KVCache(max_len, self.num_kv_heads, self.head_dim, dtype, device)
