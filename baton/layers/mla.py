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

Launches of a decode / verify / draft forward on CUDA (bf16, one rank; read off the code path), in order:
in_proj (1 GEMM, the input norm in its prologue), ``rope_and_cache_write`` (1: RoPE of q_rope in place and of
k_rope, kv_a_layernorm of c, the latent row write), the W_UK bmm (1 cuBLAS), ``mla_decode`` (1, or 2 with split-KV:
the reduction; the head-wise gate is applied in whichever stores o_lat), the W_UV bmm (1 cuBLAS, writing the
[T, H * v] input of dense) and dense (1 GEMM, the residual in its epilogue): 6, or 7 with split-KV (the usual
decode at long contexts), at any T. Before: the same plus a standalone kv_a_layernorm ``_rms_norm_kernel``, five
torch kernels for the gate (gate_logits.float(), sigmoid, o.float(), the fp32 multiply, the cast back to bf16)
and, at T > 1, the direct_copy of ``o.reshape`` (the W_UV einsum's output was a head-major view): 12 / 13 at T = 1,
13 / 14 at T > 1. The prefill runs the same first two kernels, then kv_b_proj, two torch.cat, ``attention`` and
the gate as torch ops (``apply_head_gate``).

W_UK / W_UV stay cuBLAS products of their own; folding them into ``mla_decode`` (q_nope @ W_UK in its prologue,
o_lat @ W_UV^T in its epilogue) would save two more launches but is not done here.
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
from baton.ops.mla_decode import apply_head_gate, mla_decode
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
        """``[residual +] dense(gate * attention(norm(x)))``, gate = sigmoid(g_proj(norm(x))) per (token, head)."""
        t = x.shape[0]
        y = self.in_proj.linear(x, None if norm is None else norm.weight, 1e-6 if norm is None else norm.eps)
        q, kv, gate_logits = self.in_proj.split(y)  # strided column views of y
        if self.q_lora_rank is not None:
            q = self.q_b_proj.linear(q, self.q_a_layernorm.weight, self.q_a_layernorm.eps)
        q = q.reshape(t, self.num_heads, self.qk_dim)  # a view
        cache: MLACache = ctx.cache[self.layer_id]
        latent_all, r = cache.latent, self.kv_lora_rank
        # One launch: RoPE on q_rope (in place) and k_rope, and the cache row [kv_a_layernorm(c) | RoPE(k_rope)].
        q_rope = rope_and_cache_write(q[..., self.nope_dim :], kv[:, r:], kv[:, :r], ctx.positions,
                                      self.rope.inv_freq, latent_all[:, r:], latent_all[:, :r],
                                      interleaved=self.rope.interleaved, v_norm_weight=self.kv_a_layernorm.weight,
                                      v_norm_eps=self.kv_a_layernorm.eps)
        q_nope = q[..., : self.nope_dim]
        latent = cache.view(ctx.kv_len)
        if ctx.mode is ForwardMode.PREFILL:
            o = apply_head_gate(self._attend_expanded(q_nope, q_rope, latent, ctx.positions), gate_logits)
        else:
            o = self._attend_absorbed(q_nope, q_rope, latent, ctx.positions, gate_logits)
        return self.dense.project(o.reshape(t, self.num_heads * self.v_dim), residual)  # [T, H, v]: a view

    def _attend_expanded(self, q_nope, q_rope, latent, positions) -> torch.Tensor:
        """Prefill: the latent cache expanded through kv_b_proj, then ordinary causal MHA (ungated, [T, H, v])."""
        s = latent.shape[0]
        kv = self.kv_b_proj(latent[:, : self.kv_lora_rank]).view(s, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv[..., : self.nope_dim], kv[..., self.nope_dim :]
        k_rope = latent[:, None, self.kv_lora_rank :].expand(s, self.num_heads, self.rope_dim)
        q = torch.cat([q_nope, q_rope], dim=-1)
        k = torch.cat([k_nope, k_rope.to(k_nope.dtype)], dim=-1)
        return attention(q, k, v, positions, self.scale)

    def _attend_absorbed(self, q_nope, q_rope, latent, positions, gate_logits) -> torch.Tensor:
        """Decode / verify / draft: three launches on CUDA (four with split-KV), none of them a copy.

        1. q_lat = q_nope @ W_UK per head: one strided-batched cuBLAS GEMM over heads, [H, T, nope] x [H, nope, C]
           (q_nope a strided view of the projection output, W_UK a row slice of kv_b_proj.weight: both taken by
           cuBLAS as they are); q_lat is its [H, T, C] output viewed as [T, H, C].
        2. o_lat = mla_decode(q_lat, q_rope, latent, gate_logits): flash-decoding over the latent cache with the
           head-wise gate applied to the fp32 o_lat before its store (split-KV: a second launch, the reduction,
           gates instead).
        3. o = o_lat @ W_UV^T per head: one strided-batched GEMM, [H, T, C] x [H, C, v] (both views), written
           through a [H, T, v] view of a [T, H, v] buffer, so [T, H * v] for ``dense`` is a view.

        Before: the same two GEMMs as ``torch.einsum``s (no copy inside them, but the second returned a head-major
        [T, H, v] view whose reshape for dense was a copy at T > 1) and the gate as five torch kernels after them
        (module docstring). The stride rules by which cuBLAS takes these operands without a clone are checked
        in tests/models/test_mla_layer.py. Under autograd (no serving path: the engine runs in inference mode)
        the out= product, which autograd does not support, is a plain bmm and dense's reshape copies."""
        w_uk, w_uv = self._w_uk_uv()  # [H, nope, C], [H, v, C] views of kv_b_proj.weight
        t = q_nope.shape[0]
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, H, C], strides (C, T * C, 1)
        o_lat = mla_decode(q_lat, q_rope, latent, positions, self.kv_lora_rank, self.scale, gate_logits)  # [T, H, C]
        w_uv_t = w_uv.transpose(1, 2)  # [H, C, v]
        if torch.is_grad_enabled() and (o_lat.requires_grad or w_uv_t.requires_grad):
            return torch.bmm(o_lat.transpose(0, 1), w_uv_t).transpose(0, 1)  # out= has no autograd
        o = torch.empty(t, self.num_heads, self.v_dim, dtype=o_lat.dtype, device=o_lat.device)  # [T, H, v]
        torch.bmm(o_lat.transpose(0, 1), w_uv_t, out=o.transpose(0, 1))
        return o

    def make_cache(self, max_len: int, dtype: torch.dtype, device) -> MLACache:
        return MLACache(max_len, self.kv_lora_rank, self.rope_dim, dtype, device)
