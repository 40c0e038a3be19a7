"""Triton weight-absorbed MLA flash-decoding against ``baton.ops.mla_decode.naive``.

Without CUDA the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is imported)
on small odd shapes; with CUDA the same tests run compiled on the GPU, and the ``gpu`` tests add Ling-3.0-flash's
shapes (H=32, latent 512 + 64) and a CUDA-graph replay at new positions. Latent rows past the last query
position hold NaN; outputs and split workspaces start as NaN.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from baton.ops import mla_decode as mla_ops  # noqa: E402
from baton.ops.mla_decode import naive  # noqa: E402
from tests.ops.triton_support import load_triton_module  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}




load_triton_module("baton.ops.attention.triton")
tm = load_triton_module("baton.ops.mla_decode.triton")


@pytest.fixture
def nan_workspace(monkeypatch):
    """Split partials start as NaN: a merge that read an unwritten one would poison the output."""
    def workspace(num_splits, num_rows, head_dim_v, device):
        return (torch.full((num_splits, num_rows, head_dim_v), float("nan"), device=device),
                torch.full((num_splits, num_rows), float("nan"), device=device))

    monkeypatch.setattr(tm, "_workspace", workspace)


def make_inputs(positions: list[int], num_heads: int, rank: int, rope_dim: int, max_len: int, dtype: torch.dtype,
                seed: int = 0):
    """q_lat [T, H, C], q_rope [T, H, R], latent [S, C + R] random up to max(positions) and NaN past it."""
    gen = torch.Generator().manual_seed(seed)
    t = len(positions)
    q_lat = torch.randn(t, num_heads, rank, generator=gen)
    q_rope = torch.randn(t, num_heads, rope_dim, generator=gen)
    latent = torch.randn(max_len, rank + rope_dim, generator=gen)
    latent[max(positions) + 1 :] = float("nan")
    pos = torch.tensor(positions, dtype=torch.int64)
    return [x.to(DEV, dtype) for x in (q_lat, q_rope, latent)] + [pos.to(DEV)]


def gate_logits_for(t: int, num_heads: int, dtype: torch.dtype, seed: int = 5) -> torch.Tensor:
    """[T, H] logits spread over sigmoid's range, as a column view of a wider tensor (as g_proj's slice of the
    in_proj output is)."""
    gen = torch.Generator().manual_seed(seed)
    wide = 2.5 * torch.randn(t, num_heads + 3, generator=gen)
    return wide.to(DEV, dtype)[:, 1 : 1 + num_heads]


def head_major(x: torch.Tensor) -> torch.Tensor:
    """[T, H, C] with the strides of the W_UK bmm's output viewed back: (C, T * C, 1)."""
    return x.transpose(0, 1).contiguous().transpose(0, 1)


def check_mla(positions, num_heads, rank, rope_dim, max_len, dtype, gated=False, **kw):
    q_lat, q_rope, latent, pos = make_inputs(positions, num_heads, rank, rope_dim, max_len, dtype)
    gate = gate_logits_for(len(positions), num_heads, dtype) if gated else None
    if gated:
        q_lat = head_major(q_lat)
    end = max(positions) + 1
    scale = (rank // 4 + rope_dim) ** -0.5
    out = torch.full_like(q_lat, float("nan"))
    got = tm.mla_decode(q_lat, q_rope, latent, pos, rank, scale, gate, out=out, **kw)
    assert got.data_ptr() == out.data_ptr() and got.dtype == dtype
    want = naive.mla_decode(q_lat, q_rope, latent[:end], pos, rank, scale, gate)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), **TOL[dtype])
    return got


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 3, 7])
@pytest.mark.parametrize("num_splits", [None, 1, 3])
def test_mla_matches_naive(t, dtype, num_splits, nan_workspace):
    """Positions p0..p0+T-1 (p0 > 0), S = 77 (no multiple of the block), 5 heads: T = 7 is 35 rows, three row
    tiles of 16."""
    check_mla(list(range(40, 40 + t)), 5, 32, 8, 77, dtype, num_splits=num_splits, block_n=16, block_m=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_unordered_positions_and_idle_splits(dtype, nan_workspace):
    """Positions in any order; 8 splits over 4 key blocks leave 4 idle splits whose partials are never read."""
    check_mla([50, 12, 31], 4, 64, 16, 71, dtype, num_splits=8, block_n=16)


def test_default_config(nan_workspace):
    """Default tiles and split count (one split at this S), rope width 16 and a wider latent."""
    check_mla([20, 21, 22], 4, 64, 16, 45, torch.float32)
    check_mla([300], 8, 32, 8, 301, torch.float32)


def test_ling_head_width(nan_workspace):
    """C = 512, R = 64 at a few heads: the real row width in the interpreter."""
    check_mla([30, 31], 4, 512, 64, 70, torch.float32, num_splits=2, block_n=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t", [1, 6])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_gated_mla_matches_naive(t, dtype, num_splits, nan_workspace):
    """The head-wise gate in the kernel's store (one split) or in the reduction (three): against the reference,
    with q_lat in the W_UK product's head-major layout and strided gate logits. The gate is applied exactly once:
    the fp32 output is the ungated kernel's times sigmoid(gate)."""
    positions = list(range(40, 40 + t))
    got = check_mla(positions, 5, 32, 8, 77, dtype, gated=True, num_splits=num_splits, block_n=16, block_m=16)
    if dtype == torch.float32:
        ungated = check_mla(positions, 5, 32, 8, 77, dtype, num_splits=num_splits, block_n=16, block_m=16)
        gate = torch.sigmoid(gate_logits_for(t, 5, dtype))[:, :, None]
        torch.testing.assert_close(got, ungated * gate, rtol=1e-6, atol=1e-6)


def test_gated_ling_head_width(nan_workspace):
    """C = 512, R = 64 with the gate, split and not."""
    check_mla([30, 31], 4, 512, 64, 70, torch.float32, gated=True, num_splits=2, block_n=16)
    check_mla([30, 31], 4, 512, 64, 70, torch.float32, gated=True, num_splits=1, block_n=16)


def test_naive_gate_rounds_once():
    """The reference's order: o_lat in fp32, times sigmoid(gate) in fp32, one rounding to q_lat's dtype."""
    q_lat, q_rope, latent, pos = (x.cpu() for x in make_inputs([9, 10, 11], 4, 32, 8, 12, torch.bfloat16))
    gate = gate_logits_for(3, 4, torch.bfloat16).cpu()
    o32 = naive.mla_decode(q_lat.float(), q_rope, latent, pos, 32, 0.2)  # the same fp32 sums (bf16 values widened)
    want = (o32 * torch.sigmoid(gate.float())[:, :, None]).to(torch.bfloat16)
    assert torch.equal(naive.mla_decode(q_lat, q_rope, latent, pos, 32, 0.2, gate), want)
    assert torch.equal(naive.apply_head_gate(o32, gate), o32 * naive.head_gate(gate))


def test_cpu_dispatch_is_naive():
    q_lat, q_rope, latent, pos = (x.cpu() for x in make_inputs([6, 7], 4, 32, 8, 8, torch.float32))
    got = mla_ops.mla_decode(q_lat, q_rope, latent, pos, 32, 0.2)
    torch.testing.assert_close(got, naive.mla_decode(q_lat, q_rope, latent, pos, 32, 0.2))


# CUDA: Ling-3.0-flash shapes, graphs ---------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 6, 16])
def test_mla_ling_shapes(t, nan_workspace):
    """H=32, latent 512 + 64, bf16 and fp32, a 4099-row cache with the default split policy."""
    positions = list(range(3001, 3001 + t))
    check_mla(positions, 32, 512, 64, 4099, torch.bfloat16)
    check_mla(positions, 32, 512, 64, 4099, torch.float32)
    check_mla(positions, 32, 512, 64, 4099, torch.bfloat16, gated=True)
    check_mla(positions, 32, 512, 64, 299, torch.bfloat16, gated=True, num_splits=1)


@pytest.mark.gpu
def test_mla_graph_replay_new_positions():
    """One capture, replayed at other contexts by rewriting the position tensor in place."""
    t, max_len = 6, 4099
    q_lat, q_rope, latent, pos = make_inputs(list(range(4000, 4000 + t)), 32, 512, 64, max_len, torch.bfloat16)
    latent = torch.randn_like(latent)
    out = torch.empty_like(q_lat)
    scale = 192**-0.5
    tm.mla_decode(q_lat, q_rope, latent, pos, 512, scale, out=out)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tm.mla_decode(q_lat, q_rope, latent, pos, 512, scale, out=out)
    for start in (0, 33, 1000, 4000):
        pos.copy_(torch.arange(start, start + t, device=DEV))
        graph.replay()
        want = naive.mla_decode(q_lat, q_rope, latent[: start + t], pos, 512, scale)
        torch.testing.assert_close(out.float(), want.float(), **TOL[torch.bfloat16])


@pytest.mark.gpu
def test_cuda_dispatch(monkeypatch):
    q_lat, q_rope, latent, pos = make_inputs(list(range(200, 206)), 32, 512, 64, 300, torch.bfloat16)
    latent = torch.randn_like(latent)
    got = mla_ops.mla_decode(q_lat, q_rope, latent, pos, 512, 0.07)
    torch.testing.assert_close(got, tm.mla_decode(q_lat, q_rope, latent, pos, 512, 0.07), rtol=0, atol=0)
    monkeypatch.setenv("BATON_TRITON", "0")
    torch.testing.assert_close(mla_ops.mla_decode(q_lat, q_rope, latent, pos, 512, 0.07).float(),
                               naive.mla_decode(q_lat, q_rope, latent, pos, 512, 0.07).float(),
                               **TOL[torch.bfloat16])
