"""The one-kernel RMSNorm (baton/ops/rmsnorm/triton.py) against the PyTorch reference; without CUDA in the
Triton interpreter (``TRITON_INTERPRET=1``)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from baton.ops.rmsnorm import naive  # noqa: E402
from tests.ops.triton_support import load_triton_module  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
rn = load_triton_module("baton.ops.rmsnorm.triton")


@pytest.mark.parametrize("shape", [(1, 576), (4, 576), (3, 9, 64), (2, 2560), (5, 100)])
@pytest.mark.parametrize("x_dtype,w_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_matches_the_reference(shape, x_dtype, w_dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = (torch.randn(*shape, generator=gen) * 3).to(DEV, x_dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEV, w_dtype)
    got, want = rn.rms_norm(x, w, 1e-5), naive.rms_norm(x, w, 1e-5)
    assert got.dtype == want.dtype and got.shape == want.shape
    if x_dtype == torch.float32:
        tol = dict(rtol=1e-5, atol=1e-5)
    else:  # two bf16 roundings (y, then y * w), each to nearest: one step apart at most (1 ulp = 0.8%)
        tol = dict(rtol=8e-3, atol=8e-3)
    torch.testing.assert_close(got.float(), want.float(), **tol)
    if x_dtype == torch.bfloat16:  # only the fp32 sum's order differs: nearly every element agrees exactly
        assert (got.float() - want.float()).abs().gt(1e-6 * want.float().abs()).float().mean() < 0.02


def test_a_strided_row_view():
    x = torch.randn(6, 1200, generator=torch.Generator().manual_seed(2)).to(DEV)
    view = x[::2, :576]  # rows 2 x 1200 apart, last dim contiguous
    w = torch.rand(576).to(DEV)
    assert rn.supports(view, w)
    torch.testing.assert_close(rn.rms_norm(view, w, 1e-6), naive.rms_norm(view, w, 1e-6), rtol=1e-5, atol=1e-5)


def test_the_dispatcher_keeps_the_reference_on_cpu_and_under_autograd():
    from baton.ops import rmsnorm

    x = torch.randn(2, 8, requires_grad=True)
    w = torch.ones(8, requires_grad=True)
    rmsnorm.rms_norm(x, w, 1e-6).sum().backward()  # the reference path: gradients flow
    assert x.grad is not None and w.grad is not None
