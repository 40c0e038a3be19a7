"""MoE rows past the active prefix (``select_experts(..., active_rows=n)``): ids -1 and weight 0 from the router,
and no expert for them in ``moe_experts``: rows < n equal the all-rows result, rows >= n are residual + shared_out,
and no path reads weights for them. The reference runs on the CPU, the Triton kernels in the interpreter there
(compiled on CUDA); the ``gpu`` tests add the Ling-3.0-flash shapes and a CUDA graph replayed at several n.

"No weight read" is checked by poisoning: the expert weights are views that start one expert into a NaN buffer,
so a kernel that read "expert -1" would read NaN, and the experts only dropped rows picked are NaN too."""

from __future__ import annotations

import pytest
import torch

from baton.ops.moe import moe_experts, select_experts
from baton.ops.moe.naive import fused_experts, fused_experts_dense_gather, grouped_topk
from baton.ops.quant import dequantize_fp8_block, dequantize_fp8_gate_up, quantize_fp8_block, quantize_fp8_gate_up
from tests.ops.triton_support import DEV, interpreted_module

E, N_GROUP, TOPK_GROUP, TOPK, D, INTER, T = 16, 4, 2, 4, 48, 24, 7
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _route(num_tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    logits = torch.randn(num_tokens, E, generator=gen) * 2.0
    bias = torch.randn(E, generator=gen) * 0.1
    ids, w = grouped_topk(torch.sigmoid(logits), bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
    return logits, bias, (ids, w)


def _masked(ids: torch.Tensor, w: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids, w = ids.clone(), w.clone()
    ids[n:], w[n:] = -1, 0.0
    return ids, w


def _poisoned_experts(w: torch.Tensor, dropped_only: set[int]) -> torch.Tensor:
    """``w`` [E, ...] as a view one expert into a buffer whose expert -1 is NaN; the ``dropped_only`` experts NaN
    (built in fp32, where every dtype here converts exactly, fp8 included)."""
    buf = torch.full((w.shape[0] + 1, *w.shape[1:]), float("nan"))
    buf[1:] = w.float()
    for e in dropped_only:
        buf[1 + e] = float("nan")
    return buf.to(w.dtype)[1:]


def _dropped_only(ids: torch.Tensor, n: int) -> set[int]:
    return set(ids[n:].flatten().tolist()) - set(ids[:n].flatten().tolist())


def _weights(gen: torch.Generator, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = (torch.randn(E, 2 * INTER, D, generator=gen) * D**-0.5).to(dtype)
    w2 = (torch.randn(E, D, INTER, generator=gen) * INTER**-0.5).to(dtype)
    return w13, w2


def _full_reference(x, w13, w2, ids, w, limit, res, shared) -> torch.Tensor:
    return (fused_experts(x.float(), w13.float(), w2.float(), ids, w, limit) + shared.float() + res.float())


# ---------------------------------------------------------------------------------------------------------------------
# Router and the PyTorch reference (CPU)
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 3, T])
@pytest.mark.parametrize("shape", [(), (1,)])
def test_select_experts_drops_rows_past_active(n, shape):
    gen = torch.Generator().manual_seed(n)
    logits, bias, _ = _route(T, gen)
    full_ids, full_w = select_experts(logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
    ids, w = select_experts(logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5,
                            active_rows=torch.tensor(n, dtype=torch.int32).reshape(shape))
    assert torch.equal(ids[:n], full_ids[:n]) and torch.equal(w[:n], full_w[:n])
    assert (ids[n:] == -1).all() and (w[n:] == 0).all()


@pytest.mark.parametrize("routed", [fused_experts, fused_experts_dense_gather])
@pytest.mark.parametrize("n", [0, 1, 4])
def test_reference_experts_skip_dropped_rows(routed, n):
    """The dropped rows alone pick expert E - 1 (what an id of -1 would index in PyTorch): it is poisoned too."""
    gen = torch.Generator().manual_seed(10 + n)
    ids = torch.stack([torch.randperm(E - 1, generator=gen)[:TOPK] for _ in range(T)])
    ids[n:, 0] = E - 1
    w = torch.rand(T, TOPK, generator=gen) + 0.1
    w13, w2 = _weights(gen, torch.float32)
    x = torch.randn(T, D, generator=gen)
    want = routed(x, w13, w2, ids, w, 4.0)
    mids, mw = _masked(ids, w, n)
    drop = _dropped_only(ids, n)
    got = routed(x, _poisoned_experts(w13, drop), _poisoned_experts(w2, drop), mids, mw, 4.0)
    torch.testing.assert_close(got[:n], want[:n], atol=1e-5, rtol=1e-5)
    assert torch.equal(got[n:], torch.zeros_like(got[n:]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_dropped_rows_are_residual_plus_shared(dtype):
    """The dispatch (the reference on the CPU) with ids from ``select_experts(active_rows=n)``."""
    gen = torch.Generator().manual_seed(3)
    logits, bias, _ = _route(T, gen)
    w13, w2 = _weights(gen, dtype)
    x, res, shared = (torch.randn(T, D, generator=gen).to(dtype) for _ in range(3))
    n = 2
    ids, w = select_experts(logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5, active_rows=torch.tensor([n]))
    full_ids, full_w = select_experts(logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
    drop = _dropped_only(full_ids, n)
    got = moe_experts(x, _poisoned_experts(w13, drop), _poisoned_experts(w2, drop), ids, w, 4.0, residual=res,
                      shared_out=shared)
    want = moe_experts(x, w13, w2, full_ids, full_w, 4.0, residual=res, shared_out=shared)
    torch.testing.assert_close(got[:n].float(), want[:n].float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[n:], (res[n:].float() + shared[n:].float()).to(dtype))


# ---------------------------------------------------------------------------------------------------------------------
# Triton kernels (interpreter on the CPU)
# ---------------------------------------------------------------------------------------------------------------------


def _moe_triton():
    return interpreted_module("baton.ops.moe.triton")


def test_triton_router_drops_rows_past_active():
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(5)
    logits, bias, _ = _route(T, gen)
    logits, bias = logits.to(DEV), bias.to(DEV)
    full_ids, full_w = mt.grouped_topk_fused(logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
    for n, shape in ((0, ()), (3, (1,)), (T, ())):
        active = torch.tensor(n, dtype=torch.int32, device=DEV).reshape(shape)
        ids, w = mt.grouped_topk_fused(logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5, active_rows=active)
        assert torch.equal(ids[:n], full_ids[:n]) and torch.equal(w[:n], full_w[:n])
        assert (ids[n:] == -1).all() and (w[n:] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode,align", [("direct", None), ("aligned", "triton"), ("aligned", "torch"),
                                        ("hybrid", "triton"), ("hybrid", "torch")])
@pytest.mark.parametrize("n", [0, 3])
def test_triton_experts_skip_dropped_rows(dtype, mode, align, n):
    mt = _moe_triton()
    gen = torch.Generator().manual_seed(20 + n)
    _, _, (ids, w) = _route(T, gen)
    w13, w2 = _weights(gen, dtype)
    x, res, shared = (torch.randn(T, D, generator=gen).to(dtype) for _ in range(3))
    want = _full_reference(x, w13, w2, ids, w, 4.0, res, shared)
    mids, mw = _masked(ids.int(), w, n)
    drop = _dropped_only(ids, n)
    to = lambda t: t.to(DEV)  # noqa: E731
    got = mt.fused_experts_decode(to(x), to(_poisoned_experts(w13, drop)), to(_poisoned_experts(w2, drop)), to(mids),
                                  to(mw), 4.0, residual=to(res), shared_out=to(shared), mode=mode, align=align).cpu()
    torch.testing.assert_close(got[:n].float(), want[:n], atol=TOL[dtype], rtol=TOL[dtype])
    rest = res[n:].float() + shared[n:].float()
    if dtype == torch.float32:
        assert torch.equal(got[n:], rest)
    else:  # the interpreter rounds its bf16 stores toward zero: within one bf16 step of the fp32 sum
        torch.testing.assert_close(got[n:].float(), rest, atol=1e-30, rtol=2**-7)


@pytest.mark.parametrize("num_tokens,mode", [(5, "direct"), (5, "aligned"), (5, "hybrid"), (50, None)])
def test_triton_fp8_experts_skip_dropped_rows(num_tokens, mode):
    """fp8 experts: direct at decode shapes, aligned past FP8_DIRECT_MAX_PAIRS (50 x 3 pairs: prefill)."""
    mt = _moe_triton()
    e, d, inter, k, n = 6, 160, 136, 3, 2
    gen = torch.Generator().manual_seed(num_tokens)
    w13 = torch.randn(e, 2 * inter, d, generator=gen) * d**-0.5
    w2 = torch.randn(e, d, inter, generator=gen) * inter**-0.5
    (q13, s13), (q2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
    x, res = torch.randn(num_tokens, d, generator=gen), torch.randn(num_tokens, d, generator=gen)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(num_tokens)])
    weights = torch.rand(num_tokens, k, generator=gen) + 0.1
    dq13, dq2 = dequantize_fp8_gate_up(q13, s13, torch.float32), dequantize_fp8_block(q2, s2, torch.float32)
    want = fused_experts(x, dq13, dq2, ids, weights, 4.0) + res
    mids, mw = _masked(ids, weights, n)
    drop = _dropped_only(ids, n)
    q13, s13, q2, s2 = (_poisoned_experts(t, drop) for t in (q13, s13, q2, s2))
    to = lambda t: t.to(DEV)  # noqa: E731
    got = mt.fused_experts_decode(to(x), to(q13), to(q2), to(mids), to(mw), 4.0, residual=to(res), mode=mode,
                                  w13_scale=to(s13), w2_scale=to(s2)).cpu()
    torch.testing.assert_close(got[:n], want[:n], rtol=1e-4, atol=1e-4)
    assert torch.equal(got[n:], res[n:])


def test_triton_align_leaves_dropped_pairs_out_of_every_block():
    mt = _moe_triton()
    flat = torch.tensor([3, -1, 0, 3, -1, 5, 0, -1, 3], dtype=torch.int32, device=DEV)
    for al in (mt.moe_align_fwd(flat, 7, 2, False), mt.moe_align_torch(flat, 7, 2)):
        nb = int(al.num_blocks.item())
        blocks = list(zip(al.block_expert[:nb].tolist(), al.block_start[:nb].tolist(), al.block_count[:nb].tolist(),
                          strict=True))
        assert blocks == [(0, 0, 2), (3, 2, 2), (3, 4, 1), (5, 5, 1)]
        assert al.sorted_pairs.tolist() == [2, 6, 0, 3, 8, 5, 1, 4, 7]  # the dropped pairs last, in pair order


# ---------------------------------------------------------------------------------------------------------------------
# CUDA: the compiled kernels through the dispatch, and inside a CUDA graph
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("num_tokens,n", [(1, 0), (6, 4), (17, 9)])
def test_gpu_triton_matches_reference_with_active_rows(fp8, num_tokens, n):
    e, d, inter = 512, 2560, 768
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    w13 = torch.randn(e, 2 * inter, d, device="cuda", generator=gen, dtype=torch.bfloat16) * d**-0.5
    w2 = torch.randn(e, d, inter, device="cuda", generator=gen, dtype=torch.bfloat16) * inter**-0.5
    scales = {}
    if fp8:
        (w13, s13), (w2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
        scales = dict(w13_scale=s13, w2_scale=s2)
        ref13, ref2 = dequantize_fp8_gate_up(w13, s13, torch.float32), dequantize_fp8_block(w2, s2, torch.float32)
    else:
        ref13, ref2 = w13.float(), w2.float()
    logits = torch.randn(num_tokens, e, device="cuda", generator=gen) * 2
    bias = torch.randn(e, device="cuda", generator=gen) * 0.05
    x, res, shared = (torch.randn(num_tokens, d, device="cuda", generator=gen, dtype=torch.bfloat16) for _ in range(3))
    active = torch.tensor([n], device="cuda")
    ids, w = select_experts(logits, bias, 8, 8, 4, True, 2.5, active_rows=active)
    assert (ids[n:] == -1).all() and (w[n:] == 0).all()
    out = moe_experts(x, w13, w2, ids, w, 4.0, residual=res, shared_out=shared, **scales)
    full_ids, full_w = select_experts(logits, bias, 8, 8, 4, True, 2.5)
    ref = fused_experts(x.float(), ref13, ref2, full_ids, full_w, 4.0) + shared.float() + res.float()
    torch.testing.assert_close(out[:n].float(), ref[:n], atol=3e-2, rtol=2e-2)
    assert torch.equal(out[n:], (res[n:].float() + shared[n:].float()).bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_graph_replays_follow_the_device_active_rows():
    """One capture, replayed at several n set on the device (no host read, no recapture)."""
    num_tokens, e, d, inter = 17, 64, 256, 128
    w13 = torch.randn(e, 2 * inter, d, device="cuda", dtype=torch.bfloat16) * d**-0.5
    w2 = torch.randn(e, d, inter, device="cuda", dtype=torch.bfloat16) * inter**-0.5
    gate = torch.randn(e, d, device="cuda") * 0.1
    bias = torch.randn(e, device="cuda") * 0.05
    x = torch.randn(num_tokens, d, device="cuda", dtype=torch.bfloat16)
    active = torch.tensor([num_tokens], device="cuda")

    def step(rows):
        ids, w = select_experts(x.float() @ gate.t(), bias, 8, 8, 4, True, 2.5, active_rows=rows)
        return moe_experts(x, w13, w2, ids, w, 4.0, residual=x)

    step(active)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(active)
    for n in (17, 9, 1, 0):
        active.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(out, step(torch.tensor([n], device="cuda")), atol=0, rtol=0)
        assert torch.equal(out[n:], x[n:])
