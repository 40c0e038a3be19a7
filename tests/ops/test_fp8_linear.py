"""fp8 (e4m3, 128 x 128 block scales) weight times bf16 / fp32 rows: the Triton kernel against the dequantise-then-
matmul reference (Triton interpreter on CPU; compiled on CUDA), and the dispatch."""

from __future__ import annotations

import pytest
import torch

from baton.ops.fp8_linear import fp8_linear
from baton.ops.fp8_linear import naive as ref
from baton.ops.quant import dequantize_fp8_block, quantize_fp8_block
from tests.ops.triton_support import interpreted_module

HAS_CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")


def _triton():
    return interpreted_module("baton.ops.fp8_linear.triton")


def test_reference_is_the_dequantised_matmul():
    w = torch.randn(300, 200) * 0.05
    q, s = quantize_fp8_block(w)
    x = torch.randn(3, 200)
    torch.testing.assert_close(ref.fp8_linear(x, q, s), x @ dequantize_fp8_block(q, s, torch.float32).t())
    # about e4m3's error against the unquantised weight
    assert ((ref.fp8_linear(x, q, s) - x @ w.t()).norm() / (x @ w.t()).norm()).item() < 0.05
    torch.testing.assert_close(fp8_linear(x, q, s), ref.fp8_linear(x, q, s))  # CPU: the dispatch's reference


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("tiles", [(64, 128, 4, 2), (32, 64, 4, 1), (128, 32, 4, 2)])
def test_kernel_matches_the_reference(m, tiles):
    """Ragged N and K (several scale blocks, partial last ones); one row (the GEMV form) and a few (tl.dot)."""
    ft = _triton()
    n, k = 330, 290
    gen = torch.Generator().manual_seed(m)
    q, s = quantize_fp8_block(torch.randn(n, k, generator=gen) * k**-0.5)
    x = torch.randn(m, k, generator=gen)
    got = ft.fp8_linear(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), tiles=tiles, pdl=False)
    assert got.dtype == torch.float32 and got.shape == (m, n)
    torch.testing.assert_close(got.cpu(), ref.fp8_linear(x, q, s), rtol=1e-4, atol=1e-4)


def test_tiles_across_scale_blocks_are_refused():
    ft = _triton()
    q, s = quantize_fp8_block(torch.randn(256, 256))
    with pytest.raises(AssertionError, match="divide the 128 x 128"):
        ft.fp8_linear(torch.randn(1, 256).to(DEVICE), q.to(DEVICE), s.to(DEVICE), tiles=(64, 256, 4, 2), pdl=False)


def test_supports():
    ft = _triton()
    q, s = quantize_fp8_block(torch.randn(256, 128))
    assert ft.supports(torch.randn(1, 128), q, s)
    assert not ft.supports(torch.randn(ft.MAX_M + 1, 128), q, s)  # more rows than a draft block
    assert not ft.supports(torch.randn(1, 128), q.float(), s)  # not fp8
    assert not ft.supports(torch.randn(1, 128, dtype=torch.float16), q, s)
    assert not ft.supports(torch.randn(1, 128), q, s[:1])  # scales of another shape


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("n,k", [(157184, 2560), (49152, 576)])  # Ling-3.0-flash's and SmolLM2's lm_head
def test_kernel_at_lm_head_shapes(m, n, k):
    ft = _triton()
    w = torch.randn(n, k, device=DEVICE, dtype=torch.bfloat16) * k**-0.5
    q, s = quantize_fp8_block(w)
    x = torch.randn(m, k, device=DEVICE, dtype=torch.bfloat16)
    got = ft.fp8_linear(x, q, s)
    want = x.float() @ dequantize_fp8_block(q, s, torch.float32).t()
    assert ((got - want).norm() / want.norm()).item() < 1e-2  # bf16 dot operands for m > 1
    picked = want.gather(1, got.argmax(-1, keepdim=True))  # the kernel's argmax is the reference's, up to ties
    assert (picked >= want.max(-1, keepdim=True).values - 1e-2 * want.std()).all()
