"""Llama (SmolLM2-135M-Instruct and friends): GQA attention with a KV cache, SwiGLU MLP, RMSNorm."""

from __future__ import annotations

import threading

import torch
from torch import nn

from baton import dist
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


# ---- the CPU step of a GGUF-quantized layer (decode / verify / drafts: a few rows) ----
#
# The unfused layer runs some twenty eager ops around its four projections (norms, RoPE, splits, cache writes,
# attention, residual adds, the SwiGLU), each a dispatch costing more than its arithmetic at one row. Here one C
# call (baton/ops/quant_cpu/kernels.c ``bq_llama_layer``, its matmuls and attention over the kernels' thread pool)
# does the whole layer on the GGUF's Q4_1 weights in fp32, and LlamaForCausalLM.forward runs the whole stack as one
# call (``_cpu_stack_forward``): the unfused layer's math, so they agree to fp32 rounding
# (tests/models/test_gguf_quant.py, tests/ops/test_quant_cpu_layer.py).

FUSED_MAX_ROWS = 48  # baton.ops.quant_cpu.cpu.GEMV_MAX_ROWS: more rows (long prefills) take the unfused layer


def _once(module: torch.nn.Module, name: str, build):
    """``build(module)``, computed on first use and kept on the module as ``name`` (False: the C path does not
    apply to it)."""
    value = module.__dict__.get(name)
    if value is None:
        value = build(module)
        setattr(module, name, value)
    return value


def _cpu_layer_args(layer: LlamaDecoderLayer):
    """The layer's C view (``_layer_args``), built once."""
    return _once(layer, "_cpu_layer_args", _layer_args)


def _fused_cpu_step(layer: LlamaDecoderLayer, x: torch.Tensor, ctx: ForwardContext) -> bool:
    if (x.device.type != "cpu" or x.dtype != torch.float32 or x.dim() != 2 or x.shape[0] > FUSED_MAX_ROWS
            or ctx.kv_len is None or torch.is_grad_enabled()):
        return False
    if _cpu_layer_args(layer) is False:
        return False
    cache = ctx.cache[layer.layer_id]
    return cache.k.dtype == torch.float32 and cache.k.is_contiguous() and cache.v.is_contiguous()


def _layer_args(layer: LlamaDecoderLayer):
    """The C kernel's view of the layer (``native.LayerArgs``, keeping the tensors it points to alive), or False
    where the fused step does not apply: no kernels here, a projection not Q4_1, a SwiGLU clamp, partial RoPE."""
    from baton.ops.quant_cpu import native

    attn, mlp = layer.self_attn, layer.mlp
    qs = [quantized(p) for p in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    rope = attn.rope
    if (native.lib() is None or any(q is None or q.fmt != "q4_1" for q in qs) or mlp.swiglu_limit != 0
            or rope.interleaved or 2 * rope.inv_freq.numel() != attn.head_dim or attn.num_heads % attn.num_kv_heads
            or qs[2].shape[0] % 8):
        return False
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if any(w.dtype != torch.float32 or not w.is_contiguous() for w in norms):
        return False
    inv_freq = rope.inv_freq.float().contiguous()
    qkv, o, gu, dn = qs
    args = native.LayerArgs(
        attn.qkv_proj.in_features, attn.num_heads, attn.num_kv_heads, attn.head_dim, dn.shape[1],
        layer.input_layernorm.eps, layer.post_attention_layernorm.eps, attn.scale,
        norms[0].data_ptr(), norms[1].data_ptr(), inv_freq.data_ptr(),
        *[q.packed.data_ptr() for q in qs])
    args.keep = (qs, norms, inv_freq)
    return args


_local = threading.local()


def _scratch(n: int) -> torch.Tensor:
    """A per-thread fp32 buffer of at least ``n`` floats (the layer kernel's intermediates)."""
    buf = getattr(_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _local.buf = torch.empty(n, dtype=torch.float32)
    return buf


def _fused_quantized_layer(layer: LlamaDecoderLayer, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
    from baton.ops.quant_cpu import native

    lib = native.lib()
    native.sync_threads(lib)
    args = layer._cpu_layer_args
    cache = ctx.cache[layer.layer_id]
    x = x.contiguous()
    positions = ctx.positions.to(torch.int64).contiguous()
    rows, kv_len = x.shape[0], ctx.kv_len
    if kv_len > cache.k.shape[0]:
        raise ValueError(f"kv_len {kv_len} exceeds the cache ({cache.k.shape[0]} rows)")
    scratch = _scratch(lib.bq_layer_scratch(args, rows, kv_len))
    out = torch.empty_like(x)
    with native.traced("quant_cpu::llama_layer"):
        err = lib.bq_llama_layer(args, x.data_ptr(), out.data_ptr(), rows, positions.data_ptr(), cache.k.data_ptr(),
                                 cache.v.data_ptr(), kv_len, scratch.data_ptr())
    if err:
        raise ValueError(f"positions {positions.tolist()} outside the cache rows read ({kv_len})")
    return out


def _stack_args(model: LlamaForCausalLM):
    """The C view of the whole decoder stack (an array of ``native.LayerArgs``), or False where the stack cannot
    run as one call (a layer the fused step does not take, a norm not in fp32)."""
    from baton.ops.quant_cpu import native

    layers = list(model.decoder_layers())
    if not layers or [layer.layer_id for layer in layers] != list(range(len(layers))):
        return False
    per_layer = []
    for layer in layers:
        args = _cpu_layer_args(layer)
        if args is False:
            return False
        per_layer.append(args)
    norm = model.model.norm
    if norm.weight.dtype != torch.float32 or not norm.weight.is_contiguous():
        return False
    array = (native.LayerArgs * len(per_layer))(*per_layer)
    big = max(per_layer, key=lambda a: a.hidden + a.heads * a.head_dim + a.inter)
    return {"array": array, "layers": layers, "big": big, "norm": norm, "hidden": per_layer[0].hidden,
            "caches": None}


def _stack_caches(stack: dict, ctx: ForwardContext, kv_len: int):
    """(k pointers, v pointers) of every layer's cache, remembered for the ModelCache they came from; None when a
    cache is not an fp32 contiguous KV cache long enough."""
    import ctypes

    held = stack["caches"]
    if held is not None and held[0] is ctx.cache:
        return held[1], held[2], held[3]
    caches = [ctx.cache[layer.layer_id] for layer in stack["layers"]]
    if not all(getattr(c, "k", None) is not None and c.k.dtype == torch.float32 and c.k.is_contiguous()
               and c.v.is_contiguous() for c in caches):
        return None
    n = len(caches)
    ks = (ctypes.c_void_p * n)(*[c.k.data_ptr() for c in caches])
    vs = (ctypes.c_void_p * n)(*[c.v.data_ptr() for c in caches])
    rows = min(c.k.shape[0] for c in caches)
    stack["caches"] = (ctx.cache, ks, vs, rows)
    return ks, vs, rows


STACK_CHUNK = 256  # rows per bq_llama_stack call of a long prompt (its scratch grows with the rows)


def _stack_rows_ok(rows: int) -> bool:
    """Which row counts take the C stack: up to FUSED_MAX_ROWS always; more (a long prefill) only with several
    threads. One thread: the eager layers' dequantise + MKL sgemm is faster (512-token prefill 1.40 s against 1.68 s);
    several: the eager path's OpenMP threads spin-wait for each other, and on cores shared with other work a 512-token
    prefill took 6.1-7.4 s there against 2.0 s on the kernels' own pool (2 threads, load 3.5, 2026-12-02)."""
    return 0 < rows and (rows <= FUSED_MAX_ROWS or torch.get_num_threads() > 1)


def _cpu_stack_forward(model: LlamaForCausalLM, input_ids: torch.Tensor, ctx: ForwardContext,
                       input_embeds: torch.Tensor | None) -> torch.Tensor | None:
    """``CausalLM.forward`` (embedding, decoder layers, captures, final norm) as C calls (kernels.c
    ``bq_llama_stack``, STACK_CHUNK rows at a time) on the CPU; None where it does not apply (the caller runs the
    layers)."""
    if (input_ids.device.type != "cpu" or ctx.kv_len is None or torch.is_grad_enabled()
            or not _stack_rows_ok(input_ids.shape[0])):
        return None
    stack = _once(model, "_cpu_stack_args", _stack_args)
    if stack is False:
        return None
    held = _stack_caches(stack, ctx, ctx.kv_len)
    if held is None or ctx.kv_len > held[2]:
        return None
    from baton.ops.quant_cpu import native

    lib = native.lib()
    native.sync_threads(lib)
    x = model.embed(input_ids) if input_embeds is None else input_embeds
    x = x.to(torch.float32).contiguous()
    rows, hidden = x.shape
    positions = ctx.positions.to(torch.int64).contiguous()
    capture = ctx.capture_layer_ids
    slots = [-1] * len(stack["layers"])
    for i, layer_id in enumerate(sorted(set(capture))):
        if 0 <= layer_id < len(slots):
            slots[layer_id] = i
    ncap = sum(s >= 0 for s in slots)
    captured = torch.empty(ncap, rows, hidden) if ncap else None
    slot_arr = torch.tensor(slots, dtype=torch.int32)
    out = torch.empty(rows, hidden)
    norm = stack["norm"]
    for c0 in range(0, rows, STACK_CHUNK):  # a chunk attends to the cache rows the chunks before it wrote
        m = min(STACK_CHUNK, rows - c0)
        kv_len = ctx.kv_len if m == rows else min(ctx.kv_len, int(positions[c0 : c0 + m].max()) + 1)
        scratch = _scratch(lib.bq_layer_scratch(stack["big"], m, kv_len) + 2 * m * hidden)
        cap = None if captured is None else captured if m == rows else torch.empty(ncap, m, hidden)
        with native.traced("quant_cpu::llama_stack"):
            err = lib.bq_llama_stack(stack["array"], len(slots), x[c0].data_ptr(), out[c0].data_ptr(), m,
                                     positions[c0].data_ptr(), held[0], held[1], kv_len, scratch.data_ptr(),
                                     slot_arr.data_ptr(), None if cap is None else cap.data_ptr(),
                                     norm.weight.data_ptr(), norm.eps)
        if err:
            raise ValueError(f"positions {positions.tolist()} outside the cache rows read ({ctx.kv_len})")
        if cap is not None and cap is not captured:
            captured[:, c0 : c0 + m] = cap
    if ncap:
        ctx.captured.extend(captured.unbind(0))
    return out


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

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext,
                input_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """``CausalLM.forward``; a few rows on the CPU over GGUF-quantized layers run as one C call
        (``_cpu_stack_forward``, the same math as the layers, tests/models/test_gguf_quant.py)."""
        out = _cpu_stack_forward(self, input_ids, ctx, input_embeds)
        return out if out is not None else super().forward(input_ids, ctx, input_embeds)

    def greedy_tokens(self, hidden: torch.Tensor, draft: bool = False) -> torch.Tensor:
        """``CausalLM.greedy_tokens``; with the GGUF-quantized lm_head on the CPU the argmax runs in C (the lowest
        id among ties, as argmax_rows)."""
        from baton.ops.quant_cpu import native

        lib = native.lib() if self.lm_head_quantized is not None and hidden.device.type == "cpu" else None
        if lib is None or dist.tp_size() > 1:
            return super().greedy_tokens(hidden, draft)
        hot = draft and self.draft_hot is not None
        logits = (self.draft_hot_logits(hidden) if hot else self.compute_logits(hidden, draft)).contiguous()
        ids = torch.empty(logits.shape[0], dtype=torch.int64)  # (compute_logits synced the kernels' threads)
        with native.traced("quant_cpu::argmax"):
            lib.bq_argmax_rows(logits.data_ptr(), logits.shape[0], logits.shape[1], ids.data_ptr())
        return self.draft_hot[0][ids] if hot else ids

    def _hot_lm_head(self, ids: torch.Tensor) -> object:
        """The map's rows of a GGUF-quantized lm_head, dequantised and quantised again as Q8_0 (exact for Q8_0 rows
        whose largest code is +-127, a second rounding otherwise: the drafts' logits only)."""
        qweight = self.lm_head_quantized
        if qweight is None:
            return super()._hot_lm_head(ids)
        from gguf import quants
        from gguf.constants import GGMLQuantizationType

        rows = qweight.rows(ids).numpy()
        raw = torch.from_numpy(quants.quantize(rows, GGMLQuantizationType.Q8_0))
        return QuantizedWeight.from_gguf("q8_0", raw)

    def draft_hot_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        w = self.draft_hot[1]
        return w.matmul(hidden) if isinstance(w, QuantizedWeight) else super().draft_hot_logits(hidden)

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
        return super().draft_lm_head_bytes() if qweight is None or self.draft_hot is not None else qweight.nbytes

