"""What every target model provides to the engine: embeddings, a forward over a ForwardContext that
returns the final-normed hidden states, logits from the (possibly tied) lm_head, and its caches.

Under tensor parallelism the lm_head is vocab-parallel: ``compute_local_logits`` is this rank's block of the
vocabulary, ``greedy_tokens`` takes the argmax across ranks from each rank's (max, argmax) pair without
gathering the logits, and ``compute_logits`` gathers the full row (what sampling, rejection verification and
the drafters' distributions need; every rank then holds the same logits and makes the same choices)."""

from __future__ import annotations

import torch
from torch import nn

from baton import dist
from baton.cache.model_cache import ModelCache
from baton.layers.context import ForwardContext
from baton.ops.argmax import argmax_rows


class CausalLM(nn.Module):
    """Subclasses set ``self.embed_tokens`` (an nn.Embedding), ``self.layers`` (decoder layers with
    ``layer_id`` and ``make_cache``), ``self.norm`` and ``self.lm_head_weight``-providing attributes."""

    lm_head_fp32_weight: torch.Tensor | None = None  # set by use_fp32_lm_head()
    draft_lm_head_fp8: tuple[torch.Tensor, torch.Tensor] | None = None  # set by use_fp8_draft_lm_head()
    draft_hot: tuple[torch.Tensor, object] | None = None  # (hot ids, their lm_head rows): use_draft_token_map()

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

    def compute_local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, d] -> fp32 logits [T, V_rank] of this rank's vocabulary block (padding rows included).
        The GEMV runs in the weight's dtype (bf16 on GPU, as the seed's final configuration) unless an fp32
        copy was made once by ``use_fp32_lm_head``; never a per-call conversion of the weight."""
        return _dense_logits(hidden, self.lm_head_weight if self.lm_head_fp32_weight is None
                             else self.lm_head_fp32_weight)

    def use_fp32_lm_head(self) -> None:
        """Keep an fp32 copy of the lm_head for the logits (``--enable-fp32-lm-head``)."""
        w = self.lm_head_weight
        self.lm_head_fp32_weight = None if w.dtype == torch.float32 else w.detach().float()

    def use_fp8_draft_lm_head(self) -> None:
        """``--enable-fp8-draft-lm-head``: the drafts' logits come from an fp8 copy of this rank's lm_head (e4m3,
        128 x 128 block scales; ``baton.ops.fp8_linear``), half the bytes of a bf16 pass, the largest read of a
        NEXTN draft step. The target's own logits (verify, sampling) keep the lm_head's dtype, so the output is
        unchanged: only which drafts are proposed can differ."""
        from baton.ops.quant import quantize_fp8_block

        w = self.lm_head_weight.detach()
        rows = 16384  # a multiple of the 128-row blocks: the fp32 transient of quantising stays small
        parts = [quantize_fp8_block(w[i : i + rows]) for i in range(0, w.shape[0], rows)]
        self.draft_lm_head_fp8 = (torch.cat([q for q, _ in parts]), torch.cat([sc for _, sc in parts]))

    def use_draft_token_map(self, ids: torch.Tensor) -> None:
        """``--speculative-token-map``: the drafts' argmax (``greedy_tokens(draft=True)``) runs over the lm_head rows
        of these token ids only (sorted, so the lowest id still wins a tie), a copy made once here (in fp8 after
        ``use_fp8_draft_lm_head``). The verify, sampling and ``compute_logits`` keep the whole vocabulary, so the
        output is unchanged: only which drafts are proposed can differ."""
        from baton.config import ConfigError

        if dist.tp_size() > 1:
            raise ConfigError("--speculative-token-map is not supported under tensor parallelism yet")
        vocab = self.embed_tokens.vocab.valid
        ids = torch.unique(torch.as_tensor(ids, dtype=torch.int64).reshape(-1))  # sorted
        if ids.numel() == 0 or int(ids[0]) < 0 or int(ids[-1]) >= vocab:
            raise ConfigError(f"--speculative-token-map: {ids.numel()} ids, range "
                              f"{int(ids.min()) if ids.numel() else '-'}..{int(ids.max()) if ids.numel() else '-'}; "
                              f"they must be token ids below the vocabulary size {vocab}")
        self.draft_hot = (ids.to(self.model.norm.weight.device), self._hot_lm_head(ids))

    def _hot_lm_head(self, ids: torch.Tensor) -> object:
        w = self.lm_head_weight.detach()[ids.to(self.lm_head_weight.device)].contiguous()
        if self.draft_lm_head_fp8 is None:
            return w
        from baton.ops.quant import quantize_fp8_block

        return quantize_fp8_block(w)

    def draft_hot_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, d] -> fp32 logits [T, len(hot ids)] over the token map's rows (``compute_local_logits``'s
        arithmetic)."""
        w = self.draft_hot[1]
        if isinstance(w, tuple):  # fp8 (use_fp8_draft_lm_head)
            from baton.ops.fp8_linear import fp8_linear

            return fp8_linear(hidden, *w)
        return _dense_logits(hidden, w)

    def draft_lm_head_bytes(self) -> int:
        """Bytes one drafts' lm_head pass reads (this rank's block)."""
        if self.draft_hot is not None:
            w = self.draft_hot[1]
            return sum(t.nbytes for t in w) if isinstance(w, tuple) else w.nbytes
        if self.draft_lm_head_fp8 is not None:
            return sum(t.nbytes for t in self.draft_lm_head_fp8)
        return self.lm_head_weight.nbytes

    def _local_logits(self, hidden: torch.Tensor, draft: bool) -> torch.Tensor:
        """``compute_local_logits``; for the drafters (``draft``) through the fp8 copy when
        ``use_fp8_draft_lm_head`` made one."""
        if not draft or self.draft_lm_head_fp8 is None:
            return self.compute_local_logits(hidden)
        from baton.ops.fp8_linear import fp8_linear

        return fp8_linear(hidden, *self.draft_lm_head_fp8)

    def compute_logits(self, hidden: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """hidden [T, d] -> fp32 logits [T, V] (gathered from every rank under tensor parallelism); ``draft``:
        the drafters' lm_head (``use_fp8_draft_lm_head``)."""
        logits = self._local_logits(hidden, draft)
        if dist.tp_size() == 1:
            return logits
        return dist.all_gather(logits, dim=-1)[:, : self.embed_tokens.vocab.vocab_size]

    def greedy_tokens(self, hidden: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """hidden [T, d] -> argmax token ids [T] (int64), the lowest id among ties, the same on every rank;
        ``draft``: over the drafters' logits (``use_fp8_draft_lm_head``; with ``use_draft_token_map`` the argmax
        over the map's ids)."""
        if draft and self.draft_hot is not None:
            return self.draft_hot[0][argmax_rows(self.draft_hot_logits(hidden))]
        if dist.tp_size() == 1:
            return argmax_rows(self.compute_logits(hidden, draft))
        logits = self._local_logits(hidden, draft)
        vocab = self.embed_tokens.vocab
        if vocab.valid < logits.shape[-1]:
            logits[:, vocab.valid :] = float("-inf")
        idx = argmax_rows(logits)
        best = logits.gather(1, idx[:, None])[:, 0]
        # fp64 holds both the fp32 maximum and the token id exactly: one gather of [tp, 2, T]
        pairs = dist.all_gather(torch.stack([best.double(), (idx + vocab.start).double()])[None], dim=0)
        rank = pairs[:, 0].argmax(0)  # first rank with the maximum = the lowest token id
        return pairs[:, 1].gather(0, rank[None])[0].long()

    def reset_padding(self) -> None:
        """Zero the vocabulary padding rows of the last rank's embedding / lm_head (after materialising)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_padding"):
                m.reset_padding()

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8) -> ModelCache:
        layers = {}
        for layer in self.decoder_layers():
            layers[layer.layer_id] = layer.make_cache(max_len, dtype, device, max_stage)
        return ModelCache(layers, max_len)

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.model.embed_tokens


def _dense_logits(hidden: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """hidden @ w.T as fp32 logits, the GEMV in the weight's dtype (fp32 weights take fp32 rows)."""
    if w.dtype == torch.float32:
        return hidden.float() @ w.t()
    return (hidden @ w.t()).float()

