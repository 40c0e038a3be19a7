"""The decode-shape projection kernel with its weight tiles through a tensor descriptor (``LinearConfig(tma=True)``:
the swap form, loads pipelined ``num_stages`` deep by the copy engine): the same result as the same config with
per-thread loads, bit for bit, and the plain-PyTorch reference's within rounding, for bf16 / fp32 weights and fp8
weights (w8a16 and w8a8), every fusion (RMSNorm prologue, residual and SwiGLU epilogues, the fp8 row map), ragged N
and K (rows and columns past the weight arrive as zeros), split-K with empty last chunks; and the fallback where a
descriptor cannot describe the weight (a row stride that is not a multiple of 16 bytes). Without CUDA the kernel runs
in Triton's interpreter."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.ops.fp8_linear import naive as fp8_ref
from baton.ops.linear import naive
from baton.ops.quant import quantize_fp8_parts, row_block_map
from tests.ops.triton_support import interpreted_module

CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if CUDA:
    HOPPER = torch.cuda.get_device_capability()[0] >= 9
else:
    HOPPER = True  # the interpreter takes descriptors


def _lt():
    return interpreted_module("baton.ops.linear.triton")


def _ft():
    return interpreted_module("baton.ops.fp8_linear.triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _rows(m: int, n: int, k: int, dtype: torch.dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * 2 + 0.1).to(dtype)
    w = (torch.randn(n, k, generator=gen) / k**0.5).to(dtype)
    nw = (torch.rand(k, generator=gen) + 0.5).to(dtype)
    res = torch.randn(m, n, generator=gen).to(dtype)
    return [t.to(DEV) for t in (x, w, nw, res)]


# (block_n, block_k, split_k, num_warps, num_stages): K = 72 against BLOCK_K 32 (a partial last chunk), 16 with a
# split of 2 (the second split's last chunk lies wholly past K), split 3; N = 37 (a partial last column block).
BF16_CONFIGS = [(16, 32, 1, 4, 3), (32, 16, 2, 4, 2), (16, 32, 3, 4, 4)]


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need Hopper or later")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("fusion", ["plain", "norm_residual", "swiglu"])
@pytest.mark.parametrize("tiles", BF16_CONFIGS)
def test_tma_matches_loads_and_reference(dtype, m, fusion, tiles):
    lt = _lt()
    n, k = (42, 72) if fusion == "swiglu" else (37, 72)
    x, w, nw, res = _rows(m, n, k, dtype, seed=m + 7 * len(fusion))
    cfg = lt.LinearConfig(*tiles, dot=True, swap=True)
    tma = dataclasses.replace(cfg, tma=True)
    assert lt._weight_descriptor(w, tma.block_n, tma.block_k) is not None
    if fusion == "swiglu":
        w = w * 4
        got, base = (lt.linear_swiglu_fwd(x, w, nw, 1e-6, 0.75, config=c, use_pdl=False) for c in (tma, cfg))
        want = naive.linear_swiglu(x, w, nw, 1e-6, 0.75)
    else:
        norm, residual = (nw, res) if fusion == "norm_residual" else (None, None)
        got, base = (lt.linear_fwd(x, w, norm, 1e-6, residual, config=c, use_pdl=False) for c in (tma, cfg))
        want = naive.linear(x, w, norm, 1e-6, residual)
    assert torch.equal(got, base), "the descriptor path must give the per-thread loads' bits"
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)


def _fp8_weight(parts: list[int], k: int, seed: int, scale: float = 1.0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(sum(parts), k, generator=gen) * k**-0.5 * scale
    q, s = quantize_fp8_parts(w, parts)
    rb = row_block_map(parts)
    return q.to(DEV), s.to(DEV), None if rb is None else torch.tensor(rb, dtype=torch.int32, device=DEV)


FP8_CONFIGS = [(64, 128, 2, 4, 4), (32, 128, 3, 4, 3), (128, 128, 1, 8, 2)]


@pytest.mark.skipif(not HOPPER, reason="tensor descriptors need Hopper or later")
@pytest.mark.parametrize("act_fp8", [False, True])
@pytest.mark.parametrize("m", [1, 5, 17])
@pytest.mark.parametrize("fusion", ["plain", "norm_residual", "swiglu", "rowmap_norm"])
@pytest.mark.parametrize("tiles", FP8_CONFIGS)
def test_tma_fp8(act_fp8, m, fusion, tiles):
    """fp8 weights, K = 656 (a 16-column last group and scale block), aligned parts (one scale per tile) and
    unaligned ones (the row map: a scale per row)."""
    ft, lt = _ft(), _lt()
    if m == 1 and not act_fp8:
        pytest.skip("one w8a16 row takes the GEMV form")
    k = 656
    parts = {"plain": [256, 72], "norm_residual": [160], "swiglu": [128, 128], "rowmap_norm": [200, 72, 40]}[fusion]
    swiglu = fusion == "swiglu"
    q, s, rb = _fp8_weight(parts, k, seed=m + len(fusion), scale=4.0 if swiglu else 1.0)
    gen = torch.Generator().manual_seed(m)
    x = ((torch.randn(m, k, generator=gen) * 2 + 0.1) * torch.logspace(-1, 1, m)[:, None]).to(torch.bfloat16).to(DEV)
    nw = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16).to(DEV) if "norm" in fusion else None
    n_out = sum(parts) // 2 if swiglu else sum(parts)
    res = torch.randn(m, n_out, generator=gen).to(torch.bfloat16).to(DEV) if "residual" in fusion else None
    cfg = lt.LinearConfig(*tiles, dot=True, swap=True)
    tma = dataclasses.replace(cfg, tma=True)
    assert lt._weight_descriptor(q, tma.block_n, tma.block_k) is not None
    got, base = (ft.fp8_dense(x, q, s, rb, nw, 1e-6, res, swiglu, 5.0, pdl=False, config=c, act_fp8=act_fp8)
                 for c in (tma, cfg))
    assert torch.equal(got, base), "the descriptor path must give the per-thread loads' bits"
    if swiglu:
        want = fp8_ref.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, 5.0, act_fp8=act_fp8)
    else:
        want = fp8_ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6, res, act_fp8=act_fp8)
    assert rel_err(got.float(), want.float()) < 1e-2


def test_descriptor_fallback():
    """A row stride of 140 bytes (bf16, K = 70) has no descriptor: a tma config takes the per-thread loads, same
    result; BLOCK_N past the copy engine's 256-row box likewise."""
    lt = _lt()
    x, w, nw, res = _rows(3, 37, 70, torch.bfloat16, seed=1)
    assert lt._weight_descriptor(w, 16, 32) is None
    x2, w2, _, _ = _rows(3, 37, 72, torch.bfloat16, seed=1)
    assert lt._weight_descriptor(w2, 512, 32) is None and lt._weight_descriptor(w2, 32, 32) is not None
    cfg = lt.LinearConfig(16, 32, 1, 4, 3, dot=True, swap=True)
    got = lt.linear_fwd(x, w, nw, 1e-6, res, config=dataclasses.replace(cfg, tma=True), use_pdl=False)
    assert torch.equal(got, lt.linear_fwd(x, w, nw, 1e-6, res, config=cfg, use_pdl=False))
