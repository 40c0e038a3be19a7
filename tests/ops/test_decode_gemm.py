"""The decode-shape GEMM forms of ``baton.ops.linear.triton.linear_kernel`` (issue 22, item 2) against the plain
PyTorch references: the swap-AB ``tl.dot`` form (M = 2..32, split-K), fp8 weights through it (scalar and per-row
block scales, the fp16 MMA with its per-row power-of-two activation scaling), the fp8 GEMV with chunks wider than a
scale block, the per-GPU tables (the fp8 one, the m32 bucket, ``cublas`` entries), and split-K's fixed reduction
order. On CPU the kernels run in Triton's interpreter on small odd shapes; the ``gpu`` tests run the compiled
kernels at every Ling-3.0-flash dense shape through the production dispatch."""

from __future__ import annotations

import json

import pytest
import torch

from baton.ops.fp8_linear import naive as fp8_ref
from baton.ops.linear import naive
from baton.ops.quant import quantize_fp8_parts, row_block_map
from tests.ops.triton_support import interpreted_module

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"


def _lt():
    return interpreted_module("baton.ops.linear.triton")


def _ft():
    return interpreted_module("baton.ops.fp8_linear.triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _inputs(m: int, n_out: int, k: int, dtype: torch.dtype, seed: int, scale: float = 2.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * scale + 0.1).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    res = torch.randn(m, n_out, generator=gen).to(dtype)
    return x.to(DEV), nw.to(DEV), res.to(DEV)


def _fp8_weight(parts: list[int], k: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(parts), k, generator=gen) * k**-0.5
    q, s = quantize_fp8_parts(w, parts)
    rb = row_block_map(parts)
    rb = None if rb is None else torch.tensor(rb, dtype=torch.int32)
    return q.to(DEV), s.to(DEV), None if rb is None else rb.to(DEV)


def _cfg(*args, **kw):
    return _lt().LinearConfig(*args, **kw)


# ---- bf16 / fp32 weights: the swap form ----

SWAP = [(16, 32, 1, 4, 2), (32, 64, 3, 4, 3), (16, 16, 5, 4, 2), (16, 32, 3, 4, 1)]  # the last: look-ahead


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [2, 6, 17])
@pytest.mark.parametrize("tiles", SWAP)
@pytest.mark.parametrize("fusion", ["plain", "norm_residual", "swiglu"])
def test_swap_form_matches_the_reference(dtype, m, tiles, fusion):
    lt = _lt()
    cfg = _cfg(*tiles, dot=True, swap=True)
    k = 200
    n_out = 21 if fusion == "swiglu" else 37
    x, nw, res = _inputs(m, n_out, k, dtype, m * 7 + tiles[0])
    gen = torch.Generator().manual_seed(m)
    if fusion == "swiglu":
        w = (torch.randn(2 * n_out, k, generator=gen) * k**-0.5 * 4).to(dtype).to(DEV)
        got = lt.linear_swiglu_fwd(x, w, nw, 1e-6, 0.75, config=cfg, use_pdl=False)
        want = naive.linear_swiglu(x, w, nw, 1e-6, 0.75)
    else:
        w = (torch.randn(n_out, k, generator=gen) * k**-0.5).to(dtype).to(DEV)
        args = (nw, 1e-6, res) if fusion == "norm_residual" else (None, 1e-6, None)
        got = lt.linear_fwd(x, w, *args, config=cfg, use_pdl=False)
        want = naive.linear(x, w, *args)
    assert got.shape == want.shape and got.dtype == want.dtype and not got.isnan().any()
    assert rel_err(got, want) < (1e-4 if dtype == torch.float32 else 1e-2)


def test_split_k_is_deterministic():
    """The last-arriving split sums the partials in split order: the same bits on every call."""
    lt = _lt()
    x, nw, res = _inputs(6, 45, 300, torch.float32, 3)
    w = torch.randn(45, 300, generator=torch.Generator().manual_seed(1)).to(DEV) / 17
    for cfg in (_cfg(16, 32, 5, 4, 2, dot=True, swap=True), _cfg(4, 64, 3, dot=False), _cfg(16, 32, 4)):
        outs = [lt.linear_fwd(x, w, nw, 1e-6, res, config=cfg, use_pdl=False) for _ in range(3)]
        assert all(torch.equal(outs[0], o) for o in outs[1:])
        assert rel_err(outs[0], naive.linear(x, w, nw, 1e-6, res)) < 1e-4
    assert int(lt._split_counters(x.device).abs().sum()) == 0


# ---- fp8 weights ----

FP8_CONFIGS = [
    ("gemv-kvec", dict(block_n=8, block_k=256, split_k=2, dot=False)),  # a chunk spans two scale columns
    ("gemv-split", dict(block_n=4, block_k=64, split_k=3, dot=False)),
    ("gemv-bits", dict(block_n=8, block_k=256, split_k=2, dot=False, bits=True)),  # M > 1: the rows form
    ("swap-bf16", dict(block_n=16, block_k=64, split_k=2, num_stages=2, dot=True, swap=True)),
    ("swap-f16", dict(block_n=32, block_k=128, split_k=2, num_stages=3, dot=True, swap=True, f16=True)),
    ("swap-lookahead-f16", dict(block_n=16, block_k=64, split_k=2, num_stages=1, dot=True, swap=True, f16=True)),
    ("swap-f16-rowvec", dict(block_n=256, block_k=32, split_k=1, num_stages=2, dot=True, swap=True, f16=True)),
    # the block scales folded into the rows: pipelined, split (a split inside a scale column), look-ahead; with a
    # per-row scale tile (rowvec: fold does not apply) the kernel takes the plain f16 form
    ("swap-f16-fold", dict(block_n=32, block_k=128, split_k=2, num_stages=3, dot=True, swap=True, f16=True,
                           fold=True)),
    ("swap-f16-fold-k64", dict(block_n=64, block_k=64, split_k=3, num_stages=2, dot=True, swap=True, f16=True,
                               fold=True)),
    ("swap-lookahead-f16-fold", dict(block_n=16, block_k=64, split_k=2, num_stages=1, dot=True, swap=True, f16=True,
                                     fold=True)),
    ("swap-f16-rowvec-fold", dict(block_n=256, block_k=32, split_k=1, num_stages=2, dot=True, swap=True, f16=True,
                                  fold=True)),
    # the rows' prologue in a kernel of its own (rows_f16_kernel), the GEMM on its fp16 rows
    ("swap-pre", dict(block_n=32, block_k=128, split_k=2, num_stages=3, dot=True, swap=True, pre=True)),
    ("swap-lookahead-pre", dict(block_n=16, block_k=64, split_k=2, num_stages=1, dot=True, swap=True, pre=True)),
    ("swap-pre-rowvec", dict(block_n=256, block_k=32, split_k=1, num_stages=2, dot=True, swap=True, pre=True)),
    ("dot", dict(block_n=16, block_k=64, split_k=3, dot=True)),
]


@pytest.mark.parametrize("name,cfg", FP8_CONFIGS, ids=[c[0] for c in FP8_CONFIGS])
@pytest.mark.parametrize("m", [1, 4, 17])
@pytest.mark.parametrize("parts", [[256, 72], [200, 72, 40]])
@pytest.mark.parametrize("fusion", ["norm_residual", "swiglu"])
def test_fp8_forms_match_the_reference(name, cfg, m, parts, fusion):
    """Aligned parts (scalar scales per tile) and unaligned ones (the row map); bf16 rows, so the tolerance is
    bf16's (the kernel scales fp32 sums where the reference rounds the dequantised weight to bf16)."""
    ft = _ft()  # M == 1 takes the GEMV form whatever the config's form
    k = 300
    swiglu = fusion == "swiglu"
    if swiglu:
        parts = [128, 128] if len(parts) == 2 else [40, 40]
    q, s, rb = _fp8_weight(parts, k, m + len(parts))
    n_out = sum(parts) // 2 if swiglu else sum(parts)
    x, nw, res = _inputs(m, n_out, k, torch.bfloat16, m)
    config = _cfg(**cfg)
    if swiglu:
        got = ft.fp8_dense(x, q, s, rb, nw, 1e-6, None, True, 5.0, pdl=False, config=config)
        want = fp8_ref.fp8_dense_linear_swiglu(x.float(), q, s, rb, nw.float(), 1e-6, 5.0)
    else:
        got = ft.fp8_dense(x, q, s, rb, nw, 1e-6, res, pdl=False, config=config)
        want = fp8_ref.fp8_dense_linear(x.float(), q, s, rb, nw.float(), 1e-6, res.float())
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and not got.isnan().any()
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("scale", [1e-6, 3e4, 3e6])
def test_fp8_f16_mma_keeps_activations_beyond_fp16s_range(scale):
    """The fp16 MMA scales each row's chunk by a power of two first: rows far outside fp16's range (3e6, and tiny
    ones) come out as exactly as bf16 rows through the bf16 MMA."""
    ft = _ft()
    q, s, rb = _fp8_weight([256, 72], 256, 9)
    x, _, _ = _inputs(6, 328, 256, torch.bfloat16, 5, scale=scale)
    want = fp8_ref.fp8_dense_linear(x.float(), q, s, rb)
    for f16, fold, pre in ((False, False, False), (True, False, False), (True, True, False), (False, False, True)):
        cfg = _cfg(32, 64, 2, 4, 2, dot=True, swap=True, f16=f16, fold=fold, pre=pre)
        got = ft.fp8_dense(x, q, s, rb, pdl=False, config=cfg)
        assert torch.isfinite(got.float()).all()
        assert rel_err(got, want) < 1e-2, (f16, fold, pre, scale)


@pytest.mark.parametrize("m", [2, 6, 17])
@pytest.mark.parametrize("fusion", ["norm_residual", "swiglu"])
def test_fp8_pre_rows_match_the_bf16_mma(m, fusion):
    """``pre``: the prologue once in rows_f16_kernel, then the GEMM on exact fp16 copies of its rows: the same
    products as the bf16 MMA form, so the two agree to the accumulation order (a few bf16 output ulps at most), and
    both sit within bf16's error of the fp32 reference."""
    ft = _ft()
    k = 300
    parts = [128, 128] if fusion == "swiglu" else [256, 72]
    q, s, rb = _fp8_weight(parts, k, m + 3)
    n_out = sum(parts) // 2 if fusion == "swiglu" else sum(parts)
    x, nw, res = _inputs(m, n_out, k, torch.bfloat16, m + 11, scale=40.0)
    outs = {}
    for pre in (False, True):
        cfg = _cfg(32, 128, 2, 4, 2, dot=True, swap=True, pre=pre)
        if fusion == "swiglu":
            outs[pre] = ft.fp8_dense(x, q, s, rb, nw, 1e-6, None, True, 5.0, pdl=False, config=cfg)
        else:
            outs[pre] = ft.fp8_dense(x, q, s, rb, nw, 1e-6, res, pdl=False, config=cfg)
    if fusion == "swiglu":
        want = fp8_ref.fp8_dense_linear_swiglu(x.float(), q, s, rb, nw.float(), 1e-6, 5.0)
    else:
        want = fp8_ref.fp8_dense_linear(x.float(), q, s, rb, nw.float(), 1e-6, res.float())
    assert rel_err(outs[True], outs[False]) < 2e-3
    assert rel_err(outs[True], want) < 1e-2


@pytest.mark.parametrize("m", [2, 6, 17])
def test_fp8_fold_is_as_accurate_as_the_f16_mma(m):
    """Folding the block scales into the rows rounds each row x scale to fp16 once (11 bits): its error against
    the fp32 reference stays within the unfolded fp16 MMA's (which rounds only the output to bf16) plus a bit, with
    scales that vary by 2^10 between chunks and a row 2^12 larger than the others."""
    ft = _ft()
    k = 512
    gen = torch.Generator().manual_seed(m)
    w = torch.randn(128, k, generator=gen) * k**-0.5
    w = w * 2.0 ** torch.arange(-5, 5).repeat_interleave(k // 8)[:k].float()[None, :]  # 2^-5 .. 2^2 by column
    q, s = quantize_fp8_parts(w, [128])
    x = torch.randn(m, k, generator=gen)
    x[0] *= 4096
    x = x.to(torch.bfloat16)
    nw = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16)
    q, s, x, nw = q.to(DEV), s.to(DEV), x.to(DEV), nw.to(DEV)
    want = fp8_ref.fp8_dense_linear(x.float(), q, s, None, nw.float(), 1e-6)
    errs, outs = {}, {}
    for fold in (False, True):
        cfg = _cfg(32, 128, 1, 4, 2, dot=True, swap=True, f16=True, fold=fold)
        outs[fold] = ft.fp8_dense(x, q, s, None, nw, 1e-6, pdl=False, config=cfg)
        errs[fold] = rel_err(outs[fold], want)
    assert not torch.equal(outs[False], outs[True])  # the folded form ran (its roundings differ)
    assert errs[True] < 1e-2 and errs[True] < errs[False] * 1.5 + 1e-4, errs


def test_fp8_fp32_rows_are_exact():
    """fp32 activations never take the fp16 MMA (the flag is ignored): fp32 accuracy in every form."""
    ft = _ft()
    q, s, rb = _fp8_weight([200, 72, 40], 290, 2)
    x = torch.randn(5, 290, generator=torch.Generator().manual_seed(4)).to(DEV)
    want = fp8_ref.fp8_dense_linear(x, q, s, rb)
    for _, cfg in FP8_CONFIGS:
        got = ft.fp8_dense(x, q, s, rb, pdl=False, config=_cfg(**cfg))
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


# ---- tables ----

def test_fp8_table_cublas_entries_and_the_m32_bucket(tmp_path, monkeypatch):
    lt = _lt()
    ft = _ft()
    bf16_dir, fp8_dir = tmp_path / "bf16", tmp_path / "fp8"
    bf16_dir.mkdir()
    fp8_dir.mkdir()
    monkeypatch.setattr(lt, "TUNED_DIR", bf16_dir)
    monkeypatch.setattr(lt, "TUNED_FP8_DIR", fp8_dir)
    lt._device_table.cache_clear()
    swap = _cfg(64, 128, 4, 4, 4, dot=True, swap=True, f16=True)
    entries = [{"kind": "m32", "n_out": 2560, "k": 4096, "swiglu": False, "config": swap.__dict__},
               {"kind": "gemv", "n_out": 2560, "k": 4096, "swiglu": False, "config": _cfg(8, 512).__dict__}]
    (fp8_dir / "fake-gpu-9002.json").write_text(json.dumps({"entries": entries}))
    cublas = {"kind": "m8", "n_out": 512, "k": 64, "swiglu": False, "config": _cfg(64, 128, cublas=True).__dict__}
    (bf16_dir / "fake-gpu-9002.json").write_text(json.dumps({"entries": [cublas]}))
    monkeypatch.setattr(lt, "_current_device_name", lambda: "Fake GPU 9002")
    try:
        assert lt.table_kinds(17) == ("m32", "dot") and lt.table_kinds(32) == ("m32", "dot")
        assert lt.pick_config(17, 2560, 4096, fp8=True) == swap
        assert lt.pick_config(1, 2560, 4096, fp8=True) == _cfg(8, 512)
        assert lt.pick_config(17, 2560, 4096) == lt._heuristic_config(17, 2560, 4096, False)  # not the bf16 table
        assert ft.pick_dense_config(17, 2560, 4096) == swap
        assert ft.pick_dense_tiles(17, 2560, False, 4096) == (64, 128, 4, 4)
        x = torch.randn(6, 64, dtype=torch.bfloat16)
        w = torch.randn(512, 64, dtype=torch.bfloat16)
        assert not lt.supports(x, w)  # the table says cuBLAS for M = 5..8
        assert lt.supports(x[:4], w) and lt.supports(x[:1], w)
    finally:
        lt._device_table.cache_clear()


def test_committed_tables_are_valid():
    """Every entry of the committed per-GPU tables is a config the kernel takes."""
    lt = _lt()
    for directory, fp8 in ((lt.TUNED_DIR, False), (lt.TUNED_FP8_DIR, True)):
        for path in sorted(directory.glob("*.json")):
            for (kind, n_out, k, _), c in lt.read_table(path).items():
                assert kind in ("gemv", "dot", "m4", "m8", "m16", "m32"), path
                assert c.block_n & (c.block_n - 1) == 0 and c.block_k & (c.block_k - 1) == 0, (path, kind, n_out, k)
                if kind != "gemv" and c.dot and not c.cublas:
                    assert c.block_n >= 16 and c.block_k >= 16, (path, kind, n_out, k)
                assert c.split_k >= 1 and c.num_stages >= 1 and c.prefetch % 16 == 0
                assert not (c.cublas and fp8), "fp8 weights have no cuBLAS path to choose"


# ---- on the GPU: every Ling-3.0-flash dense shape through the production dispatch ----

LING = {  # name: (row parts, K, norm, residual, swiglu, limit, fp8)
    "kda_in_proj": ((4096,) * 5 + (32,), 2560, True, False, False, 0.0, True),
    "o_proj": ((2560,), 4096, False, True, False, 0.0, True),
    "mla_in_proj": ((6144, 576, 32), 2560, True, False, False, 0.0, True),
    "mla_kv_b": ((8192,), 512, False, False, False, 0.0, False),
    "shared_gate_up": ((768, 768), 2560, False, False, True, 7.0, True),
    "shared_down": ((2560,), 768, False, False, False, 0.0, True),
    "dense_gate_up": ((6144, 6144), 2560, True, False, True, 0.0, True),
    "dense_down": ((2560,), 6144, False, True, False, 0.0, True),
    "eh_proj": ((2560,), 5120, False, False, False, 0.0, True),
    "router": ((512,), 2560, False, False, False, 0.0, False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("name", list(LING))
@pytest.mark.parametrize("m", [1, 2, 6, 12, 17])
@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_gpu_ling_shapes_through_the_dispatch(name, m, dtype):
    from baton.ops import fp8_linear, linear

    parts, k, norm, residual, swiglu, limit, has_fp8 = LING[name]
    if dtype == "fp8" and not has_fp8:
        pytest.skip("bf16 in the model")
    n = sum(parts)
    n_out = n // 2 if swiglu else n
    gen = torch.Generator(device="cuda").manual_seed(n + m)
    w = torch.randn(n, k, generator=gen, device="cuda") * k**-0.5 * (4 if swiglu else 1)
    x = (torch.randn(m, k, generator=gen, device="cuda") * 2).bfloat16()
    nw = (torch.rand(k, generator=gen, device="cuda") + 0.5).bfloat16() if norm else None
    res = torch.randn(m, n_out, generator=gen, device="cuda").bfloat16() if residual else None
    f = None if nw is None else nw.float()
    r = None if res is None else res.float()
    if dtype == "fp8":
        q, s = quantize_fp8_parts(w, list(parts))
        rbl = row_block_map(list(parts))
        rb = None if rbl is None else torch.tensor(rbl, dtype=torch.int32, device="cuda")
        if swiglu:
            got = fp8_linear.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, limit)
            want = fp8_ref.fp8_dense_linear_swiglu(x.float(), q, s, rb, f, 1e-6, limit)
        else:
            got = fp8_linear.fp8_dense_linear(x, q, s, rb, nw, 1e-6, res)
            want = fp8_ref.fp8_dense_linear(x.float(), q, s, rb, f, 1e-6, r)
    else:
        wb = w.bfloat16()
        if swiglu:
            got = linear.linear_swiglu(x, wb, nw, 1e-6, limit)
            want = naive.linear_swiglu(x.float(), wb.float(), f, 1e-6, limit)
        else:
            got = linear.linear(x, wb, nw, 1e-6, res)
            want = naive.linear(x.float(), wb.float(), f, 1e-6, r)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    assert rel_err(got, want) < 1e-2, (name, m, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_graph_pdl_prefetch_chain(fp8):
    """A chain of dependent swap-form / GEMV launches with PDL and the L2 prefetch, captured in a CUDA graph and
    replayed on new inputs, equals the reference each time (the waits order each kernel after its producer)."""
    from baton.ops.fp8_linear import triton as ft
    from baton.ops.linear import triton as lt

    d, inter = 2560, 768
    gen = torch.Generator(device="cuda").manual_seed(3)
    w_up = torch.randn(2 * inter, d, generator=gen, device="cuda") * d**-0.5 * 4
    w_down = torch.randn(d, inter, generator=gen, device="cuda") * inter**-0.5
    nw = (torch.rand(d, generator=gen, device="cuda") + 0.5).bfloat16()
    up_cfg = lt.LinearConfig(64, 128, 4, 4, 4, dot=True, swap=True, f16=fp8, prefetch=1024)
    down_cfg = lt.LinearConfig(64, 128, 3, 4, 4, dot=True, swap=True, f16=fp8, prefetch=512)
    gemv_cfg = lt.LinearConfig(8, 128 if fp8 else 512, 2, prefetch=2048)
    if fp8:
        qu, su = quantize_fp8_parts(w_up, [inter, inter])
        qd, sd = quantize_fp8_parts(w_down, [d])

        def step(x, cfg_up, cfg_down):
            h = ft.fp8_dense(x, qu, su, None, nw, 1e-6, None, True, 7.0, config=cfg_up)
            return ft.fp8_dense(h, qd, sd, None, None, 1e-6, x, config=cfg_down)

        def ref(x):
            h = fp8_ref.fp8_dense_linear_swiglu(x, qu, su, None, nw, 1e-6, 7.0)
            return fp8_ref.fp8_dense_linear(h, qd, sd, None, None, 1e-6, x)
    else:
        wu, wd = w_up.bfloat16(), w_down.bfloat16()

        def step(x, cfg_up, cfg_down):
            h = lt.linear_swiglu_fwd(x, wu, nw, 1e-6, 7.0, config=cfg_up)
            return lt.linear_fwd(h, wd, residual=x, config=cfg_down)

        def ref(x):
            return naive.linear(naive.linear_swiglu(x, wu, nw, 1e-6, 7.0), wd, residual=x)

    for m, cfg_up, cfg_down in ((6, up_cfg, down_cfg), (1, gemv_cfg, gemv_cfg), (17, up_cfg, down_cfg)):
        static_x = torch.randn(m, d, generator=gen, device="cuda").bfloat16()
        step(static_x, cfg_up, cfg_down)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = step(static_x, cfg_up, cfg_down)
        for _ in range(3):
            static_x.copy_(torch.randn(m, d, generator=gen, device="cuda").bfloat16())
            graph.replay()
            assert rel_err(static_out, ref(static_x)) < 1e-2, (fp8, m)
