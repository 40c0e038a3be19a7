"""Ling's gated multi-head latent attention (MLA) over a 576-value latent cache.

Prefill expands the latent cache with ``kv_b_proj`` and runs ordinary multi-head attention; decode, verify
and draft forwards use the weight-absorbed form (``q_nope`` folded through W_UK, the output through W_UV),
which is MQA with one 576-wide key. Both write the same latent cache.

Under tensor parallelism heads are split: q (or q_b), the head-wise gate and kv_b_proj hold this rank's heads'
rows, ``dense`` is row-parallel, and the latent path (kv_a_proj_with_mqa, kv_a_layernorm, q_a_proj) is
replicated, so every rank keeps the same full latent cache.

Under ``--quantization fp8`` in_proj, q_b_proj and ``dense`` are fp8 with 128 x 128 block scales; kv_b_proj stays
in the model dtype: the absorbed decode reads it per head as W_UK and W_UV (two batched matmuls the fp8 GEMV does not
cover; 8.4 MB a layer at Ling-3.0-flash's shape, 1% of the dense bytes).
"""

from __future__ import annotations

import torch
from torch import nn

from baton.cache.kv import MLACache
from baton.config import LingConfig
from baton.layers.context import ForwardContext
from baton.layers.linear import ColumnParallelLinear, FusedLinear, RowParallelLinear, shard_count
from baton.layers.norm import RMSNorm
from baton.layers.rope import RotaryEmbedding
from baton.ops.attention import attention, rope_and_cache_write
from baton.ops.mla_decode import mla_decode
from baton.types import ForwardMode


class MLAttention(nn.Module):
    def __init__(self, layer_id: int, cfg: LingConfig, rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        self.num_heads = shard_count(heads, "num_attention_heads")  # this rank's heads
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.kv_lora_rank = cfg.kv_lora_rank
        self.qk_dim = self.nope_dim + self.rope_dim
        self.scale = self.qk_dim**-0.5
        self.q_lora_rank = cfg.q_lora_rank
        kw = dict(device=device, dtype=dtype)
        fp8 = cfg.fp8_dense
        q_part = ("q_proj", heads * self.qk_dim) if cfg.q_lora_rank is None else ("q_a_proj", cfg.q_lora_rank)
        # Everything that reads the normed input, in one projection: q (or q_a), kv_a, the head-wise gate.
        self.in_proj = FusedLinear(d, [q_part, ("kv_a_proj_with_mqa", self.kv_lora_rank + self.rope_dim),
                                       ("g_proj", heads)], replicated=("q_a_proj", "kv_a_proj_with_mqa"), fp8=fp8,
                                   **kw)
        if cfg.q_lora_rank is not None:
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, **kw)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * self.qk_dim, fp8=fp8, **kw)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, cfg.rms_norm_eps, **kw)
        self.kv_b_proj = ColumnParallelLinear(self.kv_lora_rank, heads * (self.nope_dim + self.v_dim), **kw)
        self.dense = RowParallelLinear(heads * self.v_dim, d, fp8=fp8, **kw)
        self.rope = rope

    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]  # [H, nope, C], [H, v, C]

    def forward(self, x: torch.Tensor, ctx: ForwardContext, norm: RMSNorm | None = None,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] dense(gate * attention(norm(x)))``."""
        t = x.shape[0]
        y = self.in_proj.linear(x, None if norm is None else norm.weight, 1e-6 if norm is None else norm.eps)
        q, kv, gate_logits = self.in_proj.split(y)
        if self.q_lora_rank is not None:
            q = self.q_b_proj.linear(q, self.q_a_layernorm.weight, self.q_a_layernorm.eps)
        q = q.reshape(t, self.num_heads, self.qk_dim)
        c = self.kv_a_layernorm(kv[:, : self.kv_lora_rank])
        cache: MLACache = ctx.cache[self.layer_id]
        latent_all, r = cache.latent, self.kv_lora_rank
        # RoPE on q_rope (in place) and k_rope; the cache row becomes [RMSNorm(c) | RoPE(k_rope)].
        q_rope = rope_and_cache_write(q[..., self.nope_dim :], kv[:, r:], c, ctx.positions, self.rope.inv_freq,
                                      latent_all[:, r:], latent_all[:, :r], interleaved=self.rope.interleaved)
        q_nope = q[..., : self.nope_dim]
        latent = cache.view(ctx.kv_len)
        if ctx.mode is ForwardMode.PREFILL:
            o = self._attend_expanded(q_nope, q_rope, latent, ctx.positions)
        else:
            o = self._attend_absorbed(q_nope, q_rope, latent, ctx.positions)
        gate = torch.sigmoid(gate_logits.float())[:, :, None]  # [T, H, 1]
        o = (o.float() * gate).to(x.dtype)
        return self.dense.project(o.reshape(t, self.num_heads * self.v_dim), residual)

    def _attend_expanded(self, q_nope, q_rope, latent, positions) -> torch.Tensor:
        s = latent.shape[0]
        kv = self.kv_b_proj(latent[:, : self.kv_lora_rank]).view(s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        k_rope = latent[:, None, self.kv_lora_rank :].expand(s, self.num_heads, self.rope_dim)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.to(k_nope.dtype)], dim=-1)
        return attention(q, k, v, positions, self.scale)

    def _attend_absorbed(self, q_nope, q_rope, latent, positions) -> torch.Tensor:
        w_uk, w_uv = self._w_uk_uv()
        q_lat = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, C]
        o_lat = mla_decode(q_lat, q_rope, latent, positions, self.kv_lora_rank, self.scale)  # [T, H, C]
        return torch.einsum("thc,hvc->thv", o_lat, w_uv)  # [T, H, v]

    def make_cache(self, max_len: int, dtype: torch.dtype, device) -> MLACache:
        return MLACache(max_len, self.kv_lora_rank, self.rope_dim, dtype, device)
