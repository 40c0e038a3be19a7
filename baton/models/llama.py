"""Llama (SmolLM2-135M-Instruct and friends): GQA attention with a KV cache, SwiGLU MLP, RMSNorm."""

from __future__ import annotations

import functools

import torch
from torch import nn

from baton.config import ConfigError, LlamaConfig
from baton.layers.attention import GQAttention
from baton.layers.context import ForwardContext
from baton.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from baton.layers.linear import QuantizedWeight, quantized
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
        if _fused_cpu_step(self, x, ctx):
            return _fused_quantized_layer(self, x, ctx)
        h = self.self_attn(x, ctx, norm=self.input_layernorm, residual=x)
        return self.mlp(h, norm=self.post_attention_layernorm, residual=h)

    def make_cache(self, max_len: int, dtype: torch.dtype, device, max_stage: int = 8):
        return self.self_attn.make_cache(max_len, dtype, device)


# ---- the CPU step of a GGUF-quantized layer (decode / verify: a few rows) ----
#
# The unfused layer runs some twenty eager ops around its four projections (norms, RoPE, splits, residual adds, the
# SwiGLU), each a dispatch costing more than its arithmetic at one row. Here two Inductor graphs do everything
# except the cache write and the attention: (1) RMSNorm + q/k/v GEMV + RoPE; (2) o_proj GEMV + residual +
# RMSNorm + gate/up GEMV + SwiGLU + down GEMV + residual. The math is the unfused layer's (the same reference
# functions, traced), so the two agree to fp32 rounding (tests/models/test_gguf_quant.py).

FUSED_MAX_ROWS = 16  # baton.ops.quant_cpu.cpu.GEMV_MAX_ROWS: more rows (prefill) take the unfused layer


def _fused_cpu_step(layer: LlamaDecoderLayer, x: torch.Tensor, ctx: ForwardContext) -> bool:
    attn, mlp = layer.self_attn, layer.mlp
    if x.device.type != "cpu" or x.shape[0] > FUSED_MAX_ROWS or ctx.kv_len is None or torch.is_grad_enabled():
        return False
    from baton.ops import quant_cpu

    projections = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    return quant_cpu.fast_path_ok() and all(
        (q := quantized(p)) is not None and q.fmt == "q4_1" for p in projections) and mlp.swiglu_limit == 0


def _qkv_rope(x, norm_w, eps: float, packed, d, m, positions, inv_freq, heads: int, kv_heads: int, head_dim: int):
    from baton.ops.quant_cpu.cpu import q4_1_gemv
    from baton.ops.rmsnorm.naive import rms_norm
    from baton.ops.rope import apply_rope, rope_cos_sin

    t = x.shape[0]
    qkv = q4_1_gemv(rms_norm(x, norm_w, eps), packed, d, m)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    cos, sin = rope_cos_sin(positions, inv_freq)
    q = apply_rope(q.reshape(t, heads, head_dim), cos, sin, False)
    k = apply_rope(k.reshape(t, kv_heads, head_dim), cos, sin, False)
    return q, k, v.reshape(t, kv_heads, head_dim)


def _out_mlp(x, o, o_packed, o_d, o_m, norm_w, eps: float, gu_packed, gu_d, gu_m, dn_packed, dn_d, dn_m):
    from baton.ops.linear.naive import swiglu
    from baton.ops.quant_cpu.cpu import q4_1_gemv
    from baton.ops.rmsnorm.naive import rms_norm

    h = x + q4_1_gemv(o.reshape(x.shape[0], -1), o_packed, o_d, o_m)
    act = swiglu(q4_1_gemv(rms_norm(h, norm_w, eps), gu_packed, gu_d, gu_m))
    return h + q4_1_gemv(act, dn_packed, dn_d, dn_m)


@functools.cache
def _compiled(name: str):
    from baton.ops.quant_cpu.cpu import compile_fn

    return compile_fn({"qkv_rope": _qkv_rope, "out_mlp": _out_mlp}[name])


def _gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """``baton.ops.attention.naive.attention`` for a few queries, without repeating the KV heads: the query heads
    of one KV head form one [rep * T, D] matrix (two bmm per step instead of expanded einsums). q [T, H, D],
    k / v [S, Hkv, D] -> [T, H, D]."""
    from baton.ops.attention.naive import causal_mask

    t, heads, dim = q.shape
    kv_heads = k.shape[1]
    rep = heads // kv_heads
    qg = q.reshape(t, kv_heads, rep, dim).permute(1, 2, 0, 3).reshape(kv_heads, rep * t, dim)  # rows (r, t)
    scores = torch.bmm(qg, k.permute(1, 2, 0)) * scale  # [Hkv, rep * T, S]
    if t > 1:
        mask = causal_mask(positions, k.shape[0]).repeat(rep, 1)  # [rep * T, S], rows (r, t)
        scores = scores.masked_fill(~mask[None], float("-inf"))
    o = torch.bmm(torch.softmax(scores, dim=-1), v.transpose(0, 1))  # [Hkv, rep * T, D]
    return o.reshape(kv_heads, rep, t, dim).permute(2, 0, 1, 3).reshape(t, heads, dim)


def _fused_quantized_layer(layer: LlamaDecoderLayer, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    attn, mlp = layer.self_attn, layer.mlp
    qkv, o_w = quantized(attn.qkv_proj), quantized(attn.o_proj)
    gu, dn = quantized(mlp.gate_up_proj), quantized(mlp.down_proj)
    q, k, v = _compiled("qkv_rope")(x, layer.input_layernorm.weight, layer.input_layernorm.eps, qkv.codes, qkv.d,
                                    qkv.m, ctx.positions, attn.rope.inv_freq, attn.num_heads, attn.num_kv_heads,
                                    attn.head_dim)
    cache = ctx.cache[layer.layer_id]
    cache.k.index_copy_(0, ctx.positions, k)
    cache.v.index_copy_(0, ctx.positions, v)
    o = _gqa_attention(q, cache.k[: ctx.kv_len], cache.v[: ctx.kv_len], ctx.positions, attn.scale)
    post = layer.post_attention_layernorm
    return _compiled("out_mlp")(x, o, o_w.codes, o_w.d, o_w.m, post.weight, post.eps, gu.codes,
                                gu.d, gu.m, dn.codes, dn.d, dn.m)


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
    def lm_head_weight(self) -> torch.Tensor | None:
        """None when the lm_head is GGUF-quantized (``lm_head_quantized``)."""
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    @property
    def lm_head_quantized(self) -> QuantizedWeight | None:
        """The lm_head's GGUF-quantized weight (the embedded model on the CPU: Q8_0, tied to the embedding)."""
        return quantized(self.model.embed_tokens if self.tie_word_embeddings else self.lm_head)

    def compute_local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        qweight = self.lm_head_quantized
        if qweight is None:
            return super().compute_local_logits(hidden)
        return qweight.matmul(hidden)  # fp32 from the exact block values: already what --enable-fp32-lm-head asks

    def use_fp32_lm_head(self) -> None:
        if self.lm_head_quantized is None:
            super().use_fp32_lm_head()

    def use_fp8_draft_lm_head(self) -> None:
        if self.lm_head_quantized is not None:
            raise ConfigError("--enable-fp8-draft-lm-head needs a float lm_head; this one is GGUF-quantized "
                              "(the drafts already read its int8 blocks; --dtype float32 loads it dequantised)")
        super().use_fp8_draft_lm_head()

    def draft_lm_head_bytes(self) -> int:
        qweight = self.lm_head_quantized
        return super().draft_lm_head_bytes() if qweight is None else qweight.nbytes

