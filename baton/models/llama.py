"""Llama (SmolLM2-135M-Instruct and friends): GQA attention with a KV cache, SwiGLU MLP, RMSNorm."""

from __future__ import annotations

import torch
from torch import nn

from baton.config import LlamaConfig
from baton.layers.attention import GQAttention
from baton.layers.context import ForwardContext
from baton.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baton.layers.mlp import MLP
from baton.layers.norm import RMSNorm
from baton.layers.rope import RotaryEmbedding
from baton.models.base import CausalLM


class LlamaDecoderLayer(nn.Module):
    def __init__(self, layer_id: int, cfg: LlamaConfig, rope: RotaryEmbedding, device=None, dtype=None) -> None:
        super().__init__()
        self.layer_id = layer_id
        kw = dict(device=device, dtype=dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = GQAttention(layer_id, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads,
                                     cfg.head_dim, rope, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, **kw)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        h = self.self_attn(x, ctx, norm=self.input_layernorm, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8):
        return self.self_attn.make_cache(max_len, dtype, device)


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, interleaved=False, rope_scaling=cfg.rope_scaling,
                                    device=device)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, **kw)
        self.layers = nn.ModuleList(LlamaDecoderLayer(i, cfg, self.rope, **kw) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: LlamaConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, device=device, dtype=dtype)
        self.tie_word_embeddings = cfg.tie_word_embeddings
        if not cfg.tie_word_embeddings:
            self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, device=device, dtype=dtype)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def make_decoder_layer(self, layer_id: int, device=None, dtype=None) -> LlamaDecoderLayer:
        """A fresh decoder layer of this architecture (a NEXTN head's body)."""
        return LlamaDecoderLayer(layer_id, self.config, self.model.rope, device=device, dtype=dtype)
