"""Dense projections with fp8 (e4m3, 128 x 128 block) weights under ``--quantization fp8``: the Triton kernel
(``baton.ops.fp8_linear.triton.fp8_dense``, Triton's interpreter on CPU) against the dequantise-then-matmul reference
with every fusion of ``baton.ops.linear`` (RMSNorm prologue, residual and SwiGLU epilogues), fused weights whose
parts are not block-aligned (a row -> scale-row map), and the dispatch. GPU tests (``gpu``) at the Ling-3.0-flash
dense decode shapes."""

from __future__ import annotations

import pytest
import torch

from baton.ops.fp8_linear import fp8_dense_linear, fp8_dense_linear_swiglu
from baton.ops.fp8_linear import naive as ref
from baton.ops.linear import naive as dense
from baton.ops.quant import dequantize_fp8_rows, quantize_fp8_block, quantize_fp8_parts, row_block_map
from tests.ops.triton_support import interpreted_module

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _triton():
    return interpreted_module("baton.ops.fp8_linear.triton")


def _weight(parts: list[int], k: int, seed: int, device="cpu"):
    gen = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(sum(parts), k, generator=gen, device=device) * k**-0.5
    q, s = quantize_fp8_parts(w, parts)
    rb = row_block_map(parts)
    return w, q, s, None if rb is None else torch.tensor(rb, dtype=torch.int32, device=device)


def _to(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


def test_parts_and_row_map():
    w, q, s, rb = _weight([200, 72, 40], 300, 0)
    assert s.shape == (2 + 1 + 1, 3) and rb is not None and rb[199] == 1 and rb[200] == 2 and rb[272] == 3
    qa, sa = quantize_fp8_block(w[200:272])  # each part quantised on its own
    assert torch.equal(q[200:272].view(torch.uint8), qa.view(torch.uint8)) and torch.equal(s[2:3], sa)
    deq = dequantize_fp8_rows(q, s, rb, torch.float32)
    assert ((deq - w).norm() / w.norm()).item() < 0.05
    assert row_block_map([256, 128, 5]) is None  # aligned parts: row // 128 already


@pytest.mark.parametrize("m", [1, 6, 17, 70, 257])
@pytest.mark.parametrize("variant", ["plain", "norm", "residual", "norm_residual"])
@pytest.mark.parametrize("parts", [[256, 72], [200, 72, 40]])
def test_kernel_matches_the_reference(m, variant, parts):
    """Ragged K (a partial last scale block), aligned and unaligned part boundaries; one row (the GEMV form), a
    verify's 6, a DSpark gamma-16 verify's 17 (tl.dot over 32 padded rows); 70, a short prefill, in launches of 32
    rows (the last of 6); 257 is past the chunked rows and takes the reference through the dispatch (CPU: always the
    reference)."""
    ft = _triton()
    k = 290
    _, q, s, rb = _weight(parts, k, m)
    gen = torch.Generator().manual_seed(100 + m)
    x = torch.randn(m, k, generator=gen)
    nw = torch.rand(k, generator=gen) + 0.5 if "norm" in variant else None
    res = torch.randn(m, sum(parts), generator=gen) if "residual" in variant else None
    want = ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6, res)
    plain = dense.linear(x, dequantize_fp8_rows(q, s, rb, torch.float32), nw, 1e-6, res)
    torch.testing.assert_close(want, plain)
    if m > ft.DENSE_CHUNKED_MAX_M:
        assert not ft.supports_dense(x, q, s, rb, nw, res)
        torch.testing.assert_close(fp8_dense_linear(x, q, s, rb, nw, 1e-6, res), want)
        return
    assert ft.supports_dense(x, q, s, rb, nw, res)
    got = ft.fp8_dense(*_to(x, q, s, rb, nw), 1e-6, *_to(res), pdl=False)
    assert got.dtype == torch.float32 and got.shape == (m, sum(parts))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("m", [1, 6, 17, 70, 257])
@pytest.mark.parametrize("inter,limit,norm", [(128, 0.0, True), (128, 7.0, False), (40, 5.0, True)])
def test_swiglu_kernel_matches_the_reference(m, inter, limit, norm):
    """gate|up rows: a block-aligned intermediate (scalar scales) and an unaligned one (the row map)."""
    ft = _triton()
    k = 200
    _, q, s, rb = _weight([inter, inter], k, m + inter)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen) * 3
    nw = torch.rand(k, generator=gen) + 0.5 if norm else None
    want = ref.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, limit)
    assert want.shape == (m, inter)
    if m > ft.DENSE_CHUNKED_MAX_M:
        torch.testing.assert_close(fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, limit), want)
        return
    got = ft.fp8_dense(*_to(x, q, s, rb, nw), 1e-6, None, True, limit, pdl=False)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tiles", [(8, 128, 4, 1), (16, 64, 4, 2), (64, 32, 4, 2)])
def test_tiles(tiles):
    ft = _triton()
    _, q, s, rb = _weight([256, 72], 300, 3)
    for m in (1, 3):
        if m > 1 and tiles[0] < 16:
            continue
        x = torch.randn(m, 300)
        got = ft.fp8_dense(*_to(x, q, s, rb), tiles=tiles, pdl=False)
        torch.testing.assert_close(got.cpu(), ref.fp8_dense_linear(x, q, s, rb), rtol=1e-4, atol=1e-4)


def test_bf16_rows_round_like_the_reference():
    """bf16 activations: the GEMM result rounded to bf16 before the residual add, as F.linear does; the kernel
    scales fp32 sums where the reference rounds the dequantised weight to bf16, so they agree to bf16's precision."""
    ft = _triton()
    _, q, s, rb = _weight([256, 128], 256, 5)
    x = torch.randn(4, 256).bfloat16()
    res = torch.randn(4, 384).bfloat16()
    nw = (torch.rand(256) + 0.5).bfloat16()
    got = ft.fp8_dense(*_to(x, q, s, rb, nw), 1e-6, *_to(res), pdl=False)
    want = ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6, res)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.cpu().float(), want.float(), rtol=2e-2, atol=2e-2)


def test_supports_dense():
    ft = _triton()
    _, q, s, _ = _weight([256, 72], 128, 0)
    x = torch.randn(1, 128)
    assert ft.supports_dense(x, q, s)
    assert not ft.supports_dense(x, q.float(), s)
    assert not ft.supports_dense(x, q, s[:1])
    _, q3, s3, rb = _weight([200, 72], 128, 0)
    assert ft.supports_dense(x, q3, s3, rb) and not ft.supports_dense(x, q3, s3, rb[:5])
    assert ft.supports_dense(torch.randn(ft.DENSE_MAX_M + 1, 128), q, s)  # in row chunks
    assert not ft.supports_dense(torch.randn(ft.DENSE_CHUNKED_MAX_M + 1, 128), q, s)
    _, q2, s2, _ = _weight([40, 40], 128, 0)
    assert not ft.supports_dense(x, q2, s2, None, swiglu=True)  # unaligned gate|up without the map


def test_cpu_dispatch_is_the_reference():
    _, q, s, rb = _weight([200, 72], 128, 1)
    x = torch.randn(2, 128)
    torch.testing.assert_close(fp8_dense_linear(x, q, s, rb), ref.fp8_dense_linear(x, q, s, rb))


# ---- on the GPU: the compiled kernel at Ling-3.0-flash's dense decode shapes (N parts, K) ----

def _ling_dense_names():
    from benchmarks.ops.bench_fp8_linear import LING_DENSE_SHAPES  # (row parts, K, fusion) at Ling-3.0-flash's shape

    return LING_DENSE_SHAPES


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(_ling_dense_names()))
@pytest.mark.parametrize("m", [1, 6, 17])
def test_gpu_ling_shapes(name, m):
    from baton.ops.fp8_linear import triton as ft

    parts, k, fusion = _ling_dense_names()[name]
    swiglu = fusion == "swiglu"
    _, q, s, rb = _weight(parts, k, m, "cuda")
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    nw = (torch.rand(k, device="cuda") + 0.5).bfloat16()
    if swiglu:
        got = ft.fp8_dense(x, q, s, rb, nw, 1e-6, None, True, 7.0)
        want = ref.fp8_dense_linear_swiglu(x.float(), q, s, rb, nw.float(), 1e-6, 7.0)
    else:
        res = torch.randn(m, sum(parts), device="cuda", dtype=torch.bfloat16)
        got = ft.fp8_dense(x, q, s, rb, nw, 1e-6, res)
        want = ref.fp8_dense_linear(x.float(), q, s, rb, nw.float(), 1e-6, res.float())
    err = ((got.float() - want).norm() / want.norm()).item()
    assert err < 1e-2, (name, m, err)
