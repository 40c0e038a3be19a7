"""Triton GQA flash-decoding attention and the fused RoPE + cache write against the references.

Without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is imported)
on small odd shapes; with CUDA the same tests run compiled on the GPU, and the ``gpu`` tests add SmolLM2's
shapes (H=9, Hkv=3, D=64) and a CUDA-graph replay at new positions. Cache rows past the last query position
hold NaN, so any read of them shows in the output; outputs and split workspaces start as NaN, so any element
left unwritten (or any unwritten partial that is read) shows too.
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
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}




ta = load_triton_module("baton.ops.attention.triton")
tr = load_triton_module("baton.ops.attention.rope_cache")


@pytest.fixture
def nan_workspace(monkeypatch):
    """Split partials start as NaN: a merge that read an unwritten one would poison the output."""
    def workspace(num_splits, num_rows, head_dim_v, device):
        return (torch.full((num_splits, num_rows, head_dim_v), float("nan"), device=device),
                torch.full((num_splits, num_rows), float("nan"), device=device))

    monkeypatch.setattr(ta, "_workspace", workspace)


def make_inputs(positions: list[int], num_heads: int, num_kv_heads: int, head_dim: int, max_len: int,
                dtype: torch.dtype, head_dim_v: int | None = None, seed: int = 0):
    """q [T, H, D], caches [S, Hkv, D|Dv] random up to max(positions) and NaN past it, positions [T]."""
    gen = torch.Generator().manual_seed(seed)
    head_dim_v = head_dim_v or head_dim
    t = len(positions)
    q = torch.randn(t, num_heads, head_dim, generator=gen)
    k = torch.randn(max_len, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(max_len, num_kv_heads, head_dim_v, generator=gen)
    end = max(positions) + 1
    k[end:], v[end:] = float("nan"), float("nan")
    pos = torch.tensor(positions, dtype=torch.int64)
    return [x.to(DEV, dtype) for x in (q, k, v)] + [pos.to(DEV)]


def check_attention(positions, num_heads, num_kv_heads, head_dim, max_len, dtype, head_dim_v=None, **kw):
    q, k, v, pos = make_inputs(positions, num_heads, num_kv_heads, head_dim, max_len, dtype, head_dim_v)
    end = max(positions) + 1
    scale = head_dim**-0.5
    out = torch.full((len(positions), num_heads, v.shape[-1]), float("nan"), device=DEV, dtype=dtype)
    got = ta.attention(q, k, v, pos, scale, out=out, **kw)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    want = naive.attention(q, k[:end], v[:end], pos, scale)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 7])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_gqa_matches_naive(t, dtype, num_splits, nan_workspace):
    """Verify-style positions p0..p0+T-1 (p0 > 0), S = 83 (no multiple of the block), GQA group 3."""
    positions = list(range(37, 37 + t))
    check_attention(positions, 6, 2, 64, 83, dtype, num_splits=num_splits, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unordered_positions_and_idle_splits(dtype, nan_workspace):
    """Positions in any order (the context is their max); 8 splits over 4 key blocks leave 4 splits idle,
    whose partials are never written and must never be read."""
    check_attention([50, 12, 31], 4, 2, 32, 71, dtype, num_splits=8, block_n=16)


def test_default_policy_and_heads(nan_workspace):
    """Default blocks and split count; no GQA (H = Hkv) and D = 128."""
    check_attention([5, 6, 7, 8, 9], 4, 4, 128, 300, torch.float32)
    check_attention([280, 281], 6, 3, 64, 300, torch.float32)


def test_prefill_tiles_and_wide_heads(nan_workspace):
    """T = 40 x group 2 = 80 rows: two row tiles, each stopping at its own last position; D = 48 and Dv = 32
    (MLA's expanded prefill has D != Dv, neither a power of two)."""
    check_attention(list(range(40)), 4, 2, 48, 45, torch.float32, head_dim_v=32, num_splits=2, block_n=16)


def test_num_kv_splits_policy():
    assert ta.num_kv_splits(83, 2) == 1
    assert ta.num_kv_splits(512, 3) == 2
    assert ta.num_kv_splits(32768, 3) == 88  # SmolLM2: 3 kv heads x 88 splits fill the GPU
    assert ta.num_kv_splits(32768, 1) == ta.MAX_SPLITS
    assert ta.num_kv_splits(32768, 1000) == 1


# RoPE + cache write ----------------------------------------------------------------------------------------------


def rope_inputs(t: int, dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, 5, 16, generator=gen).to(DEV, dtype)  # [T, H, D]
    k = torch.randn(t, 3, 16, generator=gen).to(DEV, dtype)  # [T, Hkv, D]
    v = torch.randn(t, 3, 16, generator=gen).to(DEV, dtype)
    return q, k, v


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("use_table", [False, True])
def test_rope_and_cache_write_gqa(dtype, interleaved, use_table):
    """Llama layout against RotaryEmbedding + KVCache.write; the caches start as NaN and only the rows at the
    positions may change."""
    t, max_len = 3, 29
    rope = RotaryEmbedding(16, 10000.0, interleaved, device=DEV)
    q, k, v = rope_inputs(t, dtype)
    pos = torch.tensor([11, 12, 13], device=DEV)
    k_cache = torch.full((max_len, 3, 16), float("nan"), device=DEV, dtype=dtype)
    v_cache = k_cache.clone()
    want_q, want_k = rope(pos, q), rope(pos, k)
    table = tr.cos_sin_cache(rope.inv_freq, max_len) if use_table else rope.inv_freq
    got_q = tr.rope_and_cache_write(q, k, v, pos, table, k_cache, v_cache, interleaved)
    assert got_q is q
    torch.testing.assert_close(q.float(), want_q.float(), **TOL[dtype])
    torch.testing.assert_close(k_cache[pos].float(), want_k.float(), **TOL[dtype])
    assert torch.equal(v_cache[pos], v)
    others = torch.ones(max_len, dtype=torch.bool, device=DEV)
    others[pos] = False
    assert k_cache[others].isnan().all() and v_cache[others].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_write_mla_latent(dtype):
    """Ling layout: interleaved RoPE on q's rope slice (in place inside q [T, H, nope + rope]) and on k_rope,
    the latent row written as [c | RoPE(k_rope)] through two column views of the cache."""
    t, heads, nope, rdim, rank, max_len = 3, 4, 16, 8, 32, 23
    rope = RotaryEmbedding(rdim, 10000.0, True, device=DEV)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(t, heads, nope + rdim, generator=gen).to(DEV, dtype)
    kv = torch.randn(t, rank + rdim, generator=gen).to(DEV, dtype)
    latent = torch.full((max_len, rank + rdim), float("nan"), device=DEV, dtype=dtype)
    pos = torch.tensor([4, 9, 5], device=DEV)
    q_before = q.clone()
    want_q, want_k = rope(pos, q[..., nope:]), rope(pos, kv[:, rank:])
    tr.rope_and_cache_write(q[..., nope:], kv[:, rank:], kv[:, :rank], pos, rope.inv_freq, latent[:, rank:],
                            latent[:, :rank], True)
    torch.testing.assert_close(q[..., nope:].float(), want_q.float(), **TOL[dtype])
    assert torch.equal(q[..., :nope], q_before[..., :nope])
    torch.testing.assert_close(latent[pos, rank:].float(), want_k.float(), **TOL[dtype])
    assert torch.equal(latent[pos, :rank], kv[:, :rank])
    assert latent[[0, 1, 2, 3, 6, 7, 8, 10]].isnan().all()


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|a - b| in units of b's last place (bf16: 8 significant bits)."""
    a, b = a.float(), b.float()
    ulp = torch.ldexp(torch.ones_like(b), torch.frexp(b)[1] - 8)
    return ((a - b).abs() / ulp).nan_to_num(0.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 6])
@pytest.mark.parametrize("weight_fp32", [False, True])
def test_rope_and_cache_write_mla_norm(t, dtype, weight_fp32):
    """kv_a_layernorm inside the launch at Ling's MLA widths (q [T, 4, 128 + 64] rotated in place, latent
    512 + 64, interleaved RoPE, every operand a column view of one in_proj-like output): the latent row is
    [rms_norm(c) | RoPE(k_rope)], against (a) what MLAttention did before, ``baton.ops.rmsnorm.rms_norm`` then
    the write (fp32: the sum order only; bf16: equal but for a rare last-place flip from the sum of squares), and
    (b) the dispatcher's PyTorch path with the same norm arguments. A weight in fp32 over bf16 values takes the
    promoted (fp32) product, rounded once by the cache write. Other rows stay NaN; c and k are not modified."""
    from baton.ops.rmsnorm import rms_norm

    heads, nope, rdim, rank, max_len = 4, 128, 64, 512, 40
    rope = RotaryEmbedding(rdim, 6e6, True, device=DEV)
    gen = torch.Generator().manual_seed(7)
    q_cols, kv_cols = heads * (nope + rdim), rank + rdim
    y = (3 * torch.randn(t, q_cols + kv_cols + heads, generator=gen)).to(DEV, dtype)
    q = y[:, :q_cols].view(t, heads, nope + rdim)
    kv = y[:, q_cols : q_cols + kv_cols]
    weight = (1 + 0.3 * torch.randn(rank, generator=gen)).to(DEV, torch.float32 if weight_fp32 else dtype)
    eps = 1e-6
    pos = torch.randperm(max_len, generator=gen)[:t].to(DEV)
    latent = torch.full((max_len, rank + rdim), float("nan"), device=DEV, dtype=dtype)
    latent_ref = latent.clone()
    y_before, q_ref = y.clone(), q.clone()
    tr.rope_and_cache_write(q[..., nope:], kv[:, rank:], kv[:, :rank], pos, rope.inv_freq, latent[:, rank:],
                            latent[:, :rank], True, weight, eps)
    want_q = attention_ops._rope_and_cache_write_torch(q_ref[..., nope:], kv[:, rank:], kv[:, :rank], pos,
                                                       rope.inv_freq, latent_ref[:, rank:], latent_ref[:, :rank],
                                                       True, weight, eps)
    assert torch.equal(y[:, q_cols:], y_before[:, q_cols:]) and torch.equal(q[..., :nope], q_ref[..., :nope])
    torch.testing.assert_close(q[..., nope:].float(), want_q.float(), **TOL[dtype])
    old_c = rms_norm(kv[:, :rank], weight, eps).to(dtype)  # MLAttention before: kv_a_layernorm, then the write
    got_c = latent[pos, :rank]
    if dtype == torch.float32:
        torch.testing.assert_close(got_c, old_c, rtol=1e-6, atol=1e-6)
    else:
        ulps = bf16_ulps(got_c, old_c)
        assert ulps.max() <= 1 and (ulps > 0).float().mean() < 0.01, (ulps.max(), (ulps > 0).sum())
    torch.testing.assert_close(latent_ref[pos, :rank].float(), old_c.float(), rtol=0, atol=0)
    torch.testing.assert_close(latent[pos, rank:].float(), latent_ref[pos, rank:].float(), **TOL[dtype])
    others = torch.ones(max_len, dtype=torch.bool, device=DEV)
    others[pos] = False
    assert latent[others].isnan().all()
    assert not torch.equal(got_c, kv[:, :rank].to(dtype))  # the norm did something


def test_rope_partial_rotary_and_no_q_no_v():
    """A rotary width below the head dim: the dims past it go to the cache unchanged; q and v are optional."""
    rope = RotaryEmbedding(8, 10000.0, False, device=DEV)
    gen = torch.Generator().manual_seed(2)
    k = torch.randn(2, 3, 12, generator=gen).to(DEV)
    k_cache = torch.full((9, 3, 12), float("nan"), device=DEV)
    pos = torch.tensor([3, 7], device=DEV)
    tr.rope_and_cache_write(None, k, None, pos, rope.inv_freq, k_cache, None, False)
    torch.testing.assert_close(k_cache[pos, :, :8], rope(pos, k[..., :8]), **TOL[torch.float32])
    assert torch.equal(k_cache[pos, :, 8:], k[..., 8:])


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_torch_fallback(interleaved):
    """The PyTorch path that CPU tensors take through ``baton.ops.attention.rope_and_cache_write``."""
    rope = RotaryEmbedding(16, 10000.0, interleaved)
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, h, 16, generator=gen) for h in (5, 3, 3))
    pos = torch.tensor([6, 2])
    k_cache, v_cache = torch.zeros(8, 3, 16), torch.zeros(8, 3, 16)
    want_q, want_k = rope(pos, q), rope(pos, k)
    for table in (rope.inv_freq, tr.cos_sin_cache(rope.inv_freq, 8)):
        q_in = q.clone()
        q_run = attention_ops._rope_and_cache_write_torch(q_in, k, v, pos, table, k_cache, v_cache, interleaved)
        torch.testing.assert_close(q_run, want_q)
        assert torch.equal(q_in, q)  # out of place: autograd can run through it
        torch.testing.assert_close(k_cache[pos], want_k)
        assert torch.equal(v_cache[pos], v)


def test_cpu_dispatch_is_naive():
    q, k, v, pos = (x.cpu() for x in make_inputs([3, 4], 4, 2, 16, 10, torch.float32))
    got = attention_ops.attention(q, k[:5], v[:5], pos, 0.25)
    torch.testing.assert_close(got, naive.attention(q, k[:5], v[:5], pos, 0.25))


# CUDA: real shapes, graphs -----------------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 6, 16])
def test_gqa_smollm2_shapes(t, nan_workspace):
    """SmolLM2-135M: H=9, Hkv=3, D=64, bf16, a 4099-row cache (17 splits by default)."""
    positions = list(range(3001, 3001 + t))
    check_attention(positions, 9, 3, 64, 4099, torch.bfloat16)
    check_attention(positions, 9, 3, 64, 4099, torch.float32)


@pytest.mark.gpu
def test_gqa_graph_replay_new_positions():
    """One capture, replayed at other contexts by rewriting the position tensor in place."""
    t, max_len = 6, 4099
    q, k, v, pos = make_inputs(list(range(4000, 4000 + t)), 9, 3, 64, max_len, torch.bfloat16)
    k, v = torch.randn_like(k), torch.randn_like(v)
    out = torch.empty_like(q)
    ta.attention(q, k, v, pos, 0.125, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ta.attention(q, k, v, pos, 0.125, out=out)
    for start in (0, 17, 700, 4000):
        pos.copy_(torch.arange(start, start + t, device=DEV))
        graph.replay()
        want = naive.attention(q, k[: start + t], v[: start + t], pos, 0.125)
        torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


@pytest.mark.gpu
def test_cuda_dispatch(monkeypatch):
    q, k, v, pos = make_inputs(list(range(100, 106)), 9, 3, 64, 333, torch.bfloat16)
    k, v = torch.randn_like(k), torch.randn_like(v)
    got = attention_ops.attention(q, k, v, pos, 0.125)
    torch.testing.assert_close(got.float(), ta.attention(q, k, v, pos, 0.125).float(), rtol=0, atol=0)
    monkeypatch.setenv("BATON_TRITON", "0")
    torch.testing.assert_close(attention_ops.attention(q, k, v, pos, 0.125).float(),
                               naive.attention(q, k, v, pos, 0.125).float(), **TOL[torch.bfloat16])


@pytest.mark.gpu
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_real_shapes(interleaved):
    """SmolLM2 (rotate-half, D=64) and Ling (interleaved, rope 64) angles at long positions, fp32: the table
    form has RotaryEmbedding's angles bit for bit, the inv_freq form within fp32 cos/sin rounding."""
    rope = RotaryEmbedding(64, 6e6 if interleaved else 1e5, interleaved, device=DEV)
    pos = torch.arange(30000, 30016, device=DEV)
    q, k, v = torch.randn(16, 9, 64, device=DEV), torch.randn(16, 3, 64, device=DEV), torch.randn(16, 3, 64, device=DEV)
    want_q, want_k = rope(pos, q), rope(pos, k)
    for table, tol in ((tr.cos_sin_cache(rope.inv_freq, 32768), 1e-6), (rope.inv_freq, 1e-5)):
        k_cache, v_cache = torch.zeros(32768, 3, 64, device=DEV), torch.zeros(32768, 3, 64, device=DEV)
        q_run = q.clone()
        tr.rope_and_cache_write(q_run, k, v, pos, table, k_cache, v_cache, interleaved)
        torch.testing.assert_close(q_run, want_q, rtol=tol, atol=tol)
        torch.testing.assert_close(k_cache[pos], want_k, rtol=tol, atol=tol)
        assert torch.equal(v_cache[pos], v)
