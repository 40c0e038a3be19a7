"""w8a8 dense projections (``act_fp8=True``): fp8 (e4m3, 128 x 128 block) weights times activations quantised to e4m3
per (row, 128 columns) in the kernel's prologue, on fp8 x fp8 MMAs. The Triton kernel (``baton.ops.fp8_linear.triton
.fp8_dense(..., act_fp8=True)``; Triton's interpreter on CPU) against the plain-PyTorch reference of the same
arithmetic (``baton.ops.fp8_linear.naive``: ``baton.ops.quant.fp8.quantize_act_e4m3``, then the dequantised matmul in
fp32) at every Ling-3.0-flash fp8 dense shape of ``benchmarks/bench_decode_gemm.py`` (on CPU with each row part cut
to at most 128 rows, K unchanged; on the GPU (``gpu``) the whole shapes) at M = 1, 6, 17 with each shape's fusions
(RMSNorm prologue, residual / SwiGLU epilogues, the row map of unaligned fused parts), the configs a tune can pick,
the quantiser itself, and the error that fp8 activations add."""

from __future__ import annotations

import json

import pytest
import torch

from baton.ops.fp8_linear import fp8_dense_linear, fp8_dense_linear_swiglu
from baton.ops.fp8_linear import naive as ref
from baton.ops.quant import dequantize_fp8_rows, quantize_fp8_parts, row_block_map
from baton.ops.quant.fp8 import dequantize_act_e4m3, quantize_act_e4m3
from benchmarks.bench_decode_gemm import SHAPES
from tests.ops.triton_support import interpreted_module

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
LING_FP8 = {s.name: s for s in SHAPES if s.fp8}


def _ft():
    return interpreted_module("baton.ops.fp8_linear.triton")


def _lt():
    return interpreted_module("baton.ops.linear.triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _weight(parts: list[int], k: int, seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(parts), k, generator=gen) * k**-0.5 * scale
    q, s = quantize_fp8_parts(w, parts)
    rb = row_block_map(parts)
    rb = None if rb is None else torch.tensor(rb, dtype=torch.int32)
    return w, q.to(DEV), s.to(DEV), None if rb is None else rb.to(DEV)


def _case(shape, m: int, parts: list[int], dtype: torch.dtype, seed: int):
    """(x, norm weight, residual) for ``shape``'s fusions; x with a spread of row and group magnitudes."""
    gen = torch.Generator().manual_seed(seed)
    k = shape.k
    x = torch.randn(m, k, generator=gen) * 2 + 0.1
    x = x * torch.logspace(-2, 2, m)[:, None]  # rows far apart in size: each row its own scales
    x[:, : min(k, 128)] *= 30  # one group much larger than the rest
    nw = (torch.rand(k, generator=gen) + 0.5) if shape.norm else None
    n_out = sum(parts) // 2 if shape.swiglu else sum(parts)
    res = torch.randn(m, n_out, generator=gen) if shape.residual else None
    return [None if t is None else t.to(dtype).to(DEV) for t in (x, nw, res)]


def _run_both(ft, shape, m, parts, dtype, seed, config=None):
    _, q, s, rb = _weight(parts, shape.k, seed, 4.0 if shape.swiglu else 1.0)
    x, nw, res = _case(shape, m, parts, dtype, seed + 1)
    if shape.swiglu:
        got = ft.fp8_dense(x, q, s, rb, nw, 1e-6, None, True, shape.limit, pdl=False, config=config, act_fp8=True)
        f = lambda t: None if t is None else t.float()  # noqa: E731
        want = ref.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, shape.limit, act_fp8=True)
        want32 = ref.fp8_dense_linear_swiglu(f(x), q, s, rb, f(nw), 1e-6, shape.limit, act_fp8=True)
    else:
        got = ft.fp8_dense(x, q, s, rb, nw, 1e-6, res, pdl=False, config=config, act_fp8=True)
        f = lambda t: None if t is None else t.float()  # noqa: E731
        want = ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6, res, act_fp8=True)
        want32 = ref.fp8_dense_linear(f(x), q, s, rb, f(nw), 1e-6, f(res), act_fp8=True)
    return got, want, want32


def _cpu_parts(shape) -> list[int]:
    return [min(p, 128) for p in shape.parts]


# ---- the quantiser and the reference ----

def test_quantize_act_e4m3():
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(5, 300, generator=gen) * torch.tensor([1e-4, 1.0, 30.0, 1e3, 1.0])[:, None]
    h[4, 128:256] = 0.0  # an all-zero group
    q, sc = quantize_act_e4m3(h)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (5, 300) and sc.shape == (5, 3)
    g = torch.zeros(5, 384)
    g[:, :300] = h
    amax = g.view(5, 3, 128).abs().amax(-1)
    nz = amax > 0
    assert torch.equal(torch.log2(sc), torch.log2(sc).round())  # power-of-two scales: h * 2^-s is exact
    ratio = amax[nz] / sc[nz]
    assert (ratio <= 448).all() and (ratio > 224).all()  # the smallest power of two that fits the group in e4m3
    assert (q[4, 128:256].float() == 0).all()
    deq = dequantize_act_e4m3(q, sc)
    assert deq.shape == h.shape and torch.isfinite(deq).all()
    rel = (deq - h).norm(dim=1) / h.norm(dim=1)
    assert (rel < 0.04).all() and (rel > 0.005).all(), rel  # e4m3's 3 mantissa bits, whatever the row's size


def test_exact_activations_give_the_w8a16_result():
    """Rows whose groups are e4m3 values with amax 448 x 2^j quantise exactly (scale 2^j): w8a8 == the fp32 matmul
    of the dequantised weight, so a wrong scale (a group off by one, weight and activation scales swapped, a missing
    factor) cannot hide behind quantisation noise."""
    gen = torch.Generator().manual_seed(1)
    m, k = 4, 384
    vals = torch.randn(m, k, generator=gen).mul(40).clamp(-440, 440).to(torch.float8_e4m3fn).float()
    vals.view(m, 3, 128)[:, :, 0] = 448.0
    h = vals * torch.tensor([2.0**-8, 2.0**-3, 1.0, 2.0**5])[:, None]
    q, sc = quantize_act_e4m3(h)
    torch.testing.assert_close(dequantize_act_e4m3(q, sc), h, rtol=0, atol=0)
    _, wq, ws, rb = _weight([200, 72], k, 2)
    wq, ws = wq.cpu(), ws.cpu()
    rb = None if rb is None else rb.cpu()
    want = h @ dequantize_fp8_rows(wq, ws, rb, torch.float32).t()
    torch.testing.assert_close(ref.fp8_dense_linear(h, wq, ws, rb, act_fp8=True), want, rtol=1e-6, atol=1e-6)
    ft = _ft()
    got = ft.fp8_dense(h.to(DEV), wq.to(DEV), ws.to(DEV), None if rb is None else rb.to(DEV), pdl=False,
                       act_fp8=True)
    assert rel_err(got.cpu(), want) < (1e-6 if DEV == "cpu" else 1e-5)


@pytest.mark.parametrize("name", list(LING_FP8))
def test_fp8_activations_error_is_bounded(name):
    """The w8a8 reference against the fp32 matmul without activation quantisation (same fp8 weight): the error of
    rounding activations to e4m3 (3 mantissa bits, relative rounding error ~2.5% per element), bounded both ways."""
    shape = LING_FP8[name]
    parts = _cpu_parts(shape)
    _, q, s, rb = _weight(parts, shape.k, 3)
    q, s = q.cpu(), s.cpu()
    rb = None if rb is None else rb.cpu()
    x, nw, res = (None if t is None else t.cpu() for t in _case(shape, 6, parts, torch.float32, 4))
    if shape.swiglu:
        a8 = ref.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, 0.0, act_fp8=True)
        a16 = ref.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, 0.0)
    else:  # no residual: it would dilute the GEMM's error
        a8 = ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6, act_fp8=True)
        a16 = ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6)
    err = rel_err(a8, a16)
    hi = 0.05 if shape.swiglu else 0.04  # the gate and up errors compound through SwiGLU's product
    assert 0.005 < err < hi, (name, err)


# ---- the kernel against the reference ----

@pytest.mark.parametrize("name", list(LING_FP8))
@pytest.mark.parametrize("m", [1, 6, 17])
def test_kernel_matches_the_reference_at_ling_shapes(name, m):
    """Each Ling fp8 dense shape's K, fusions and part structure (parts cut to <= 128 rows on CPU: the interpreter
    takes ~100 s for the whole kda_in_proj), the dispatch's config (the table's or the w8a8 bucket rule)."""
    ft = _ft()
    shape = LING_FP8[name]
    parts = _cpu_parts(shape) if DEV == "cpu" else list(shape.parts)
    got, want, _ = _run_both(ft, shape, m, parts, torch.float32, 10 * m)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert rel_err(got.cpu(), want.cpu()) < (1e-5 if DEV == "cpu" else 2e-3), (name, m)


CONFIGS = [  # (block_n, block_k, split_k, num_warps, num_stages): swap-form configs a tune can pick
    (16, 128, 1, 4, 1), (32, 128, 3, 4, 3), (64, 128, 2, 4, 4), (128, 128, 1, 8, 2), (64, 128, 5, 4, 1),
]


@pytest.mark.parametrize("tiles", CONFIGS)
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("fusion", ["plain", "norm_residual", "swiglu", "rowmap_norm"])
def test_configs_and_fusions(tiles, m, fusion):
    """Ragged K (a short last group and scale block), splits that leave empty chunks, per-row scales (BLOCK_N 16 /
    32 / 64 inside a 128-row block; the row map), bf16 rows."""
    ft = _ft()
    lt = _lt()
    cfg = lt.LinearConfig(*tiles, dot=True, swap=True)
    k = 650
    parts = {"plain": [256, 72], "norm_residual": [160], "swiglu": [128, 128], "rowmap_norm": [200, 72, 40]}[fusion]
    shape = type(LING_FP8["o_proj"])(fusion, tuple(parts), k, norm="norm" in fusion,
                                     residual="residual" in fusion, swiglu=fusion == "swiglu", limit=5.0)
    got, want, _ = _run_both(ft, shape, m, parts, torch.bfloat16, m + tiles[0], config=cfg)
    assert got.dtype == torch.bfloat16
    err = rel_err(got.float().cpu(), want.float().cpu())
    assert err < 4e-3, err  # the same q and scales; bf16 output rounding and the summation order differ


def test_dispatch_takes_the_keyword():
    """``fp8_dense_linear(..., act_fp8=True)`` is the w8a8 arithmetic on every path (CPU: the reference), and the
    default stays w8a16."""
    _, q, s, rb = _weight([200, 72], 256, 5)
    x = torch.randn(3, 256).to(DEV)
    a8 = fp8_dense_linear(x, q, s, rb, act_fp8=True)
    a16 = fp8_dense_linear(x, q, s, rb)
    torch.testing.assert_close(a8.cpu(), ref.fp8_dense_linear(x, q, s, rb, act_fp8=True).cpu(), rtol=1e-4,
                               atol=1e-4)
    torch.testing.assert_close(a16.cpu(), ref.fp8_dense_linear(x, q, s, rb).cpu(), rtol=1e-4, atol=1e-4)
    assert rel_err(a8.cpu(), a16.cpu()) > 1e-3  # they are different arithmetic
    _, q2, s2, _ = _weight([128, 128], 256, 6)
    sw = fp8_dense_linear_swiglu(x, q2, s2, None, None, 1e-6, 3.0, act_fp8=True)
    torch.testing.assert_close(sw.cpu(), ref.fp8_dense_linear_swiglu(x, q2, s2, None, None, 1e-6, 3.0,
                                                                     act_fp8=True).cpu(), rtol=1e-4, atol=1e-4)


def test_w8a8_table_entries(tmp_path, monkeypatch):
    """w8a8 entries (``"act": "fp8"``, kinds m1 / m4..m32) live in the fp8 table beside the w8a16 ones and are read
    apart from them; a w8a8 lookup never takes a w8a16 entry."""
    lt = _lt()
    fp8_dir = tmp_path / "fp8"
    fp8_dir.mkdir()
    monkeypatch.setattr(lt, "TUNED_FP8_DIR", fp8_dir)
    lt._device_table.cache_clear()
    a8 = lt.LinearConfig(128, 128, 2, 4, 3, dot=True, swap=True)
    a16 = lt.LinearConfig(64, 128, 1, 4, 4, dot=True, swap=True, f16=True)
    entries = [{"kind": "m8", "n_out": 2560, "k": 4096, "swiglu": False, "config": a16.__dict__},
               {"kind": "m8", "n_out": 2560, "k": 4096, "swiglu": False, "act": "fp8", "config": a8.__dict__},
               {"kind": "m1", "n_out": 2560, "k": 4096, "swiglu": False, "act": "fp8", "config": a8.__dict__}]
    (fp8_dir / "fake-gpu-9003.json").write_text(json.dumps({"entries": entries}))
    monkeypatch.setattr(lt, "_current_device_name", lambda: "Fake GPU 9003")
    try:
        assert lt.pick_config(6, 2560, 4096, fp8=True) == a16
        assert lt.pick_config(6, 2560, 4096, fp8=True, act_fp8=True) == a8
        assert lt.pick_config(1, 2560, 4096, fp8=True, act_fp8=True) == a8
        assert lt.pick_config(17, 2560, 4096, fp8=True, act_fp8=True) == lt._act8_heuristic(17, 2560, 4096, False)
        assert set(lt.read_table(fp8_dir / "fake-gpu-9003.json")) == {("m8", 2560, 4096, False)}
        assert len(lt.read_table(fp8_dir / "fake-gpu-9003.json", act_fp8=True)) == 2
    finally:
        lt._device_table.cache_clear()


def test_committed_w8a8_entries_are_valid():
    lt = _lt()
    for path in sorted(lt.TUNED_FP8_DIR.glob("*.json")):
        for (kind, _, _, _), c in lt.read_table(path, act_fp8=True).items():
            assert kind in ("m1", "m4", "m8", "m16", "m32"), (path, kind)
            assert c.dot and c.swap and c.block_k == 128 and not c.cublas and c.block_n >= 16, (path, kind, c)


# ---- on the GPU: the compiled kernel at every whole Ling shape, bf16 rows as in the model ----

@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", list(LING_FP8))
@pytest.mark.parametrize("m", [1, 2, 6, 12, 17])
def test_gpu_ling_shapes_bf16(name, m):
    """Compiled (fp8 x fp8 wgmma / mma), through the production table, bf16 activations as in the model: against the
    reference of the same arithmetic on the same bf16 inputs (the same e4m3 rows: only the summation order, the
    MMA's accumulation and bf16 output rounding differ), and within fp8 activations' error of the fp32 product
    without activation quantisation. (Not against the w8a8 reference on fp32 inputs: rounding the normalised rows
    to bf16 first moves ~3% of the elements across an e4m3 rounding boundary, ~1.5% of error on its own.)"""
    from baton.ops.fp8_linear import triton as ft

    shape = LING_FP8[name]
    parts = list(shape.parts)
    got, want, _ = _run_both(ft, shape, m, parts, torch.bfloat16, 100 + m)
    err = rel_err(got.float(), want.float())
    assert err < 5e-3, (name, m, err)
    _, q, s, rb = _weight(parts, shape.k, 100 + m, 4.0 if shape.swiglu else 1.0)
    x, nw, res = (None if t is None else t.float() for t in _case(shape, m, parts, torch.bfloat16, 101 + m))
    if shape.swiglu:
        exact = ref.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, shape.limit)
    else:
        exact = ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6, None if res is None else res)
    err_ref = rel_err(want.float(), exact)  # what the arithmetic itself gives on these inputs
    assert rel_err(got.float(), exact) < max(5e-2, 1.05 * err_ref + 2e-3), (name, m, err_ref)
    if not shape.swiglu:
        assert err_ref < 5e-2, (name, m, err_ref)  # bench inputs: 2.3-2.6e-2; SwiGLU (no norm, rows up to 100x,
        # the clamp saturating) amplifies it to 0.15-0.24 here for the reference and the kernel alike


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
def test_gpu_in_a_graph_with_pdl():
    """Back-to-back w8a8 launches with PDL inside a captured CUDA graph give the eager results."""
    from baton.ops.fp8_linear import triton as ft

    shape = LING_FP8["o_proj"]
    _, q, s, rb = _weight(list(shape.parts), shape.k, 7)
    x = torch.randn(6, shape.k, device="cuda", dtype=torch.bfloat16)
    res = torch.randn(6, shape.n, device="cuda", dtype=torch.bfloat16)
    eager = ft.fp8_dense(x, q, s, None, None, 1e-6, res, act_fp8=True)
    eager2 = ft.fp8_dense(eager, q, s, None, None, 1e-6, res, act_fp8=True)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = ft.fp8_dense(x, q, s, None, None, 1e-6, res, act_fp8=True)
        y2 = ft.fp8_dense(y, q, s, None, None, 1e-6, res, act_fp8=True)
    g.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(y, eager, rtol=0, atol=0)
    torch.testing.assert_close(y2, eager2, rtol=0, atol=0)
