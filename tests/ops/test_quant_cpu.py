"""GGUF Q4_1 / Q8_0 on the CPU (baton.ops.quant_cpu): the block formats against gguf-py's own quantiser and
dequantiser, and the fast path (Inductor kernels) against the dequantise-then-matmul reference, to fp32 rounding.
Synthetic tensors only (the embedded file's tensors: tests/models/test_gguf_quant.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from baton.layers.linear import QuantizedWeight
from baton.ops import quant_cpu
from baton.ops.quant_cpu import cpu, naive

gguf_quants = pytest.importorskip("gguf.quants", reason="gguf-py makes the reference blocks")
from gguf.constants import GGMLQuantizationType as T  # noqa: E402


def _blocks(ggml_type: T, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py's quantisation of a random [n, k] matrix: (raw block rows uint8, gguf-py's dequantised fp32)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf_quants.quantize(w, ggml_type)
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(gguf_quants.dequantize(raw, ggml_type))


@pytest.mark.parametrize("ggml_type", [T.Q4_1, T.Q8_0])
def test_unpack_dequantizes_like_gguf(ggml_type):
    raw, want = _blocks(ggml_type, 64, 96)
    if ggml_type == T.Q4_1:
        got = naive.dequantize_q4_1(*naive.unpack_q4_1(raw))
    else:
        got = naive.dequantize_q8_0(*naive.unpack_q8_0(raw))
    assert torch.equal(got, want)  # bit for bit: the same fp32 products


def _fp32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got == x @ w.T to fp32 rounding: the error bound of an fp32 dot product, sum_k |x_k w_k| * K * eps."""
    want = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * x.shape[-1] * torch.finfo(torch.float32).eps
    assert got.dtype == torch.float32
    assert bool(((got.double() - want).abs() <= bound + 1e-30).all()), (got.double() - want).abs().max()


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 16, 40])  # GEMV (decode, verify) and dequantise + sgemm (prefill)
def test_fast_linear_matches_reference(fmt, rows):
    raw, w = _blocks(T.Q4_1 if fmt == "q4_1" else T.Q8_0, 96, 128, seed=rows)
    qw = QuantizedWeight.from_gguf(fmt, raw)
    assert qw.shape == (96, 128)
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(1))
    fast = cpu.q4_1_linear(x, qw.codes, qw.d, qw.m) if fmt == "q4_1" else cpu.q8_0_linear(x, qw.codes, qw.d)
    ref = naive.q4_1_linear(x, qw.codes, qw.d, qw.m) if fmt == "q4_1" else naive.q8_0_linear(x, qw.codes, qw.d)
    _fp32_close(fast, x, w)
    _fp32_close(ref, x, w)
    _fp32_close(qw.matmul(x), x, w)  # the dispatching entry point


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_rows_and_fused_linear(fmt):
    raw, w = _blocks(T.Q4_1 if fmt == "q4_1" else T.Q8_0, 64, 64)
    qw = QuantizedWeight.from_gguf(fmt, raw)
    ids = torch.tensor([[3, 0], [63, 3]])
    assert torch.equal(qw.rows(ids), w[ids])
    assert torch.equal(qw.dequantize(), w)
    x, res, nw = torch.randn(2, 64), torch.randn(2, 64), torch.rand(64) + 0.5
    from baton.ops.rmsnorm.naive import rms_norm

    torch.testing.assert_close(qw.linear(x, nw, 1e-5, res), res + rms_norm(x, nw, 1e-5) @ w.t())


def test_reference_when_inductor_fails(monkeypatch):
    """No C++ compiler (or any Inductor failure): the dispatcher falls back to the reference, same numbers."""
    raw, w = _blocks(T.Q8_0, 32, 64)
    qw = QuantizedWeight.from_gguf("q8_0", raw)

    def broken(*args):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu, "q8_0_linear", broken)
    monkeypatch.setattr(quant_cpu, "_fast_ok", True)
    x = torch.randn(1, 64)
    _fp32_close(quant_cpu.q8_0_linear(x, qw.codes, qw.d), x, w)
    assert quant_cpu._fast_ok is False
