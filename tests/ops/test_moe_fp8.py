"""fp8 (e4m3, 128 x 128 block scales) experts: the quantisation format, and the fused MoE kernel with scales applied
in registers against a dequantise-then-reference path (Triton interpreter on CPU; compiled on CUDA)."""

from __future__ import annotations

import pytest
import torch

from baton.ops.quant import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_fp8_gate_up,
    quantize_fp8_block,
    quantize_fp8_gate_up,
    scale_shape,
)
from tests.ops.triton_support import interpreted_module

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.mark.parametrize("shape", [(256, 384), (300, 200), (3, 130, 129)])
def test_block_quantisation_round_trip(shape):
    w = torch.randn(*shape) * 0.05
    q, s = quantize_fp8_block(w)
    assert q.dtype == FP8_DTYPE and q.shape == w.shape and s.shape == scale_shape(w.shape)
    err = ((dequantize_fp8_block(q, s, torch.float32) - w).norm() / w.norm()).item()
    assert err < 0.04  # e4m3 has 3 mantissa bits: ~2-3% relative error per element
    # Each block's largest magnitude maps to the top of the e4m3 range.
    assert abs(q.float().abs().max().item() - 448.0) < 1e-3


def test_scales_are_per_block():
    w = torch.ones(256, 256)
    w[:128, 128:] *= 10.0
    _, s = quantize_fp8_block(w)
    torch.testing.assert_close(s, torch.tensor([[1.0, 10.0], [1.0, 1.0]]) / 448.0)


def _moe_triton():
    return interpreted_module("baton.ops.moe.triton")


TOP_K = 3  # of the random experts below


def _check_random_fp8_experts(mt, num_tokens: int, limit: float, add: str, shared_limit: float | None = None,
                              **kw) -> None:
    """Random fp8 experts (6 of width 136 over d = 160: several scale blocks along both axes, ragged edges; top-3
    routes) through ``mt.fused_experts_decode`` (``kw``: mode, config) with a random ``add`` ("residual" or
    "shared_out") against the dequantised reference. ``shared_limit``: a seventh expert, a fused shared expert with
    that SwiGLU clamp in every row's last column (weight 1), against it computed as a separate MLP."""
    from baton.ops.linear.naive import swiglu
    from baton.ops.moe.naive import append_shared_expert, fused_experts

    e, d, inter = 6, 160, 136
    gen = torch.Generator().manual_seed(num_tokens)
    n = e + (shared_limit is not None)
    w13 = torch.randn(n, 2 * inter, d, generator=gen) * d**-0.5
    w2 = torch.randn(n, d, inter, generator=gen) * inter**-0.5
    (q13, s13), (q2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
    x = torch.randn(num_tokens, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:TOP_K] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, TOP_K, generator=gen) + 0.1
    extra = torch.randn(num_tokens, d, generator=gen)
    dq13, dq2 = dequantize_fp8_gate_up(q13, s13, torch.float32), dequantize_fp8_block(q2, s2, torch.float32)
    ref = fused_experts(x, dq13, dq2, ids, weights, limit) + extra
    if shared_limit is not None:
        ref = ref + swiglu(x @ dq13[e].t(), shared_limit) @ dq2[e].t()
        ids, weights = append_shared_expert(ids, weights, e)
        kw = dict(kw, shared_id=e, shared_limit=shared_limit)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(weights), limit, **{add: to(extra)}, **kw,
                                  w13_scale=to(s13), w2_scale=to(s2))
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("limit", [0.0, 4.0])
@pytest.mark.parametrize("tile", [(16, 32), (64, 256), (128, 64)])  # a chunk within, or across, scale blocks
def test_fp8_fused_experts_match_dequantised_reference(num_tokens, limit, tile):
    mt = _moe_triton()
    cfg = mt.MoEConfig(up=mt.MoETile(*tile, 4, 2), down=mt.MoETile(*tile, 4, 2))
    _check_random_fp8_experts(mt, num_tokens, limit, "residual", config=cfg)


@pytest.mark.parametrize("num_tokens,mode,block_m", [(5, "aligned", 16), (50, None, 64), (7, "hybrid", 16)])
@pytest.mark.parametrize("tile", [(16, 32), (64, 64), (128, 128)])
def test_fp8_aligned_experts_match_dequantised_reference(num_tokens, mode, block_m, tile):
    """Prefill shapes: the aligned (expert-grouped, tl.dot) kernels with the scales applied per tile. 50 tokens x 3
    experts = 150 pairs > FP8_DIRECT_MAX_PAIRS, so the default picks aligned (and the torch alignment)."""
    mt = _moe_triton()
    cfg = mt.MoEConfig(up=mt.MoETile(*tile, 4, 2), down=mt.MoETile(*tile, 4, 2), block_m=block_m)
    if mode is None:
        assert num_tokens * TOP_K > mt.FP8_DIRECT_MAX_PAIRS
        cfg = None  # the table's "fp8_aligned" tiles
    _check_random_fp8_experts(mt, num_tokens, 4.0, "shared_out", mode=mode, config=cfg)


@pytest.mark.parametrize("num_tokens,mode,limit,shared_limit", [(1, None, 0.0, 0.8), (2, "direct", 0.6, 1.0),
                                                                 (5, "aligned", 0.6, 0.0)])
def test_fp8_fused_shared_expert(num_tokens, mode, limit, shared_limit):
    """fp8 experts with a fused shared expert (its own clamp) on the direct and aligned kernels."""
    mt = _moe_triton()
    cfg = mt.MoEConfig(up=mt.MoETile(64, 64, 4, 2), down=mt.MoETile(64, 64, 4, 2), block_m=16)
    _check_random_fp8_experts(mt, num_tokens, limit, "residual", shared_limit, mode=mode, config=cfg)


def test_fp8_aligned_rejects_tiles_across_scale_blocks(monkeypatch):
    """The tile check comes before any launch (on a GPU the alignment kernel ran first, on these CPU tensors)."""
    mt = _moe_triton()

    def launched(*args, **kwargs):
        raise AssertionError("a kernel was launched before the tile check")
    monkeypatch.setattr(mt, "moe_align_fwd", launched)
    monkeypatch.setattr(mt, "moe_align_torch", launched)
    e, d, inter = 2, 256, 128
    (q13, s13) = quantize_fp8_gate_up(torch.randn(e, 2 * inter, d))
    (q2, s2) = quantize_fp8_block(torch.randn(e, d, inter))
    cfg = mt.MoEConfig(up=mt.MoETile(64, 256, 4, 2), down=mt.MoETile(64, 256, 4, 2), block_m=16)
    with pytest.raises(AssertionError, match="divide the 128 x 128"):
        mt.fused_experts_decode(torch.randn(4, d), q13, q2, torch.tensor([[0, 1]] * 4), torch.rand(4, 2),
                                mode="aligned", config=cfg, w13_scale=s13, w2_scale=s2)


def test_fp8_reference_dispatch_dequantises():
    from baton.ops.moe import moe_experts
    from baton.ops.moe.naive import fused_experts

    e, d, inter = 4, 64, 32
    w13, w2 = torch.randn(e, 2 * inter, d) * 0.1, torch.randn(e, d, inter) * 0.1
    (q13, s13), (q2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
    x, ids, weights = torch.randn(2, d), torch.tensor([[0, 3], [1, 3]]), torch.rand(2, 2)
    got = moe_experts(x, q13, q2, ids, weights, w13_scale=s13, w2_scale=s2)
    dq13, dq2 = dequantize_fp8_gate_up(q13, s13, x.dtype), dequantize_fp8_block(q2, s2, x.dtype)
    want = fused_experts(x, dq13, dq2, ids, weights)
    torch.testing.assert_close(got, want.to(x.dtype))


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens,tile", [(t, tile) for t in (1, 6) for tile in (None, (16, 256), (32, 512))]
                         + [(300, None)])  # None: the table's "fp8" tiles (300 tokens: prefill, "fp8_aligned")
def test_fp8_fused_experts_ling_shapes(num_tokens, tile):
    mt = _moe_triton()
    from baton.ops.moe.naive import fused_experts_dense_gather

    e, d, inter, k = 512, 2560, 768, 8
    w13 = torch.randn(e, 2 * inter, d, device=DEVICE, dtype=torch.bfloat16) * d**-0.5
    w2 = torch.randn(e, d, inter, device=DEVICE, dtype=torch.bfloat16) * inter**-0.5
    (q13, s13), (q2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
    x = torch.randn(num_tokens, d, device=DEVICE, dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(e, device=DEVICE)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, device=DEVICE) + 0.1
    ref = fused_experts_dense_gather(x, dequantize_fp8_gate_up(q13, s13), dequantize_fp8_block(q2, s2), ids, weights)
    cfg = None if tile is None else mt.MoEConfig(up=mt.MoETile(*tile, 4, 4), down=mt.MoETile(*tile, 4, 4))
    out = mt.fused_experts_decode(x, q13, q2, ids, weights, config=cfg, w13_scale=s13, w2_scale=s2)
    assert ((out.float() - ref.float()).norm() / ref.float().norm()).item() < 2e-2


def test_fp8_prefill_dispatch_follows_baton_fp8_aligned(monkeypatch):
    """CUDA-resident fp8 experts: the Triton entry takes every shape by default; ``BATON_FP8_ALIGNED=0`` sends the
    shapes past the decode ones back to the dequantise-then-reference path (a fallback)."""
    import baton.ops.moe as moe

    calls = []

    class Stub:
        FP8_DIRECT_MAX_PAIRS = 128

        @staticmethod
        def fused_experts_decode(x, *args, **kw):
            calls.append(x.shape[0])
            return torch.zeros_like(x)

    monkeypatch.setattr(moe, "_use_triton", lambda t: True)
    monkeypatch.setattr(moe, "_triton_impl", lambda: Stub)
    e, d, inter, k = 4, 64, 32, 2
    q13, s13 = quantize_fp8_gate_up(torch.randn(e, 2 * inter, d))
    q2, s2 = quantize_fp8_block(torch.randn(e, d, inter))

    def run(t):
        ids = torch.stack([torch.randperm(e)[:k] for _ in range(t)])
        return moe.moe_experts(torch.randn(t, d), q13, q2, ids, torch.rand(t, k), w13_scale=s13, w2_scale=s2)

    run(3), run(100)  # 6 and 200 pairs
    assert calls == [3, 100]
    monkeypatch.setenv("BATON_FP8_ALIGNED", "0")
    calls.clear()
    assert run(3).abs().sum() == 0 and run(100).abs().sum() > 0  # the 200-pair call ran the reference
    assert calls == [3]
