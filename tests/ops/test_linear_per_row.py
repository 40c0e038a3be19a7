"""The per-row form of the decode-shape projection kernel (``LinearConfig(dot=False, per_row=True)``: a verify's few
rows as the GEMV form once per row over each chunk's weight tile) against the plain-PyTorch reference: bf16 / fp32
weights and fp8 weights (scalar, per-column and per-row block scales, the bit-moving widening), every fusion
(RMSNorm prologue, residual and SwiGLU epilogues), whole-K chunks (no loop) and chunked K with split-K, ragged N and
K, M from 2 to 17 (rows padded to 32). Without CUDA the kernel runs in Triton's interpreter, where it also equals the
rows form bit for bit (the same products summed in the same order)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from baton.ops.fp8_linear import naive as fp8_ref
from baton.ops.linear import naive
from tests.ops.test_linear_tma import DEV, _fp8_weight, _ft, _lt, _rows, rel_err

CUDA = torch.cuda.is_available()


# (block_n, block_k, split_k): K = 70 in one 128-wide chunk; 32-wide chunks with a partial last one; a split of 2
# over 16-wide chunks (the second split runs an empty chunk past K).
CONFIGS = [(4, 128, 1), (8, 32, 1), (2, 16, 2)]


CASES = [(m, tiles) for m in (2, 6) for tiles in CONFIGS] + [(17, CONFIGS[0])]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,tiles", CASES)
@pytest.mark.parametrize("fusion", ["plain", "norm_residual", "swiglu", "norm_swiglu"])
def test_per_row_matches_the_reference(dtype, m, tiles, fusion):
    lt = _lt()
    k = 70
    swiglu = "swiglu" in fusion
    n = 42 if swiglu else 37
    x, w, nw, res = _rows(m, n, k, dtype, seed=m + 3 * len(fusion))
    norm = nw if "norm" in fusion else None
    cfg = lt.LinearConfig(*tiles, num_warps=4, num_stages=1, dot=False, per_row=True)
    rows = dataclasses.replace(cfg, per_row=False)
    if swiglu:
        w = w * 4
        got, base = (lt.linear_swiglu_fwd(x, w, norm, 1e-6, 0.75, config=c, use_pdl=False) for c in (cfg, rows))
        want = naive.linear_swiglu(x, w, norm, 1e-6, 0.75)
    else:
        residual = res if "residual" in fusion else None
        got, base = (lt.linear_fwd(x, w, norm, 1e-6, residual, config=c, use_pdl=False) for c in (cfg, rows))
        want = naive.linear(x, w, norm, 1e-6, residual)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-2)
    if not CUDA:
        assert torch.equal(got, base), "the per-row form sums what the rows form sums, in the same order"


@pytest.mark.parametrize("m", [3, 17])
@pytest.mark.parametrize("fusion", ["plain", "norm_residual", "swiglu", "rowmap_norm"])
@pytest.mark.parametrize("tiles", [(8, 128, 1, False), (4, 256, 1, False), (16, 64, 3, False), (8, 128, 2, True)])
def test_per_row_fp8(m, fusion, tiles):
    """fp8 weights, K = 300 (a partial last scale block): one scale per tile (BLOCK_K 128 / 64), per column (a
    256-wide chunk spans two scale blocks), per row (the row map), the bit-moving widening."""
    ft, lt = _ft(), _lt()
    k = 300
    parts = {"plain": [256, 72], "norm_residual": [160], "swiglu": [128, 128], "rowmap_norm": [200, 72, 40]}[fusion]
    swiglu = fusion == "swiglu"
    q, s, rb = _fp8_weight(parts, k, seed=m + len(fusion), scale=4.0 if swiglu else 1.0)
    gen = torch.Generator().manual_seed(m)
    x = (torch.randn(m, k, generator=gen) * 2 + 0.1).to(torch.bfloat16).to(DEV)
    nw = (torch.rand(k, generator=gen) + 0.5).to(torch.bfloat16).to(DEV) if "norm" in fusion else None
    n_out = sum(parts) // 2 if swiglu else sum(parts)
    res = torch.randn(m, n_out, generator=gen).to(torch.bfloat16).to(DEV) if "residual" in fusion else None
    bn, bk, split, bits = tiles
    cfg = lt.LinearConfig(bn, bk, split, 4, 1, dot=False, per_row=True, bits=bits)
    got = ft.fp8_dense(x, q, s, rb, nw, 1e-6, res, swiglu, 5.0, pdl=False, config=cfg)
    if swiglu:
        want = fp8_ref.fp8_dense_linear_swiglu(x, q, s, rb, nw, 1e-6, 5.0)
    else:
        want = fp8_ref.fp8_dense_linear(x, q, s, rb, nw, 1e-6, res)
    assert rel_err(got.float(), want.float()) < 1e-2
    if not CUDA:
        base = ft.fp8_dense(x, q, s, rb, nw, 1e-6, res, swiglu, 5.0, pdl=False,
                            config=dataclasses.replace(cfg, per_row=False))
        assert torch.equal(got, base)
