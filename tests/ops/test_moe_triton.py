"""Triton MoE (router + decode experts) against the PyTorch reference.

On a machine without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1`` is set before triton is
imported); with CUDA they are compiled and the ``gpu`` tests add the real Ling-3.0-flash shapes."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")

import baton.ops.moe.triton as mt  # noqa: E402
from baton.ops.linear.naive import swiglu  # noqa: E402
from baton.ops.moe import moe_experts, select_experts  # noqa: E402
from baton.ops.moe.naive import (  # noqa: E402
    append_shared_expert,
    fused_experts,
    fused_experts_dense_gather,
    grouped_topk,
)
from tests.ops.triton_support import assert_graph_replays_without_sync  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1" and type(mt.moe_up_direct_kernel).__name__ != "InterpretedFunction":
    mt = importlib.reload(mt)  # imported earlier without the interpreter

DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")
E, N_GROUP, TOPK_GROUP, TOPK, D, INTER = 16, 4, 2, 4, 48, 24
MODES = ("direct", "aligned", "hybrid")
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _logits(num_tokens: int, num_experts: int = E) -> torch.Tensor:
    return torch.randn(num_tokens, num_experts, device=DEVICE) * 2.0


def _weights(dtype: torch.dtype, num_experts: int = E, d: int = D, inter: int = INTER):
    w13 = (torch.randn(num_experts, 2 * inter, d, device=DEVICE) * d**-0.5).to(dtype)
    w2 = (torch.randn(num_experts, d, inter, device=DEVICE) * inter**-0.5).to(dtype)
    return w13, w2


def _route(num_tokens: int, k: int = TOPK, num_experts: int = E):
    logits = _logits(num_tokens, num_experts)
    bias = torch.randn(num_experts, device=DEVICE) * 0.1
    return grouped_topk(torch.sigmoid(logits), bias, k, N_GROUP, TOPK_GROUP, True, 2.5)


def _shared_routes(num_tokens: int, k: int = TOPK, num_experts: int = E) -> tuple[torch.Tensor, torch.Tensor]:
    """Routes where every token picks expert 0 and all tokens draw from a small pool: many duplicates."""
    rows = []
    for _ in range(num_tokens):
        rest = torch.randperm(min(num_experts - 1, k + 2))[: k - 1] + 1
        rows.append(torch.cat([torch.zeros(1, dtype=torch.long), rest])[torch.randperm(k)])
    ids = torch.stack(rows).to(DEVICE)
    w = torch.rand(num_tokens, k, device=DEVICE) + 0.1
    return ids, w / w.sum(-1, keepdim=True) * 2.5


def _reference(x, w13, w2, ids, w, limit, residual, shared):
    y = fused_experts(x, w13, w2, ids, w, limit)
    if shared is not None:
        y = y + shared.float()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def _fused_shared_reference(x, w13, w2, ids, w, limit, shared_limit, residual):
    """A fused shared expert (the last of the E + 1 experts, the last column of every route) computed on its own:
    the routed columns through ``fused_experts`` with ``limit``, the shared expert as a dense SwiGLU MLP with
    ``shared_limit``, added in fp32."""
    xf = x.float()
    y = fused_experts(xf, w13.float(), w2.float(), ids[:, :-1], w[:, :-1], limit)
    y = y + swiglu(xf @ w13[-1].float().t(), shared_limit) @ w2[-1].float().t()
    if residual is not None:
        y = y + residual.float()
    return y.to(x.dtype)


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out).all()
    tol = TOL[dtype]
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def _sorted(ids: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    order = torch.sort(ids.long(), dim=1)
    return order.values, w.gather(1, order.indices)


# ---------------------------------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_tokens", [1, 3, 6, 16])
@pytest.mark.parametrize("n_group,topk_group,use_bias,renorm", [(4, 2, True, True), (4, 2, False, False),
                                                                 (1, 1, True, True)])
def test_router_matches_naive(num_tokens, n_group, topk_group, use_bias, renorm):
    logits = _logits(num_tokens)
    bias = torch.randn(E, device=DEVICE) * 0.3 if use_bias else None
    ids, w = mt.grouped_topk_fused(logits, bias, TOPK, n_group, topk_group, renorm, 2.5)
    rid, rw = grouped_topk(torch.sigmoid(logits), bias, TOPK, n_group, topk_group, renorm, 2.5)
    assert ids.dtype == torch.int32 and w.dtype == torch.float32 and ids.shape == (num_tokens, TOPK)
    ids_s, w_s = _sorted(ids, w)
    rid_s, rw_s = _sorted(rid, rw)
    assert torch.equal(ids_s, rid_s)
    torch.testing.assert_close(w_s, rw_s, atol=1e-6, rtol=1e-5)
    # selection order: best (biased) score first
    choice = torch.sigmoid(logits) + (bias if bias is not None else 0)
    sel = choice.gather(1, ids.long())
    assert (sel[:, :-1] >= sel[:, 1:]).all()


def test_router_ling_shape():
    logits = _logits(4, 512)
    bias = torch.randn(512, device=DEVICE) * 0.05
    ids, w = mt.grouped_topk_fused(logits, bias, 8, 8, 4, True, 2.5)
    rid, rw = grouped_topk(torch.sigmoid(logits), bias, 8, 8, 4, True, 2.5)
    ids_s, w_s = _sorted(ids, w)
    rid_s, rw_s = _sorted(rid, rw)
    assert torch.equal(ids_s, rid_s)
    torch.testing.assert_close(w_s, rw_s, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.full((4,), 2.5, device=DEVICE))


# ---------------------------------------------------------------------------------------------------------------------
# Experts
# ---------------------------------------------------------------------------------------------------------------------

CASES = [  # (T, swiglu_limit, residual, shared_out)
    (1, 0.0, False, False),
    (1, 4.0, True, True),
    (3, 4.0, True, False),
    (6, 0.0, False, True),
    (6, 4.0, True, True),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_tokens,limit,with_res,with_shared", CASES)
def test_experts_match_naive(dtype, mode, num_tokens, limit, with_res, with_shared):
    w13, w2 = _weights(dtype)
    ids, w = _route(num_tokens)
    x = torch.randn(num_tokens, D, device=DEVICE).to(dtype)
    res = torch.randn(num_tokens, D, device=DEVICE).to(dtype) if with_res else None
    shared = torch.randn(num_tokens, D, device=DEVICE).to(dtype) if with_shared else None
    out = mt.fused_experts_decode(x, w13, w2, ids, w, limit, residual=res, shared_out=shared, mode=mode)
    _check(out, _reference(x, w13, w2, ids, w, limit, res, shared), dtype)


F32, BF16 = torch.float32, torch.bfloat16
SHARED_CASES = [  # (T, routed swiglu_limit, shared swiglu_limit, dtype, mode): one clamp off, the other on; both on
    (1, 0.0, 0.8, F32, "direct"),  # and different (small clamps: they bite on O(1) activations)
    (1, 0.0, 0.8, BF16, "direct"),
    (2, 0.6, 1.0, F32, "direct"),
    (3, 0.6, 0.0, F32, "aligned"),
    (3, 0.6, 0.0, BF16, "hybrid"),
    (6, 0.6, 1.0, F32, "hybrid"),
    (6, 0.6, 1.0, BF16, "aligned"),
]


@pytest.mark.parametrize("num_tokens,limit,shared_limit,dtype,mode", SHARED_CASES)
def test_experts_fused_shared_expert(num_tokens, limit, shared_limit, dtype, mode):
    """A fused shared expert: expert E of E + 1, the last column of every row with weight 1, its own SwiGLU clamp
    (``shared_id`` / ``shared_limit``), against the shared expert computed as a separate MLP; the reference's
    per-pair clamp against the same."""
    w13, w2 = _weights(dtype, E + 1)
    ids, w = append_shared_expert(*_route(num_tokens), E)
    x = torch.randn(num_tokens, D, device=DEVICE).to(dtype)
    res = torch.randn(num_tokens, D, device=DEVICE).to(dtype)
    want = _fused_shared_reference(x, w13, w2, ids, w, limit, shared_limit, res)
    out = mt.fused_experts_decode(x, w13, w2, ids, w, limit, residual=res, mode=mode, shared_id=E,
                                  shared_limit=shared_limit)
    _check(out, want, dtype)
    ref = fused_experts(x, w13, w2, ids, w, limit, shared_id=E, shared_limit=shared_limit) + res.float()
    _check(ref.to(dtype), want, dtype)
    one_clamp = fused_experts(x, w13, w2, ids, w, limit) + res.float()  # the clamps bite: one for all differs
    assert not torch.allclose(one_clamp.to(dtype).float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("align", ["triton", "torch"])
@pytest.mark.parametrize("mode", MODES)
def test_experts_shared_between_tokens(mode, align):
    """Verify-shaped routes: every token picks expert 0, the rest from a small pool (aligned blocks of > 1 row)."""
    w13, w2 = _weights(torch.float32)
    ids, w = _shared_routes(6)
    x = torch.randn(6, D, device=DEVICE)
    res = torch.randn(6, D, device=DEVICE)
    out = mt.fused_experts_decode(x, w13, w2, ids, w, 4.0, residual=res, mode=mode, align=align)
    _check(out, _reference(x, w13, w2, ids, w, 4.0, res, None), torch.float32)


@pytest.mark.parametrize("align", ["triton", "torch"])
def test_experts_bucket_larger_than_block(align):
    """20 tokens all picking expert 0: its bucket spans two BLOCK_M=16 blocks."""
    w13, w2 = _weights(torch.float32)
    ids, w = _shared_routes(20)
    x = torch.randn(20, D, device=DEVICE)
    out = mt.fused_experts_decode(x, w13, w2, ids, w, 0.0, mode="aligned", align=align)
    _check(out, _reference(x, w13, w2, ids, w, 0.0, None, None), torch.float32)


def _align_reference(flat: list[int], block_m: int):
    order = sorted(range(len(flat)), key=lambda p: (flat[p], p))
    blocks = []
    pos = 0
    while pos < len(order):
        e = flat[order[pos]]
        end = pos
        while end < len(order) and flat[order[end]] == e:
            end += 1
        for s in range(pos, end, block_m):
            blocks.append((e, s, min(block_m, end - s)))
        pos = end
    return order, blocks


@pytest.mark.parametrize("num_pairs,block_m", [(1, 16), (24, 16), (100, 16), (100, 4), (128, 16)])
def test_align_metadata(num_pairs, block_m):
    flat = torch.randint(0, 7, (num_pairs,), device=DEVICE, dtype=torch.int32)
    order, blocks = _align_reference(flat.tolist(), block_m)
    for al in (mt.moe_align_fwd(flat, 7, block_m, False), mt.moe_align_torch(flat, 7, block_m)):
        nb = int(al.num_blocks.item())
        assert nb == len(blocks) <= al.max_blocks
        assert al.sorted_pairs.tolist() == order
        got = list(zip(al.block_expert[:nb].tolist(), al.block_start[:nb].tolist(), al.block_count[:nb].tolist(),
                       strict=True))
        assert got == blocks


@pytest.mark.parametrize("mode", MODES)
def test_poisoned_buffers(monkeypatch, mode):
    """Every intermediate and output element read must have been written: allocate them NaN / out of range."""

    def poisoned(shape, dtype, device):
        fill = float("nan") if dtype.is_floating_point else mt._POISON_INT
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(mt, "_empty", poisoned)
    w13, w2 = _weights(torch.float32)
    ids, w = _shared_routes(3)
    x = torch.randn(3, D, device=DEVICE)
    shared = torch.randn(3, D, device=DEVICE)
    out = torch.full((3, D), float("nan"), device=DEVICE)
    got = mt.fused_experts_decode(x, w13, w2, ids, w, 4.0, shared_out=shared, mode=mode, out=out)
    assert got.data_ptr() == out.data_ptr()
    _check(out, _reference(x, w13, w2, ids, w, 4.0, None, shared), torch.float32)
    rid, rw = mt.grouped_topk_fused(_logits(3), None, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
    assert rid.min() >= 0 and rid.max() < E and torch.isfinite(rw).all()


def test_dense_gather_matches_reference():
    w13, w2 = _weights(torch.float32)
    ids, w = _shared_routes(5)
    x = torch.randn(5, D, device=DEVICE)
    torch.testing.assert_close(fused_experts_dense_gather(x, w13, w2, ids, w, 4.0),
                               fused_experts(x, w13, w2, ids, w, 4.0), atol=1e-5, rtol=1e-5)


def test_dense_gather_fused_shared_matches_reference():
    w13, w2 = _weights(torch.float32, E + 1)
    ids, w = append_shared_expert(*_shared_routes(5), E)
    x = torch.randn(5, D, device=DEVICE)
    torch.testing.assert_close(fused_experts_dense_gather(x, w13, w2, ids, w, 4.0, shared_id=E, shared_limit=0.0),
                               _fused_shared_reference(x, w13, w2, ids, w, 4.0, 0.0, None), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("n_group,topk_group,active", [(4, 2, None), (1, 1, 3), (4, 2, 0)])
def test_router_appends_the_shared_expert(n_group, topk_group, active):
    """``shared_id``: k + 1 columns from the one kernel, the routed k as without it (rows past ``active_rows``:
    id -1, weight 0) and the last ``(E, 1.0)`` on every row, active or not; ``select_experts`` the same."""
    num_tokens = 6
    logits = _logits(num_tokens)
    bias = torch.randn(E, device=DEVICE) * 0.3
    rows = None if active is None else torch.tensor([active], dtype=torch.int32, device=DEVICE)
    ids, w = mt.grouped_topk_fused(logits, bias, TOPK, n_group, topk_group, True, 2.5, rows, shared_id=E)
    rid, rw = mt.grouped_topk_fused(logits, bias, TOPK, n_group, topk_group, True, 2.5, rows)
    assert ids.shape == w.shape == (num_tokens, TOPK + 1) and ids.dtype == torch.int32 and w.dtype == torch.float32
    assert torch.equal(ids[:, :TOPK], rid)
    torch.testing.assert_close(w[:, :TOPK], rw, atol=1e-7, rtol=1e-6)  # the renormalising sum is one block wider
    assert (ids[:, TOPK] == E).all() and (w[:, TOPK] == 1.0).all()
    nid, nw = grouped_topk(torch.sigmoid(logits), bias, TOPK, n_group, topk_group, True, 2.5, shared_id=E)
    n = num_tokens if active is None else active
    assert torch.equal(_sorted(ids[:n], w[:n])[0], _sorted(nid[:n], nw[:n])[0])
    torch.testing.assert_close(_sorted(ids[:n], w[:n])[1], _sorted(nid[:n], nw[:n])[1], atol=1e-6, rtol=1e-5)
    assert (ids[n:, :TOPK] == -1).all() and (w[n:, :TOPK] == 0).all()
    sid, sw = select_experts(logits, bias, TOPK, n_group, topk_group, True, 2.5, active_rows=rows, shared_id=E)
    assert torch.equal(_sorted(sid, sw)[0], _sorted(ids, w)[0])
    torch.testing.assert_close(_sorted(sid, sw)[1], _sorted(ids, w)[1], atol=1e-6, rtol=1e-5)


def test_dispatch_matches_reference():
    """``select_experts`` / ``moe_experts``: Triton on CUDA, the reference on CPU; same results either way."""
    w13, w2 = _weights(torch.float32)
    logits = _logits(3)
    bias = torch.randn(E, device=DEVICE) * 0.1
    ids, w = select_experts(logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
    rid, rw = grouped_topk(torch.sigmoid(logits), bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
    assert torch.equal(_sorted(ids, w)[0], _sorted(rid, rw)[0])
    x = torch.randn(3, D, device=DEVICE)
    res = torch.randn(3, D, device=DEVICE)
    out = moe_experts(x, w13, w2, ids, w, 4.0, residual=res)
    _check(out, _reference(x, w13, w2, ids, w, 4.0, res, None), torch.float32)


# ---------------------------------------------------------------------------------------------------------------------
# Real shapes (CUDA)
# ---------------------------------------------------------------------------------------------------------------------

LING = dict(num_experts=512, d=2560, inter=768)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("num_tokens", [1, 6, 16])
def test_gpu_ling_shapes(mode, num_tokens):
    w13, w2 = _weights(torch.bfloat16, LING["num_experts"], LING["d"], LING["inter"])
    logits = _logits(num_tokens, 512)
    bias = torch.randn(512, device=DEVICE) * 0.05
    ids, w = mt.grouped_topk_fused(logits, bias, 8, 8, 4, True, 2.5)
    rid, _ = grouped_topk(torch.sigmoid(logits), bias, 8, 8, 4, True, 2.5)
    assert torch.equal(torch.sort(ids.long(), 1).values, torch.sort(rid, 1).values)
    x = torch.randn(num_tokens, LING["d"], device=DEVICE, dtype=torch.bfloat16)
    res = torch.randn_like(x)
    shared = torch.randn_like(x)
    out = mt.fused_experts_decode(x, w13, w2, ids, w, 4.0, residual=res, shared_out=shared, mode=mode)
    ref = fused_experts(x.float(), w13.float(), w2.float(), ids, w, 4.0) + shared.float() + res.float()
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_tokens", [1, 6])
def test_gpu_graph_capture_no_sync(num_tokens):
    """Router + experts captured in a CUDA graph under sync-debug 'error' (any host sync raises)."""
    w13, w2 = _weights(torch.bfloat16, 64, 256, 128)
    gate = torch.randn(64, 256, device=DEVICE) * 0.1
    bias = torch.randn(64, device=DEVICE) * 0.05
    x = torch.randn(num_tokens, 256, device=DEVICE, dtype=torch.bfloat16)

    def step():
        ids, w = select_experts(x.float() @ gate.t(), bias, 8, 8, 4, True, 2.5)
        return moe_experts(x, w13, w2, ids, w, 4.0, residual=x)

    assert_graph_replays_without_sync(step)
