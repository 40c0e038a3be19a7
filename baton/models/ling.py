"""Ling-3.0 (BailingMoeV3, ``bailing_hybrid``): KDA and MLA layers interleaved by layer_group_size over an
MoE with a shared expert (dense MLP for the first layers), plus the MTP / NEXTN layer at index
num_hidden_layers. ling3-architecture.md in the shared docs is the spec.

``--quantization fp8`` (``LingConfig.fp8_dense``): the routed experts and every dense projection (KDA, MLA but its
kv_b_proj, shared expert, dense MLP, the MTP layer's eh_proj and body) in fp8 e4m3 with 128 x 128 block scales; the
embeddings, router, norms and lm_head stay in the model dtype. ``fp8-experts``: the routed experts only."""

from __future__ import annotations

import torch
from torch import nn

from baton.config import LingConfig
from baton.layers.context import ForwardContext
from baton.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baton.layers.kda import KimiDeltaAttention
from baton.layers.mla import MLAttention
from baton.layers.mlp import MLP
from baton.layers.moe import SparseMoE
from baton.layers.norm import RMSNorm
from baton.layers.rope import RotaryEmbedding
from baton.models.base import CausalLM
from baton.models.nextn import NextNLayer


class LingDecoderLayer(nn.Module):
    def __init__(self, layer_id: int, cfg: LingConfig, rope: RotaryEmbedding, force_mla: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        kw = dict(device=device, dtype=dtype)
        self.is_mla = force_mla or cfg.is_mla_layer(layer_id)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if self.is_mla:
            self.attention = MLAttention(layer_id, cfg, rope, **kw)
        else:
            self.attention = KimiDeltaAttention(layer_id, cfg, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        if cfg.is_moe_layer(layer_id):
            self.mlp = SparseMoE(layer_id, cfg, **kw)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.shared_swiglu_limit(layer_id), **kw,
                           fp8=cfg.fp8_dense)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.attention(x, ctx, norm=self.input_layernorm, residual=x)
        if ctx.active_rows is not None and isinstance(self.mlp, SparseMoE):
            return self.mlp(h, norm=self.post_attention_layernorm, residual=h, active_rows=ctx.active_rows)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8):
        if self.is_mla:
            return self.attention.make_cache(max_len, dtype, device)
        return self.attention.make_cache(max_len, dtype, device, max_stage)


class LingModel(nn.Module):
    def __init__(self, cfg: LingConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, interleaved=cfg.rope_interleave,
                                    rope_scaling=cfg.rope_scaling, device=device)
        self.word_embeddings = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(LingDecoderLayer(i, cfg, self.rope, **kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


class LingForCausalLM(CausalLM):
    def __init__(self, cfg: LingConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LingModel(cfg, device=device, dtype=dtype)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, device=device, dtype=dtype)
        self.mtp = None
        if cfg.num_nextn_predict_layers > 0:
            n = cfg.num_hidden_layers
            body = LingDecoderLayer(n, cfg, self.model.rope, force_mla=True, device=device, dtype=dtype)
            self.mtp = NextNLayer(cfg.hidden_size, cfg.rms_norm_eps, body, device=device, dtype=dtype,
                                  fp8=cfg.fp8_dense)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.word_embeddings

    def checkpoint_prefix_map(self) -> list[tuple[str, str]]:
        n = self.config.num_hidden_layers
        return [("mtp.body.", f"model.layers.{n}."), ("mtp.", f"model.layers.{n}.")]

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.word_embeddings.weight if self.tie_word_embeddings else self.lm_head.weight
