"""What every target model provides to the engine: embeddings, a forward over a ForwardContext that
returns the final-normed hidden states, logits from the (possibly tied) lm_head, and its caches."""

from __future__ import annotations

import torch
from torch import nn

from baton.cache.model_cache import ModelCache
from baton.layers.context import ForwardContext


class CausalLM(nn.Module):
    """Subclasses set ``self.embed_tokens`` (an nn.Embedding), ``self.layers`` (decoder layers with
    ``layer_id`` and ``make_cache``), ``self.norm`` and ``self.lm_head_weight``-providing attributes."""

    lm_head_fp32: bool = True

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def decoder_layers(self) -> list[nn.Module]:
        return list(self.model.layers)

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [T] -> final-normed hidden states [T, d]. Outputs of ``ctx.capture_layer_ids`` layers
        (the residual stream after that layer) are appended to ``ctx.captured``."""
        x = self.embed(input_ids) if input_embeds is None else input_embeds
        capture = ctx.capture_layer_ids
        for layer in self.decoder_layers():
            x = layer(x, ctx)
            if layer.layer_id in capture:
                ctx.captured.append(x)
        return self.model.norm(x)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, d] -> fp32 logits [T, V]."""
        w = self.lm_head_weight
        if self.lm_head_fp32:
            return hidden.float() @ w.float().t()
        return (hidden @ w.t()).float()

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8) -> ModelCache:
        layers = {}
        for layer in self.decoder_layers():
            layers[layer.layer_id] = layer.make_cache(max_len, dtype, device, max_stage)
        return ModelCache(layers, max_len)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens
