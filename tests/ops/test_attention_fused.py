"""The one-kernel decode attention (RoPE of q and the new k, cache write, split attention, in-kernel merge)
against the unfused reference: ``rope_and_cache_write`` then causal ``attention`` in plain PyTorch.

Without CUDA the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is imported).
Cache rows at and past p0 start as NaN (the kernel must take the new keys from registers, never from those
rows, and must write them); split partials start as NaN (a merge of an unwritten one would show). Each case
runs twice on the same buffers: the ticket counters must have been reset by the first launch.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from baton.layers.rope import RotaryEmbedding  # noqa: E402
from baton.ops import attention as attention_ops  # noqa: E402
from baton.ops.attention import naive  # noqa: E402
from tests.ops.triton_support import load_triton_module  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}

fd = load_triton_module("baton.ops.attention.fused_decode")


def _reference(q, k, v, positions, inv_freq, k_cache, v_cache, scale):
    """The unfused semantics in plain PyTorch: RoPE + cache write, then causal attention over the cache."""
    q = attention_ops._rope_and_cache_write_torch(q, k, v, positions, inv_freq, k_cache, v_cache, False)
    end = int(positions.max()) + 1
    return naive.attention(q.to(k_cache.dtype), k_cache[:end], v_cache[:end], positions, scale).to(q.dtype)


def _case(p0: int, t: int, num_heads: int, num_kv_heads: int, head_dim: int, max_len: int, dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(t, num_kv_heads, head_dim, generator=gen)
    k_cache = torch.randn(max_len, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(max_len, num_kv_heads, head_dim, generator=gen)
    k_cache[p0:], v_cache[p0:] = float("nan"), float("nan")
    positions = torch.arange(p0, p0 + t)
    inv_freq = RotaryEmbedding(head_dim, max_len, 10000.0).inv_freq
    return [x.to(DEV, dtype) for x in (q, k, v, k_cache, v_cache)] + [positions.to(DEV), inv_freq.to(DEV)]


@pytest.fixture
def nan_partials(monkeypatch):
    real_empty = torch.empty

    def empty(*shape, **kw):  # the split workspace (fp32) starts as NaN
        x = real_empty(*shape, **kw)
        return x.fill_(float("nan")) if kw.get("dtype") == torch.float32 and x.is_floating_point() else x

    monkeypatch.setattr(fd.torch, "empty", empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("p0,t,splits", [(0, 1, 1), (5, 1, 1), (37, 1, 3), (70, 4, 4), (0, 3, 2), (130, 6, 5),
                                         (64, 16, 2)])
def test_fused_matches_unfused(nan_partials, dtype, p0, t, splits):
    q, k, v, kc, vc, pos, inv_freq = _case(p0, t, 6, 2, 32, 192, dtype, seed=p0 + t)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = _reference(q.clone(), k, v, pos, inv_freq, want_kc, want_vc, 0.3)
    q_before = q.clone()
    for _ in range(2):  # the second launch finds the counters reset
        got = fd.fused_rope_cache_attention(q, k, v, pos, inv_freq, kc, vc, 0.3, num_splits=splits, block_n=16)
        torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    torch.testing.assert_close(q, q_before, rtol=0, atol=0)  # q is not modified
    end = p0 + t
    torch.testing.assert_close(kc[:end].float(), want_kc[:end].float(), **TOL[dtype])
    torch.testing.assert_close(vc[:end].float(), want_vc[:end].float(), rtol=0, atol=0)
    assert torch.isnan(kc[end:].float()).all()  # rows past the new tokens untouched
    if splits > 1:
        assert int(fd._counters(q.device, 1 * 2).sum()) == 0


@pytest.mark.parametrize("splits", [1, 3])
def test_fused_with_several_row_tiles(nan_partials, splits):
    """Group 8 x 12 tokens = 96 rows: two row tiles per kv head (only the first writes the cache), each with its
    own ticket counter."""
    q, k, v, kc, vc, pos, inv_freq = _case(90, 12, 16, 2, 32, 160, torch.float32, seed=7)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = _reference(q.clone(), k, v, pos, inv_freq, want_kc, want_vc, 0.2)
    for _ in range(2):
        got = fd.fused_rope_cache_attention(q, k, v, pos, inv_freq, kc, vc, 0.2, num_splits=splits, block_n=16)
        torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(kc[:102], want_kc[:102], **TOL[torch.float32])
    torch.testing.assert_close(vc[:102], want_vc[:102], rtol=0, atol=0)


def test_fused_with_a_cos_sin_table_and_default_splits():
    from baton.ops.attention.rope_cache import cos_sin_cache

    q, k, v, kc, vc, pos, inv_freq = _case(50, 2, 4, 4, 16, 96, torch.float32, seed=3)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = _reference(q.clone(), k, v, pos, inv_freq, want_kc, want_vc, 0.25)
    table = cos_sin_cache(inv_freq, 96)
    got = fd.fused_rope_cache_attention(q, k, v, pos, table, kc, vc, 0.25)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    torch.testing.assert_close(kc[:52], want_kc[:52], **TOL[torch.float32])


def test_dispatcher_takes_the_fused_kernel_only_when_allowed(monkeypatch):
    """``rope_cache_attention``: on CPU tensors (no Triton dispatch) it is the unfused reference; the fused path
    is opt-in (``BATON_FUSED_ATTENTION``) and only for T <= MAX_TOKENS on CUDA."""
    q, k, v, kc, vc, pos, inv_freq = _case(9, 2, 4, 2, 16, 64, torch.float32, seed=5)
    want_kc, want_vc = kc.clone(), vc.clone()
    want = _reference(q.clone(), k, v, pos, inv_freq, want_kc, want_vc, 0.25)
    got = attention_ops.rope_cache_attention(q.clone(), k, v, pos, inv_freq, kc, vc, 0.25, kv_len=11)
    torch.testing.assert_close(got, want, **TOL[torch.float32])
    assert attention_ops.use_fused_decode(q.cpu(), inv_freq.cpu()) is False


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("t", [1, 4])
def test_fused_in_a_cuda_graph_at_new_positions_smollm2_heads(t):
    """SmolLM2's heads (H=9, Hkv=3, D=64), bf16, a 4096-row cache (several splits): one capture, replays at new
    positions (device-side p0) against the reference on fresh copies of the cache."""
    q, k, v, kc, vc, pos, inv_freq = _case(300, t, 9, 3, 64, 4096, torch.bfloat16, seed=11)
    kc[300:], vc[300:] = 0.0, 0.0  # the graph's replays write into them: start from zeros, not NaN
    fd.fused_rope_cache_attention(q, k, v, pos, inv_freq, kc, vc, 0.125)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fd.fused_rope_cache_attention(q, k, v, pos, inv_freq, kc, vc, 0.125)
    for p0 in (17, 300, 1999):
        pos.copy_(torch.arange(p0, p0 + t, device=DEV))
        want_kc, want_vc = kc.clone(), vc.clone()
        want = _reference(q.clone(), k, v, pos, inv_freq, want_kc, want_vc, 0.125)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])
        torch.testing.assert_close(kc[: p0 + t].float(), want_kc[: p0 + t].float(), **TOL[torch.bfloat16])
