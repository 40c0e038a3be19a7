"""w8a8 MoE (``act_fp8=True``: fp8 experts x e4m3 activations quantised per (row, 128-K group) with power-of-two
scales) and the one-program alignment for up to 256 pairs: the kernels (Triton interpreter on CPU, compiled on CUDA)
against the plain-PyTorch reference ``naive.fused_experts_w8a8``, which computes the same arithmetic; the w8a8 error
against the unquantised product is bounded."""

from __future__ import annotations

import pytest
import torch

from baton.ops.moe.naive import fused_experts, fused_experts_w8a8, quantize_act_e4m3
from baton.ops.quant import dequantize_fp8_block, dequantize_fp8_gate_up, quantize_fp8_block, quantize_fp8_gate_up
from tests.ops.triton_support import assert_graph_replays_without_sync, interpreted_module

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
# Kernel against reference: the interpreter computes the same fp32 sums (1e-4); the compiled fp8 x fp8 MMA keeps a
# narrower accumulator inside each 128-K group (Hopper's fp8 wgmma), measured up to 6e-4 absolute at these shapes
TOL = dict(rtol=1e-2, atol=2e-3) if HAS_CUDA else dict(rtol=1e-4, atol=1e-4)


def _mt():
    return interpreted_module("baton.ops.moe.triton")


def _experts(e: int, d: int, inter: int, gen: torch.Generator):
    w13 = torch.randn(e, 2 * inter, d, generator=gen) * d**-0.5
    w2 = torch.randn(e, d, inter, generator=gen) * inter**-0.5
    (q13, s13), (q2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
    return w13, w2, q13, s13, q2, s2


def _routes(num_tokens: int, e: int, k: int, gen: torch.Generator, drop_from: int | None = None):
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(num_tokens)])
    if drop_from is not None:
        ids[drop_from:] = -1
    w = torch.rand(num_tokens, k, generator=gen) + 0.1
    return ids, w


# --------------------------------------------------------------------------------------------------------------------
# Activation quantisation
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [128, 300, 7])
def test_act_quantisation_power_of_two_scales(k):
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(5, k, generator=gen) * torch.logspace(-8, 8, 5)[:, None]
    x[2, :] = 0.0  # an all-zero row: a normal scale, zeros out
    q, s = quantize_act_e4m3(x)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (5, (k + 127) // 128)
    mant, _ = torch.frexp(s)
    assert torch.all(mant == 0.5)  # powers of two
    qf = q.float()
    assert qf.abs().max() <= 448.0 and torch.isfinite(qf).all()
    assert torch.all(qf[2] == 0)
    pad = (-k) % 128
    deq = (torch.nn.functional.pad(qf, (0, pad)).view(5, -1, 128) * s[..., None]).view(5, -1)[:, :k]
    nz = [0, 1, 3, 4]
    err = (deq[nz] - x[nz]).norm(dim=1) / x[nz].norm(dim=1)
    assert err.max() < 0.05  # 3 mantissa bits
    # the scale is the smallest power of two that fits the group's amax in 448
    amax = torch.nn.functional.pad(x.abs(), (0, pad)).view(5, -1, 128).amax(-1)
    assert torch.all(amax[nz] / s[nz] <= 448.0) and torch.all(amax[nz] / (s[nz] / 2) > 448.0)


# --------------------------------------------------------------------------------------------------------------------
# Kernels against the reference
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens,align,drop_from", [(1, None, None), (2, None, 1), (3, None, None),
                                                       (6, "triton", 4), (6, "torch", None)])
@pytest.mark.parametrize("limit", [0.0, 4.0])
def test_w8a8_kernel_matches_reference(num_tokens, align, drop_from, limit):
    """Ragged shapes (d = 160, I = 136: partial 128-groups along both K axes), top-3 of 6 experts (shared between
    tokens: aligned blocks of several rows), ids -1 for the rows past ``drop_from``."""
    mt = _mt()
    gen = torch.Generator().manual_seed(10 * num_tokens + int(limit))
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(num_tokens, 160, generator=gen)
    ids, w = _routes(num_tokens, 6, 3, gen, drop_from)
    res, shared = torch.randn(num_tokens, 160, generator=gen), torch.randn(num_tokens, 160, generator=gen)
    ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, limit) + shared + res
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), limit, residual=to(res),
                                  shared_out=to(shared), w13_scale=to(s13), w2_scale=to(s2), act_fp8=True,
                                  align=align)
    torch.testing.assert_close(out.cpu(), ref, **TOL)


def _shared_reference(x, q13, s13, q2, s2, ids, w, limit, shared_limit, act="e4m3"):
    """A fused shared expert (the last expert, every row's last column) on its own: the routed columns with
    ``limit`` plus the shared column with ``shared_limit``, each through the one-clamp reference."""
    routed = fused_experts_w8a8(x, q13, s13, q2, s2, ids[:, :-1], w[:, :-1], limit, act=act)
    return routed + fused_experts_w8a8(x, q13, s13, q2, s2, ids[:, -1:], w[:, -1:], shared_limit, act=act)


@pytest.mark.parametrize("num_tokens,align,split,limit,shared_limit", [(1, None, 1, 0.0, 0.8),
                                                                       (3, "triton", 1, 0.6, 0.0),
                                                                       (2, None, 2, 0.6, 1.0)])
def test_w8a8_fused_shared_expert(num_tokens, align, split, limit, shared_limit):
    """A fused shared expert (expert 6 of 7, weight 1 in every row's last column, its own SwiGLU clamp) on the
    w8a8 kernels: direct, aligned, and the split-K up-projection (SwiGLU in the down kernel); the references (loop
    and capture forms) with the per-pair clamp against the same."""
    from baton.ops.moe.naive import append_shared_expert

    mt = _mt()
    gen = torch.Generator().manual_seed(num_tokens + split)
    _, _, q13, s13, q2, s2 = _experts(7, 160, 136, gen)
    x = torch.randn(num_tokens, 160, generator=gen)
    ids, w = append_shared_expert(*_routes(num_tokens, 6, 3, gen), 6)
    res = torch.randn(num_tokens, 160, generator=gen)
    want = _shared_reference(x, q13, s13, q2, s2, ids, w, limit, shared_limit)
    lim = dict(shared_id=6, shared_limit=shared_limit)
    for capturing in (False, True):
        torch.testing.assert_close(fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, limit, capturing=capturing, **lim),
                                   want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, limit), want, rtol=1e-3, atol=1e-3)
    cfg = mt.MoEConfig(up=mt.MoETile(64, 128, 4, 2, split), down=mt.MoETile(64, 128, 4, 2))
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), limit, residual=to(res), w13_scale=to(s13),
                                  w2_scale=to(s2), act_fp8=True, align=align, config=cfg, **lim)
    torch.testing.assert_close(out.cpu(), want + res, **TOL)


@pytest.mark.parametrize("tile", [(32, 2), (128, 1)])
def test_w8a8_tiles(tile):
    mt = _mt()
    gen = torch.Generator().manual_seed(tile[0])
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(4, 160, generator=gen)
    ids, w = _routes(4, 6, 3, gen)
    cfg = mt.MoEConfig(up=mt.MoETile(tile[0], 128, 4, tile[1]), down=mt.MoETile(tile[0], 128, 4, tile[1]))
    ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 0.0)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), 0.0, w13_scale=to(s13), w2_scale=to(s2),
                                  act_fp8=True, config=cfg)
    torch.testing.assert_close(out.cpu(), ref, **TOL)


def test_w8a8_rejects_a_tile_off_the_groups():
    mt = _mt()
    gen = torch.Generator().manual_seed(0)
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    ids, w = _routes(1, 6, 3, gen)
    cfg = mt.MoEConfig(up=mt.MoETile(32, 64, 4, 2), down=mt.MoETile(32, 128, 4, 2))
    with pytest.raises(AssertionError):
        mt.fused_experts_decode(torch.randn(1, 160), q13, q2, ids, w, 0.0, w13_scale=s13, w2_scale=s2, act_fp8=True,
                                config=cfg)


def test_w8a8_poisoned_buffers(monkeypatch):
    mt = _mt()

    def poisoned(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else mt._POISON_INT
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(mt, "_empty", poisoned)
    gen = torch.Generator().manual_seed(3)
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    for num_tokens in (1, 4):
        x = torch.randn(num_tokens, 160, generator=gen)
        ids, w = _routes(num_tokens, 6, 3, gen, drop_from=num_tokens - 1)
        ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 4.0)
        out = mt.fused_experts_decode(x.to(DEVICE), q13.to(DEVICE), q2.to(DEVICE), ids.to(DEVICE), w.to(DEVICE), 4.0,
                                      w13_scale=s13.to(DEVICE), w2_scale=s2.to(DEVICE), act_fp8=True)
        torch.testing.assert_close(out.cpu(), ref, **TOL)


def test_w8a8_capture_reference_matches_loop():
    gen = torch.Generator().manual_seed(5)
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(4, 160, generator=gen)
    ids, w = _routes(4, 6, 3, gen, drop_from=3)
    torch.testing.assert_close(fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 4.0, capturing=True),
                               fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 4.0), rtol=1e-6, atol=1e-6)


def test_w8a8_error_against_unquantised_product():
    """Against fp32 math on the same (dequantised) fp8 experts the activation quantisation alone costs a few
    percent at most; against the unquantised fp32 experts, weights and activations together stay under 8%."""
    gen = torch.Generator().manual_seed(7)
    w13, w2, q13, s13, q2, s2 = _experts(8, 384, 256, gen)
    x = torch.randn(5, 384, generator=gen)
    ids, w = _routes(5, 8, 4, gen)
    got = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 0.0)
    deq = fused_experts(x, dequantize_fp8_gate_up(q13, s13, torch.float32), dequantize_fp8_block(q2, s2, torch.float32),
                        ids, w, 0.0)
    full = fused_experts(x, w13, w2, ids, w, 0.0)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()  # noqa: E731
    assert rel(got, deq) < 0.05
    assert rel(got, full) < 0.08


def test_moe_experts_act_fp8_dispatch():
    """``moe_experts(act_fp8=True)``: the Triton kernels on CUDA, the reference on CPU; the same numbers."""
    from baton.ops.moe import moe_experts

    gen = torch.Generator().manual_seed(11)
    _, _, q13, s13, q2, s2 = _experts(6, 160, 136, gen)
    x = torch.randn(3, 160, generator=gen)
    ids, w = _routes(3, 6, 3, gen)
    res = torch.randn(3, 160, generator=gen)
    ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 4.0) + res
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = moe_experts(to(x), to(q13), to(q2), to(ids), to(w), 4.0, residual=to(res), w13_scale=to(s13),
                      w2_scale=to(s2), act_fp8=True)
    torch.testing.assert_close(out.cpu(), ref, **TOL)
    with pytest.raises(ValueError):
        moe_experts(x, q13, q2, ids, w, act_fp8=True)


# --------------------------------------------------------------------------------------------------------------------
# The one-program alignment up to 256 pairs
# --------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_pairs,num_experts,block_m,drop", [(136, 512, 16, 0), (136, 9, 16, 24),
                                                                (256, 512, 16, 0), (256, 5, 16, 40),
                                                                (200, 3, 64, 7), (48, 512, 16, 8)])
def test_align_kernel_matches_torch_alignment(num_pairs, num_experts, block_m, drop):
    """The one-program alignment against the torch sort/scatter alignment: same sorted pairs (stable, the pairs
    with id -1 last in pair order) and the same blocks; a DSpark verify of T = 17 (136 pairs) and the most (256)."""
    mt = _mt()
    gen = torch.Generator().manual_seed(num_pairs + drop)
    flat = torch.randint(0, num_experts, (num_pairs,), generator=gen, dtype=torch.int32)
    if drop:
        flat[torch.randperm(num_pairs, generator=gen)[:drop]] = -1
    flat = flat.to(DEVICE)
    a, b = mt.moe_align_fwd(flat, num_experts, block_m, False), mt.moe_align_torch(flat, num_experts, block_m)
    nb = int(a.num_blocks.item())
    assert nb == int(b.num_blocks.item()) and a.max_blocks == b.max_blocks
    assert torch.equal(a.sorted_pairs.cpu(), b.sorted_pairs.cpu())
    for name in ("block_expert", "block_start", "block_count"):
        assert torch.equal(getattr(a, name)[:nb].cpu(), getattr(b, name)[:nb].cpu()), name


def test_default_alignment_is_the_kernel_up_to_256_pairs(monkeypatch):
    """T = 3..32 tokens of top-8: the aligned path never calls the torch alignment (no torch sort)."""
    mt = _mt()

    def no_torch(*a, **k):
        raise AssertionError("torch alignment called")

    monkeypatch.setattr(mt, "moe_align_torch", no_torch)
    gen = torch.Generator().manual_seed(1)
    e, d, inter = 40, 32, 16
    w13 = (torch.randn(e, 2 * inter, d, generator=gen) * d**-0.5).to(DEVICE)
    w2 = (torch.randn(e, d, inter, generator=gen) * inter**-0.5).to(DEVICE)
    x = torch.randn(32, d, generator=gen).to(DEVICE)
    ids, w = _routes(32, e, 8, gen, drop_from=29)
    out = mt.fused_experts_decode(x, w13, w2, ids.to(DEVICE), w.to(DEVICE), 0.0, mode="aligned")
    ref = fused_experts(x.cpu(), w13.cpu(), w2.cpu(), ids, w, 0.0)
    torch.testing.assert_close(out.cpu(), ref, **TOL)


# --------------------------------------------------------------------------------------------------------------------
# Real shapes (CUDA)
# --------------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ling_fp8_experts():
    """Ling-3.0-flash experts (512 x [1536, 2560] / [2560, 768]) quantised to fp8, drawn on the GPU."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    e, d, inter = 512, 2560, 768
    w13 = torch.randn(e, 2 * inter, d, generator=gen, device=DEVICE) * d**-0.5
    q13, s13 = quantize_fp8_gate_up(w13)
    del w13
    w2 = torch.randn(e, d, inter, generator=gen, device=DEVICE) * inter**-0.5
    q2, s2 = quantize_fp8_block(w2)
    del w2
    return q13, s13, q2, s2


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 6, 17, 32])
def test_gpu_w8a8_ling_shapes(num_tokens, ling_fp8_experts):
    """Ling-3.0-flash fp8 experts, bf16 activations, random routes: the compiled fp8 x fp8 kernels against the
    reference (fp32 sums in another order, the MMA's accumulation: a small tolerance), and their w8a8 error against
    the default fp8 path (weights widened, activations unquantised)."""
    import baton.ops.moe.triton as mt

    q13, s13, q2, s2 = ling_fp8_experts
    e, d = 512, 2560
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, d, generator=gen).to(DEVICE, torch.bfloat16)
    ids, w = _routes(num_tokens, e, 8, gen, drop_from=num_tokens - 1 if num_tokens > 1 else None)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    res = torch.randn(num_tokens, d, device=DEVICE, dtype=torch.bfloat16)
    out = mt.fused_experts_decode(x, q13, q2, ids, w, 7.0, residual=res, w13_scale=s13, w2_scale=s2, act_fp8=True)
    ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 7.0) + res.float()
    rel = ((out.float() - ref).norm() / (ref - res.float()).norm()).item()
    assert rel < 1e-2, rel  # bf16 output rounding + MMA accumulation order
    base = mt.fused_experts_decode(x, q13, q2, ids, w, 7.0, residual=res, w13_scale=s13, w2_scale=s2)
    rel_base = ((out.float() - base.float()).norm() / (base.float() - res.float()).norm()).item()
    assert rel_base < 0.06, rel_base


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("split", [2])
def test_gpu_w8a8_split_k_ling_shape(split, ling_fp8_experts):
    """The split-K up-projection compiled at the Ling shape (T = 1) against the reference."""
    import baton.ops.moe.triton as mt

    q13, s13, q2, s2 = ling_fp8_experts
    gen = torch.Generator().manual_seed(split)
    x = torch.randn(1, 2560, generator=gen).to(DEVICE, torch.bfloat16)
    ids, w = _routes(1, 512, 8, gen)
    ids, w = ids.to(DEVICE), w.to(DEVICE)
    cfg = mt.MoEConfig(up=mt.MoETile(64, 128, 4, 4, split), down=mt.MoETile(128, 128, 4, 4))
    out = mt.fused_experts_decode(x, q13, q2, ids, w, 7.0, w13_scale=s13, w2_scale=s2, act_fp8=True, config=cfg)
    ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 7.0)
    rel = ((out.float() - ref).norm() / ref.norm()).item()
    assert rel < 1e-2, rel


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens,act_fp8", [(17, False), (17, True), (1, True), (32, False)])
def test_gpu_capture_no_sync(num_tokens, act_fp8):
    """The one-kernel alignment (T = 17, 32) and the w8a8 path captured in a CUDA graph under sync-debug 'error'."""
    from baton.ops.moe import moe_experts

    gen = torch.Generator().manual_seed(2)
    e, d, inter = 64, 256, 256
    w13 = torch.randn(e, 2 * inter, d, generator=gen) * d**-0.5
    w2 = torch.randn(e, d, inter, generator=gen) * inter**-0.5
    (q13, s13), (q2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
    q13, s13, q2, s2 = (t.to(DEVICE) for t in (q13, s13, q2, s2))
    x = torch.randn(num_tokens, d, generator=gen).to(DEVICE, torch.bfloat16)
    ids, w = _routes(num_tokens, e, 8, gen)
    ids, w = ids.to(DEVICE).int(), w.to(DEVICE)

    def step():
        return moe_experts(x, q13, q2, ids, w, 4.0, residual=x, w13_scale=s13, w2_scale=s2, act_fp8=act_fp8)

    assert_graph_replays_without_sync(step)


@pytest.mark.parametrize("num_tokens,split", [(1, 2), (2, 3), (4, 2)])
def test_w8a8_split_k(num_tokens, split):
    """Split-K up-projection (partial gate | up sums, SwiGLU in the down kernel): the same function; d = 400 is
    4 groups, the last partial, over 2 or 3 splits (one split may get a single group)."""
    mt = _mt()
    gen = torch.Generator().manual_seed(num_tokens * split)
    _, _, q13, s13, q2, s2 = _experts(6, 400, 136, gen)
    x = torch.randn(num_tokens, 400, generator=gen)
    ids, w = _routes(num_tokens, 6, 3, gen, drop_from=num_tokens - 1 if num_tokens > 1 else None)
    cfg = mt.MoEConfig(up=mt.MoETile(64, 128, 4, 2, split), down=mt.MoETile(64, 128, 4, 2))
    ref = fused_experts_w8a8(x, q13, s13, q2, s2, ids, w, 4.0)
    to = lambda t: t.to(DEVICE)  # noqa: E731
    out = mt.fused_experts_decode(to(x), to(q13), to(q2), to(ids), to(w), 4.0, w13_scale=to(s13), w2_scale=to(s2),
                                  act_fp8=True, config=cfg)
    torch.testing.assert_close(out.cpu(), ref, **TOL)
