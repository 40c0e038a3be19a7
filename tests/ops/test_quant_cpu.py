"""GGUF Q4_1 / Q8_0 on the CPU (baton.ops.quant_cpu): the block formats against gguf-py's own quantiser and
dequantiser, the x4 layout round trip, and the C kernels (every code path the machine can run: AVX-512, AVX2,
portable C) against the dequantise-then-matmul reference, to fp32 rounding. Synthetic tensors at small shapes (the
embedded file's tensors: tests/models/test_gguf_quant.py; the decoder layer: test_quant_cpu_layer.py)."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from baton.layers.linear import QuantizedWeight
from baton.ops import quant_cpu
from baton.ops.quant_cpu import cpu, naive, native

gguf_quants = pytest.importorskip("gguf.quants", reason="gguf-py makes the reference blocks")
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

TYPES = {"q4_1": T.Q4_1, "q8_0": T.Q8_0}


def _blocks(fmt: str, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gguf-py's quantisation of a random [n, k] matrix: (raw block rows uint8, gguf-py's dequantised fp32)."""
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    raw = gguf_quants.quantize(w, TYPES[fmt])
    return torch.from_numpy(np.ascontiguousarray(raw)), torch.from_numpy(gguf_quants.dequantize(raw, TYPES[fmt]))


def _fp32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """got == x @ w.T to fp32 rounding: the error bound of an fp32 dot product, sum_k |x_k w_k| * K * eps."""
    want = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * x.shape[-1] * torch.finfo(torch.float32).eps
    assert got.dtype == torch.float32 and got.shape == want.shape
    err = (got.double() - want).abs()
    assert bool((err <= bound + 1e-30).all()), float(err.max())


def _variants() -> list[str]:
    """The kernels' code paths this CPU runs (the native build, and the narrower ones it can also execute)."""
    lib = native.lib()
    if lib is None:
        return []
    isa = native.isa()
    return {"avx512": ["native", "avx2", "portable"], "avx2": ["native", "portable"]}.get(isa, ["native"])


@pytest.fixture(scope="module", params=_variants() or [pytest.param("native", marks=pytest.mark.skip(
    reason="no C compiler here: the kernels cannot be built"))])
def lib(request):
    lib_ = native.lib(request.param)
    if lib_ is None:
        pytest.skip(f"the {request.param} kernels do not build here ({native.error(request.param)})")
    native.sync_threads(lib_)
    return lib_


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_formats_and_layout_match_gguf(fmt):
    raw, want = _blocks(fmt, 37, 96)  # 37 rows: the last group of 4 is padded
    if fmt == "q4_1":
        assert torch.equal(naive.dequantize_q4_1_blocks(*naive.unpack_q4_1(raw)), want)  # bit for bit
    else:
        assert torch.equal(naive.dequantize_q8_0_blocks(*naive.unpack_q8_0(raw)), want)
    packed = naive.pack(fmt, raw)
    assert packed.shape == (10, 3 * naive.X4_BYTES[fmt]) and packed.dtype == torch.uint8
    assert packed.numel() - raw.numel() == 3 * 3 * (20 if fmt == "q4_1" else 34)  # the file's bytes + 3 zero rows
    assert torch.equal(naive.dequantize(fmt, packed, 37), want)
    assert naive.in_features(fmt, packed) == 96
    qw = QuantizedWeight.from_gguf(fmt, raw)
    assert qw.shape == (37, 96) and qw.nbytes == packed.numel()
    assert torch.equal(qw.dequantize(), want)


def _linear(lib, fmt: str, x: torch.Tensor, packed: torch.Tensor, n: int, res=None) -> torch.Tensor:
    y = torch.empty(x.shape[0], n)
    if fmt == "q4_1":
        err = lib.bq_q4_1_linear(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n, y.data_ptr(),
                                 None if res is None else res.data_ptr())
    else:
        err = lib.bq_q8_0_linear(x.data_ptr(), x.shape[0], x.shape[1], packed.data_ptr(), n, y.data_ptr())
    assert err == 0
    return y


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_kernels_match_reference(lib, fmt):
    """Every row count through the register kernels (1..4 rows at once, and more through the dequantised group),
    equal to the fp32 matmul to fp32 rounding; a row's result does not depend on how many rows come with it (a
    verify row equals the decode row bit for bit)."""
    n, k = 37, 96
    raw, w = _blocks(fmt, n, k, seed=3)
    packed = naive.pack(fmt, raw)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(1))
    alone = _linear(lib, fmt, x[:1].contiguous(), packed, n)
    for rows in (1, 2, 3, 4, 5, 9, 17):
        y = _linear(lib, fmt, x[:rows].contiguous(), packed, n)
        _fp32_close(y, x[:rows], w)
        assert torch.equal(y[:1], alone), rows
    if fmt == "q4_1":
        res = torch.randn(5, n)
        torch.testing.assert_close(_linear(lib, fmt, x[:5].contiguous(), packed, n, res),
                                   res + _linear(lib, fmt, x[:5].contiguous(), packed, n), rtol=0, atol=0)
    out = torch.empty(n, k)
    (lib.bq_q4_1_dequant if fmt == "q4_1" else lib.bq_q8_0_dequant)(packed.data_ptr(), n, k, out.data_ptr())
    assert torch.equal(out, w)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_every_row_count_gives_the_decode_bits(lib, fmt):
    """Speculative verify equals plain decode token for token only if every row of an M-row matmul is the M = 1
    result of that row bit for bit: every M of 1..17 (the register tiles of each size, and the buffered tiles past
    them), every row, with the residual (Q4_1), on each code path."""
    n, k = 37, 160  # a padded last group; 5 blocks
    raw, _ = _blocks(fmt, n, k, seed=7)
    packed = naive.pack(fmt, raw)
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(17, k, generator=gen)
    res = torch.randn(17, n, generator=gen) if fmt == "q4_1" else None
    alone = torch.cat([_linear(lib, fmt, x[r : r + 1].contiguous(), packed, n,
                               None if res is None else res[r : r + 1].contiguous()) for r in range(17)])
    for rows in range(1, 18):
        y = _linear(lib, fmt, x[:rows].contiguous(), packed, n, None if res is None else res[:rows].contiguous())
        for r in range(rows):
            assert torch.equal(y[r], alone[r]), (rows, r)


def test_q8_0_rows_and_argmax(lib):
    raw, w = _blocks("q8_0", 37, 64)
    packed = naive.pack("q8_0", raw)
    ids = torch.tensor([36, 0, 5, 36])
    out = torch.empty(4, 64)
    assert lib.bq_q8_0_rows(ids.data_ptr(), 4, packed.data_ptr(), 37, 64, out.data_ptr()) == 0
    assert torch.equal(out, w[ids])
    bad = torch.tensor([0, 37])
    assert lib.bq_q8_0_rows(bad.data_ptr(), 2, packed.data_ptr(), 37, 64, out.data_ptr()) == 1
    logits = torch.tensor([[1.0, 3.0, 3.0, -1.0], [0.0, float("nan"), 5.0, float("nan")], [-2.0] * 4])
    ids = torch.empty(3, dtype=torch.int64)
    lib.bq_argmax_rows(logits.data_ptr(), 3, 4, ids.data_ptr())
    assert ids.tolist() == [1, 1, 0] == logits.argmax(-1).tolist()  # lowest id among ties; NaN the largest


def test_threads_give_the_same_bits():
    """The pool splits the row groups between threads; each row is computed by one thread in the same order."""
    if native.lib() is None:
        pytest.skip("no kernels here")
    lib = native.lib()
    raw, _ = _blocks("q4_1", 300, 128, seed=5)
    packed = naive.pack("q4_1", raw)
    x = torch.randn(3, 128)
    before = lib.bq_threads()
    try:
        lib.bq_set_threads(1)
        one = _linear(lib, "q4_1", x, packed, 300)
        assert lib.bq_set_threads(3) == 3
        three = _linear(lib, "q4_1", x, packed, 300)
    finally:
        lib.bq_set_threads(before)
        native._threads.clear()
    assert torch.equal(one, three)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 48, 49])  # register kernels, and dequantise + sgemm past GEMV_MAX_ROWS
def test_dispatch_matches_reference(fmt, rows):
    raw, w = _blocks(fmt, 40, 64, seed=rows)
    qw = QuantizedWeight.from_gguf(fmt, raw)
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(1))
    _fp32_close(qw.matmul(x), x, w)
    _fp32_close(naive.linear(fmt, x, qw.packed, 40), x, w)
    assert cpu.GEMV_MAX_ROWS == 48


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
def test_rows_and_fused_linear(fmt):
    raw, w = _blocks(fmt, 64, 64)
    qw = QuantizedWeight.from_gguf(fmt, raw)
    ids = torch.tensor([[3, 0], [63, 3]])
    assert torch.equal(qw.rows(ids), w[ids])
    with pytest.raises(IndexError):
        qw.rows(torch.tensor([64]))
    x, res, nw = torch.randn(2, 64), torch.randn(2, 64), torch.rand(64) + 0.5
    from baton.ops.rmsnorm.naive import rms_norm

    torch.testing.assert_close(qw.linear(x, nw, 1e-5, res), res + rms_norm(x, nw, 1e-5) @ w.t())


def test_reference_without_kernels(monkeypatch):
    """No C compiler (or a failed build): the ops take the plain-PyTorch references, same numbers."""
    raw, w = _blocks("q8_0", 32, 64)
    qw = QuantizedWeight.from_gguf("q8_0", raw)
    monkeypatch.setattr(native, "lib", lambda variant="native": None)
    assert not quant_cpu.fast_path_ok()
    x = torch.randn(2, 64)
    _fp32_close(qw.matmul(x), x, w)
    assert torch.equal(qw.rows(torch.tensor([1, 31])), w[[1, 31]])


def test_build_is_cached(tmp_path, monkeypatch):
    """The library is built once per machine: a second load finds the cached file (same key) and builds nothing."""
    if not native._compilers():
        pytest.skip("no C compiler")
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "_libs", {})
    lib1 = native.lib("portable")
    assert lib1 is not None and lib1.bq_isa() == 0
    built = sorted(p.name for p in (tmp_path / "kernels").iterdir())
    assert len(built) == 1 and built[0].startswith("quant_cpu-portable-")
    runs = []
    real_run = native.subprocess.run
    monkeypatch.setattr(native.subprocess, "run", lambda cmd, **kw: runs.append(cmd) or real_run(cmd, **kw))
    monkeypatch.setattr(native, "_libs", {})
    assert native.lib("portable") is not None
    assert not [c for c in runs if "-shared" in c]  # only `cc --version`, no compile
    assert isinstance(lib1, ctypes.CDLL)
