"""The MTP / NEXTN layer: ``final_norm(layer(eh_proj([enorm(embed(token)); hnorm(hidden)])))``.

Ling checkpoints carry one at ``model.layers.{num_hidden_layers}`` (an MLA + MoE layer); for targets without
one (SmolLM2) a separately trained head of the same structure wraps a decoder layer of the target's kind.
The target's embedding and lm_head are shared, never copied.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.layers.context import ForwardContext
from baton.layers.linear import Linear
from baton.layers.norm import RMSNorm


class NextNLayer(nn.Module):
    def __init__(self, hidden_size: int, eps: float, body: nn.Module, device=None, dtype=None,
                 fp8: bool = False) -> None:
        """``fp8``: eh_proj in fp8 with 128 x 128 block scales (Ling under ``--quantization fp8``; the body is built
        by the caller)."""
        super().__init__()
        kw = dict(device=device, dtype=dtype)
        self.enorm = RMSNorm(hidden_size, eps, **kw)
        self.hnorm = RMSNorm(hidden_size, eps, **kw)
        self.eh_proj = Linear(2 * hidden_size, hidden_size, fp8=fp8, **kw)
        self.body = body
        self.final_layernorm = RMSNorm(hidden_size, eps, **kw)

    @property
    def layer_id(self) -> int:
        return self.body.layer_id

    def forward(self, input_embeds: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_embeds [T, d] (embedding of the next token), hidden [T, d] (final-normed hidden of the
        current position) -> final-normed draft hidden [T, d]."""
        x = self.eh_proj(torch.cat([self.enorm(input_embeds), self.hnorm(hidden.to(input_embeds.dtype))], dim=-1))
        return self.final_layernorm(self.body(x, ctx))

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8):
        from baton.cache.model_cache import ModelCache

        return ModelCache({self.layer_id: self.body.make_cache(max_len, dtype, device, max_stage)}, max_len)
