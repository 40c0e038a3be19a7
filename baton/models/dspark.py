"""The DSpark / DFlash draft network: a few decoder layers whose keys and values take the tapped target features of
the context (KV injection) beside the block's own, a Markov head and a confidence head. The drafting around it (the
Markov chain, the confidence schedule, the prefix rule, the relay bodies) is baton.speculative.dspark; the
checkpoint format is baton.models.dspark_checkpoint.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.cache.kv import KVCache
from baton.layers.linear import Linear
from baton.layers.mlp import MLP
from baton.layers.norm import RMSNorm
from baton.layers.rope import RotaryEmbedding
from baton.models.dspark_checkpoint import DSparkDraftConfig
from baton.ops.attention import attention


class DraftAttention(nn.Module):
    """GQA over [injected context K/V ; block K/V], optional per-head q/k RMSNorm, rotate-half RoPE."""

    def __init__(self, cfg: DSparkDraftConfig, rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.scale = d**-0.5
        self.q_proj = Linear(h, self.num_heads * d, **kw)
        self.k_proj = Linear(h, self.num_kv_heads * d, **kw)
        self.v_proj = Linear(h, self.num_kv_heads * d, **kw)
        self.o_proj = Linear(self.num_heads * d, h, **kw)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, **kw) if cfg.qk_norm else None
        self.rope = rope

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> k, v [T, Hkv, D] (k normed and rotated at ``positions``)."""
        t = x.shape[0]
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        v = self.v_proj(x).view(t, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        if self.k_norm is not None:
            k = self.k_norm(k)
        return self.rope(positions, k), v

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, ctx_len: int | None) -> torch.Tensor:
        """Block x [B, H] at ``positions`` (anchor_pos .. anchor_pos+B-1); context = cache rows before anchor_pos.

        The block's own K/V are written into the cache at their positions (those rows are overwritten by the
        committed context in ``extend``, or by the next block, before anything reads them as context), so every
        block query attends to cache rows 0 .. anchor_pos+B-1: the context plus the whole block, i.e.
        bidirectional inside the block. That is causal attention with each query's visible end at the last
        block position. ``ctx_len`` (= anchor_pos) slices the cache where the host knows it (uncaptured on the
        CPU); None covers the whole cache, bounded on the device by the positions."""
        b = x.shape[0]
        q = self.q_proj(x).view(b, self.num_heads, self.head_dim)  # [B, Hq, D]
        if self.q_norm is not None:
            q = self.q_norm(q)
        q = self.rope(positions, q)
        k_blk, v_blk = self.project_kv(x, positions)
        cache.write(positions, k_blk, v_blk)
        k, v = cache.view(None if ctx_len is None else ctx_len + b)
        visible_end = positions[-1:].expand(b)  # [B]: every query sees through the last block slot
        o = attention(q, k, v, visible_end, self.scale)
        return self.o_proj(o.reshape(b, self.num_heads * self.head_dim))


class DraftLayer(nn.Module):
    """Pre-norm decoder layer: input_layernorm -> attention -> +res; post_attention_layernorm -> SwiGLU -> +res."""

    def __init__(self, cfg: DSparkDraftConfig, rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = DraftAttention(cfg, rope, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, **kw)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache, ctx_len: int | None) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), positions, cache, ctx_len)
        return h + self.mlp(self.post_attention_layernorm(h))


class MarkovHead(nn.Module):
    """The prefix-dependent bias B(prev, .) = W2(W1[prev]) (§4.2, "vanilla" Markov head)."""

    def __init__(self, vocab_size: int, rank: int, device=None, dtype=None) -> None:
        super().__init__()
        self.w1 = nn.Embedding(vocab_size, rank, device=device, dtype=dtype)
        self.w2 = Linear(rank, vocab_size, device=device, dtype=dtype)

    def bias(self, prev_emb: torch.Tensor) -> torch.Tensor:
        """W1[prev] [N, r] -> fp32 logit bias [N, V]."""
        return self.w2(prev_emb).float()


class DSparkDraftModel(nn.Module):
    """fc + hidden_norm fusion, the draft layers, the final norm; with_heads adds the Markov and confidence
    heads (the confidence head is fp32 whatever the model dtype)."""

    def __init__(self, cfg: DSparkDraftConfig, with_heads: bool, device=None, dtype=None) -> None:
        super().__init__()
        if cfg.target_layer_ids is None:
            raise ValueError("DSparkDraftModel needs cfg.target_layer_ids resolved")
        if with_heads and not cfg.has_heads:
            raise ValueError("DSparkDraftModel(with_heads=True) needs cfg.markov_rank > 0")
        kw = dict(device=device, dtype=dtype)
        h = cfg.hidden_size
        self.config = cfg
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, False, cfg.rope_scaling, device=device)
        self.fc = Linear(len(cfg.target_layer_ids) * h, h, **kw)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.layers = nn.ModuleList(DraftLayer(cfg, self.rope, **kw) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps, **kw)
        self.markov_head = self.confidence_head = None
        if with_heads:
            self.markov_head = MarkovHead(cfg.vocab_size, cfg.markov_rank, **kw)
            self.confidence_head = nn.Linear(h + cfg.markov_rank, 1, device=device, dtype=torch.float32)

    def make_caches(self, max_len: int, dtype: torch.dtype, device) -> list[KVCache]:
        cfg = self.config
        return [KVCache(max_len, cfg.num_key_value_heads, cfg.head_dim, dtype, device) for _ in self.layers]

    def write_context(self, features: torch.Tensor, positions: torch.Tensor, caches: list[KVCache]) -> None:
        """Tapped target features [T, n*H] of committed tokens -> H_ctx -> K/V at ``positions`` in every layer."""
        h_ctx = self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))  # [T, H]
        for layer, cache in zip(self.layers, caches, strict=True):
            k, v = layer.self_attn.project_kv(h_ctx, positions)
            cache.write(positions, k, v)

    def forward(self, block_embeds: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                ctx_len: int | None) -> torch.Tensor:
        """block_embeds [B, H] -> final-normed slot hidden states h [B, H]."""
        x = block_embeds.to(self.fc.weight.dtype)
        for layer, cache in zip(self.layers, caches, strict=True):
            x = layer(x, positions, cache, ctx_len)
        return self.norm(x)

    def confidence_logits(self, h: torch.Tensor, prev_emb: torch.Tensor) -> torch.Tensor:
        """Raw confidence logits w . [h_k ; W1[prev_k]] + b, fp32 [B]."""
        return self.confidence_head(torch.cat([h.float(), prev_emb.float()], dim=-1))[:, 0]
