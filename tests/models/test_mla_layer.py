"""MLAttention (fp32, CPU) against a plain-PyTorch implementation of the math the layer had before kv_a_layernorm
moved into ``rope_and_cache_write``, the head-wise gate into ``mla_decode`` and the W_UK / W_UV einsums became
copy-free ``bmm``s; and a dispatch recorder showing that the absorbed forward (decode / verify / draft) issues no
copy or elementwise op of its own at Ling-3.0-flash's head shapes, and that both of its GEMMs are ones cuBLAS
takes without cloning an operand."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from baton.cache.kv import MLACache
from baton.cache.model_cache import ModelCache
from baton.config import parse_model_config
from baton.layers import mla as mla_mod
from baton.layers.context import ForwardContext
from baton.layers.mla import MLAttention
from baton.layers.norm import RMSNorm
from baton.layers.rope import RotaryEmbedding
from baton.types import ForwardMode
from tests.conftest import TINY_LING

CAPACITY = 24


def make_layer(q_lora_rank=None, dtype=torch.float32, seed=0, **over) -> tuple[MLAttention, RMSNorm]:
    """An MLA layer of the tiny Ling config with random weights (norm weights near 1, not 1) and its input norm."""
    cfg = parse_model_config({**TINY_LING, "q_lora_rank": q_lora_rank, **over})
    rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, True)
    layer = MLAttention(0, cfg, rope, dtype=dtype)
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*layer.parameters(), *norm.parameters()]:
            if p.dim() == 1:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
    return layer, norm


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def old_math(layer: MLAttention, norm: RMSNorm, x, residual, positions, latent_before, kv_len):
    """The layer as it was, op by op: c = kv_a_layernorm(c) written with RoPE(k_rope) to the latent row,
    attention over [c | k_rope] expanded through kv_b_proj, then o = o * sigmoid(gate) per head and dense."""
    t, heads, nope, rdim, vdim, r = (x.shape[0], layer.num_heads, layer.nope_dim, layer.rope_dim, layer.v_dim,
                                     layer.kv_lora_rank)
    y = rms(x, norm.weight, norm.eps) @ layer.in_proj.weight.T
    q_rows = heads * layer.qk_dim if layer.q_lora_rank is None else layer.q_lora_rank
    q, kv, g = y.split([q_rows, r + rdim, heads], dim=-1)
    if layer.q_lora_rank is not None:
        q = rms(q, layer.q_a_layernorm.weight, layer.q_a_layernorm.eps) @ layer.q_b_proj.weight.T
    q = q.reshape(t, heads, layer.qk_dim)
    c = rms(kv[:, :r], layer.kv_a_layernorm.weight, layer.kv_a_layernorm.eps)
    k_rope = layer.rope(positions, kv[:, r:])
    q_rope = layer.rope(positions, q[..., nope:])
    latent = latent_before.clone()
    latent[positions] = torch.cat([c, k_rope], dim=-1)
    seen = latent if kv_len is None else latent[:kv_len]
    s = seen.shape[0]
    kvb = (seen[:, :r] @ layer.kv_b_proj.weight.T).view(s, heads, nope + vdim)
    k = torch.cat([kvb[..., :nope], seen[:, None, r:].expand(s, heads, rdim)], dim=-1)
    qf = torch.cat([q[..., :nope], q_rope], dim=-1)
    scores = torch.einsum("thd,shd->hts", qf, k) * layer.scale
    visible = torch.arange(s)[None, :] <= positions[:, None]
    probs = torch.softmax(scores.masked_fill(~visible[None], float("-inf")), dim=-1)
    o = torch.einsum("hts,shd->thd", probs, kvb[..., nope:])
    o = (o.float() * torch.sigmoid(g.float())[:, :, None]).to(x.dtype)
    return residual + o.reshape(t, heads * vdim) @ layer.dense.weight.T, latent


CASES = {  # mode, first position, tokens, kv_len (None: the whole cache, rows past the context hold garbage)
    "prefill": (ForwardMode.PREFILL, 0, 9, 9),
    "prefill-after-prefix": (ForwardMode.PREFILL, 5, 7, 12),
    "decode": (ForwardMode.DECODE, 13, 1, 14),
    "decode-whole-cache": (ForwardMode.DECODE, 13, 1, None),
    "verify": (ForwardMode.VERIFY, 10, 6, 16),
    "verify-whole-cache": (ForwardMode.VERIFY, 10, 6, None),
    "draft": (ForwardMode.DRAFT, 17, 3, 20),
}


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("case", list(CASES))
def test_layer_matches_old_math(case, q_lora_rank):
    mode, start, t, kv_len = CASES[case]
    layer, norm = make_layer(q_lora_rank)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(t, layer.in_proj.in_features, generator=gen)
    residual = torch.randn(t, layer.dense.out_features, generator=gen)
    positions = torch.arange(start, start + t)
    cache = MLACache(CAPACITY, layer.kv_lora_rank, layer.rope_dim, torch.float32, "cpu")
    cache.latent.copy_(torch.randn(cache.latent.shape, generator=gen))  # earlier rows, and garbage past the context
    latent_before = cache.latent.clone()
    ctx = ForwardContext(mode, positions, ModelCache({0: cache}, CAPACITY), kv_len=kv_len)
    with torch.no_grad():
        got = layer(x, ctx, norm=norm, residual=residual)
        want, want_latent = old_math(layer, norm, x, residual, positions, latent_before, kv_len)
    torch.testing.assert_close(cache.latent, want_latent, rtol=1e-6, atol=1e-6)  # the rows at positions, only
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_layer_under_autograd():
    """With grad on and parameters that require it (no serving path does this) the absorbed product falls back
    to bmm without out=, and gradients flow to kv_b_proj through both W_UK and W_UV."""
    layer, norm = make_layer()
    x = torch.randn(3, layer.in_proj.in_features)
    positions = torch.arange(4, 7)
    cache = MLACache(CAPACITY, layer.kv_lora_rank, layer.rope_dim, torch.float32, "cpu")
    cache.latent.normal_()
    latent_before = cache.latent.clone()
    ctx = ForwardContext(ForwardMode.VERIFY, positions, ModelCache({0: cache}, CAPACITY), kv_len=8)
    got = layer(x, ctx, norm=norm, residual=torch.zeros(3, layer.dense.out_features))
    with torch.no_grad():
        want, _ = old_math(layer, norm, x, torch.zeros(3, layer.dense.out_features), positions, latent_before, 8)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got.square().sum().backward()
    w_grad = layer.kv_b_proj.weight.grad.view(layer.num_heads, layer.nope_dim + layer.v_dim, -1)
    assert w_grad[:, : layer.nope_dim].abs().sum() > 0 and w_grad[:, layer.nope_dim :].abs().sum() > 0


# The absorbed forward's own ops ---------------------------------------------------------------------------------

COPY_OPS = {"copy_", "clone", "_to_copy", "contiguous", "_unsafe_view", "index_copy", "index_copy_", "cat", "stack",
            "expand_copy", "permute_copy", "transpose_copy", "view_copy", "_reshape_copy"}


def cublas_clones(batch1: torch.Tensor, batch2: torch.Tensor, result: torch.Tensor) -> list[str]:
    """The operands that ``at::bmm`` on CUDA would copy before its strided-batched cuBLAS call: the stride tests
    of ``baddbmm_out_cuda_impl`` (the result) and ``prepare_batch_matrix_for_cublas`` (batch1, batch2) in
    aten/src/ATen/native/cuda/Blas.cpp, evaluated on the CPU tensors of the same shapes and strides."""
    clones = []
    rs, rz = result.stride(), result.shape
    if rs[1] == 1 and (rz[2] == 1 or rs[2] >= max(1, rz[1])):
        transpose_result = False
    elif rs[2] == 1 and (rz[1] == 1 or rs[1] >= max(1, rz[2])):
        transpose_result = True
    else:
        transpose_result = False
        clones.append("result")
    lead = 1 if transpose_result else 2
    fast = 2 if transpose_result else 1
    m, n = rz[2 if transpose_result else 1], rz[lead]
    k = (batch2 if transpose_result else batch1).shape[lead]

    def prepare(name: str, x: torch.Tensor, rows: int, cols: int) -> None:
        s = x.stride()
        if s[fast] == 1 and s[lead] >= max(1, rows):
            return
        if s[lead] == 1 and s[fast] >= max(1, cols):
            return
        if not (x.is_contiguous() and s[1] != 0 and s[2] != 0):
            clones.append(name)

    first, second = (("batch2", batch2), ("batch1", batch1)) if transpose_result else (("batch1", batch1),
                                                                                       ("batch2", batch2))
    prepare(first[0], first[1], m, k)
    prepare(second[0], second[1], k, n)
    return clones


def _storages(x) -> set[int]:
    tensors = [x] if isinstance(x, torch.Tensor) else [a for a in x if isinstance(a, torch.Tensor)] \
        if isinstance(x, (list, tuple)) else []
    return {t.untyped_storage().data_ptr() for t in tensors}


class OpRecorder(TorchDispatchMode):
    """Every aten op that reaches the dispatcher's Python key (under inference_mode, as the engine runs, composite
    ops such as reshape and to arrive whole), the ones whose output is new memory (``fresh``: a copy, an
    elementwise op, an allocation, a product; not a view) and the tensors of each bmm."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.fresh: list[str] = []
        self.bmms: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        self.ops.append(name)
        inputs = set().union(*(_storages(a) for a in [*args, *kwargs.values()]))  # out= writes no new memory
        if _storages(out) - inputs:
            self.fresh.append(name)
        if name == "bmm":
            self.bmms.append((args[0], args[1], kwargs.get("out", out)))
        return out


def record_forward(layer: MLAttention, mode: ForwardMode, t: int, monkeypatch) -> tuple[OpRecorder, list]:
    """The layer's forward at ``t`` tokens under the recorder, with what is one kernel on CUDA (the two
    projections, ``rope_and_cache_write``, ``mla_decode``) run outside it and logged as a single entry."""
    rec = OpRecorder()
    dense_inputs = []

    def opaque(name, fn, note=None):
        def run(*args, **kwargs):
            if note is not None:
                note(args, kwargs)
            with _disable_current_modes():
                out = fn(*args, **kwargs)
            rec.ops.append(f"<{name}>")
            return out
        return run

    monkeypatch.setattr(mla_mod, "rope_and_cache_write", opaque("rope_and_cache_write", mla_mod.rope_and_cache_write))
    monkeypatch.setattr(mla_mod, "mla_decode", opaque("mla_decode", mla_mod.mla_decode))
    monkeypatch.setattr(mla_mod, "attention", opaque("attention", mla_mod.attention))
    monkeypatch.setattr(layer.in_proj, "linear", opaque("in_proj", layer.in_proj.linear))
    monkeypatch.setattr(layer.dense, "project", opaque("dense", layer.dense.project,
                                                       lambda args, kwargs: dense_inputs.append(args[0])))
    cache = MLACache(64, layer.kv_lora_rank, layer.rope_dim, layer.dense.weight.dtype, "cpu")
    positions = torch.arange(40, 40 + t)
    ctx = ForwardContext(mode, positions, ModelCache({0: cache}, 64), kv_len=None)
    x = torch.randn(t, layer.in_proj.in_features, dtype=layer.dense.weight.dtype)
    with torch.inference_mode(), rec:
        layer(x, ctx, residual=x)
    return rec, dense_inputs


def flash_heads_layer() -> MLAttention:
    """Ling-3.0-flash's attention shapes (32 heads, nope 128, rope 64, v 128, latent 512) on a narrow hidden
    size, in bf16."""
    layer, _ = make_layer(dtype=torch.bfloat16, num_attention_heads=32, qk_nope_head_dim=128, qk_rope_head_dim=64,
                          v_head_dim=128, kv_lora_rank=512)
    return layer


@pytest.mark.parametrize("t", [1, 6])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.VERIFY])
def test_absorbed_forward_has_no_copies(mode, t, monkeypatch):
    """Besides the four kernels on CUDA it issues exactly two bmm and one allocation (the W_UV output), all the
    rest views: no einsum copy, no reshape copy, no gate arithmetic (the gate is in ``mla_decode``, the
    kv_a_layernorm in ``rope_and_cache_write``); cuBLAS would take both bmm as they are; ``dense`` gets a
    contiguous [T, H * v] view."""
    layer = flash_heads_layer()
    rec, dense_inputs = record_forward(layer, mode, t, monkeypatch)
    kernels = [op for op in rec.ops if op.startswith("<")]
    assert kernels == ["<in_proj>", "<rope_and_cache_write>", "<mla_decode>", "<dense>"], rec.ops
    assert rec.fresh == ["bmm", "empty"], rec.ops  # q_lat, the W_UV output buffer; the second bmm writes into it
    assert not COPY_OPS & set(rec.ops), rec.ops
    assert len(rec.bmms) == 2
    for batch1, batch2, result in rec.bmms:
        assert cublas_clones(batch1, batch2, result) == [], (batch1.stride(), batch2.stride(), result.stride())
    (dense_in,) = dense_inputs
    assert dense_in.shape == (t, 32 * 128) and dense_in.is_contiguous()
    assert dense_in.untyped_storage().data_ptr() == rec.bmms[1][2].untyped_storage().data_ptr()


def test_prefill_gate_is_torch_ops(monkeypatch):
    """The prefill keeps the gate as torch ops (``apply_head_gate``) after ``attention``: the recorder sees them,
    so the decode test above would see them too if they came back there."""
    layer = flash_heads_layer()
    rec, _ = record_forward(layer, ForwardMode.PREFILL, 6, monkeypatch)
    assert "<attention>" in rec.ops and "<mla_decode>" not in rec.ops
    assert {"sigmoid", "mul"} <= set(rec.fresh) and "bmm" not in rec.ops


def test_cublas_rule_sees_einsum_layouts():
    """The stride rule is not vacuous: a [T, H, v] einsum-layout result given to ``reshape`` is a copy, and an
    operand with no unit stride in its last two dims would be cloned by cuBLAS's preparation."""
    o_lat = torch.randn(6, 32, 512)
    w = torch.randn(32, 256, 512)
    rec = OpRecorder()
    with torch.inference_mode(), rec:
        torch.einsum("thc,hvc->thv", o_lat, w[:, 128:]).reshape(6, 32 * 128)
    assert rec.fresh == ["einsum", "reshape"], rec.ops
    bad = torch.randn(32 * 12288).as_strided((32, 6, 512), (12288, 1024, 2))
    assert cublas_clones(bad, w[:, 128:].transpose(1, 2), torch.empty(32, 6, 128)) == ["batch1"]
