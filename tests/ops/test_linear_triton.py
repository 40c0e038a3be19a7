"""The Triton projections in ``baton.ops.linear.triton`` against the naive reference.

Without CUDA the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set here before triton is first
imported) on small odd shapes; with CUDA the same tests run compiled on the GPU, and the ``gpu`` tests add the
real Ling-3.0-flash / SmolLM2 shapes, split-K, PDL and CUDA-graph capture.
"""

from __future__ import annotations

import os

import pytest
import torch

CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ["TRITON_INTERPRET"] = "1"
pytest.importorskip("triton")

from baton.ops.linear import naive  # noqa: E402
from baton.ops.linear import triton as fast  # noqa: E402

DEV = "cuda" if CUDA else "cpu"
# The interpreter only works if triton itself was first imported with TRITON_INTERPRET set (its own jit'd
# library functions are decorated then); an earlier compiled-mode import in this process rules it out.
RUNNABLE = CUDA or type(fast.linear_kernel).__name__ == "InterpretedFunction"
kernels = pytest.mark.skipif(not RUNNABLE, reason="triton was imported before TRITON_INTERPRET was set "
                                                  "(set it in tests/conftest.py on CPU-only machines)")
TOL = {torch.float32: 1e-4, torch.bfloat16: 1e-2}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def make(m: int, n: int, k: int, dtype: torch.dtype, device: str = DEV, seed: int = 0):
    """x [m, k], weight [n, k], norm weight [k], residual [m, n]: random, never zero."""
    gen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    x = (randn(m, k) * 2 + 0.1).to(dtype)
    w = (randn(n, k) / k**0.5).to(dtype)
    nw = (torch.rand(k, generator=gen, device=device) + 0.5).to(dtype)
    res = randn(m, n).to(dtype)
    return x, w, nw, res


def poisoned_launch(monkeypatch, mod):
    """Make every output the module allocates start as NaN, so an unwritten element fails the comparison."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.dtype.is_floating_point:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(mod.torch, "empty", nan_empty)


def check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any(), "unwritten (NaN-poisoned) outputs"
    assert rel_err(out, ref) < TOL[dtype]


# Odd sizes; the configs cover the M == 1 path (default and forced small tiles), split-K with a partial last
# chunk, tl.dot with M padded to 16, and the GEMV form over a few rows (dot=False), with and without split-K.
CONFIGS = [None, (4, 32, 1), (16, 32, 3), (4, 32, 1, 4, 1, False), (8, 16, 3, 4, 1, False)]


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 6, 16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_linear(monkeypatch, dtype, m, norm, residual, cfg):
    n, k = 37, 70
    x, w, nw, res = make(m, n, k, dtype, seed=m)
    config = None if cfg is None else fast.LinearConfig(*cfg)
    if config is not None and m > 1 and config.dot and config.block_n < 16:
        pytest.skip("tl.dot needs BLOCK_N >= 16")
    poisoned_launch(monkeypatch, fast)
    out = fast.linear_fwd(x, w, nw if norm else None, 1e-6, res if residual else None, config=config)
    check(out, naive.linear(x, w, nw if norm else None, 1e-6, res if residual else None), dtype)


@kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("limit", [0.0, 0.75])
@pytest.mark.parametrize("cfg", CONFIGS)
def test_linear_swiglu(monkeypatch, dtype, m, norm, limit, cfg):
    i, k = 21, 70
    x, w, nw, _ = make(m, 2 * i, k, dtype, seed=10 + m)
    w = w * 4  # activations beyond the limit, so the clamp matters
    config = None if cfg is None else fast.LinearConfig(*cfg)
    if config is not None and m > 1 and config.dot and config.block_n < 16:
        pytest.skip("tl.dot needs BLOCK_N >= 16")
    poisoned_launch(monkeypatch, fast)
    out = fast.linear_swiglu_fwd(x, w, nw if norm else None, 1e-6, limit, config=config)
    ref = naive.linear_swiglu(x, w, nw if norm else None, 1e-6, limit)
    if limit:
        assert (ref.abs() >= limit * 0.5).any()
    check(out, ref, dtype)


@kernels
def test_strided_input_and_leading_dims(monkeypatch):
    """x as a column slice of a wider tensor (as KDA's f/g split feeds f_b_proj), and a 3-D x."""
    x_wide, w, nw, res = make(3, 29, 130, torch.float32)
    x = x_wide[:, 30:100]  # [3, 70], row stride 130
    w = w[:, :70].contiguous()
    poisoned_launch(monkeypatch, fast)
    check(fast.linear_fwd(x, w, nw[:70].contiguous()), naive.linear(x, w, nw[:70].contiguous()), torch.float32)
    x3 = x.contiguous().view(1, 3, 70)
    check(fast.linear_fwd(x3, w, residual=res.view(1, 3, 29)), naive.linear(x3, w, residual=res.view(1, 3, 29)),
          torch.float32)


@kernels
def test_split_counters_reset():
    """Split-K leaves its arrival counters at zero, so a second launch (a graph replay) reduces correctly."""
    x, w, nw, res = make(2, 45, 200, torch.float32)
    config = fast.LinearConfig(16, 32, 4)
    for _ in range(2):
        check(fast.linear_fwd(x, w, nw, 1e-6, res, config=config), naive.linear(x, w, nw, 1e-6, res),
              torch.float32)
    assert int(fast._split_counters(x.device).abs().sum()) == 0


def test_supports_and_configs():
    x, w, nw, res = make(3, 8, 16, torch.bfloat16, device="cpu")
    assert fast.supports(x, w, nw, res)
    assert fast.supports(torch.randn(17, 16, dtype=torch.bfloat16, device=x.device), w)  # a DSpark verify
    assert not fast.supports(torch.randn(33, 16, dtype=torch.bfloat16, device=x.device), w)  # M > 32: cuBLAS
    assert not fast.supports(x, w.float())
    assert not fast.supports(x, w, nw.float())
    assert not fast.supports(x, w, residual=res[:, :4])
    assert not fast.supports(x, w[:7], swiglu=True)
    assert not fast.pdl_enabled(torch.device("cpu"))
    for m in (1, 6, 16, 17):
        for n, k, swiglu in ((20512, 2560, False), (576, 1536, False), (768, 2560, True), (49152, 576, False)):
            cfg = fast.pick_config(m, n, k, swiglu)
            assert cfg.block_k & (cfg.block_k - 1) == 0 and cfg.block_n & (cfg.block_n - 1) == 0
            if m > 1:
                assert cfg.block_n >= 16 and cfg.block_k >= 16


def test_dispatch_on_cpu_is_naive():
    import baton.ops.linear as ops

    x, w, nw, res = make(2, 8, 16, torch.float32, device="cpu")
    assert torch.equal(ops.linear(x, w, nw, 1e-6, res), naive.linear(x, w, nw, 1e-6, res))
    assert torch.equal(ops.linear_swiglu(x, w, nw, 1e-6, 0.5), naive.linear_swiglu(x, w, nw, 1e-6, 0.5))


# ---------------------------------------------------------------------------------------------------------------
# CUDA: compiled kernels at the real shapes.

gpu = pytest.mark.skipif(not CUDA, reason="needs CUDA")

REAL_SHAPES = [  # (n_rows, k, swiglu): Ling-3.0-flash then SmolLM2-135M; lm_heads are in the bench
    (20512, 2560, False), (6752, 2560, False), (2560, 4096, False), (1536, 2560, True), (2560, 768, False),
    (512, 2560, False), (960, 576, False), (576, 576, False), (3072, 576, True), (576, 1536, False),
]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [1, 6, 16])
@pytest.mark.parametrize("shape", REAL_SHAPES)
@pytest.mark.parametrize("pdl", [False, True])
def test_real_shapes_cuda(monkeypatch, m, shape, pdl):
    n, k, swiglu = shape
    if pdl and not fast.pdl_enabled(torch.device("cuda")):
        pytest.skip("no PDL on this GPU")
    x, w, nw, res = make(m, n, k, torch.bfloat16, device="cuda", seed=n + m)
    poisoned_launch(monkeypatch, fast)
    if swiglu:
        for limit in (0.0, 7.0):
            out = fast.linear_swiglu_fwd(x, w * 8, nw, 1e-6, limit, use_pdl=pdl)
            check(out, naive.linear_swiglu(x, w * 8, nw, 1e-6, limit), torch.bfloat16)
    else:
        for norm_weight, residual in ((None, None), (nw, None), (None, res), (nw, res)):
            out = fast.linear_fwd(x, w, norm_weight, 1e-6, residual, use_pdl=pdl)
            check(out, naive.linear(x, w, norm_weight, 1e-6, residual), torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m", [2, 4, 8])
@pytest.mark.parametrize("shape", REAL_SHAPES)
@pytest.mark.parametrize("cfg", [(4, 256, 1), (8, 128, 2), (2, 512, 1)])
def test_few_rows_gemv_form_cuda(monkeypatch, m, shape, cfg):
    """The GEMV form over a few rows (``dot=False``, what a tuned row-bucket entry may choose) at the real shapes."""
    n, k, swiglu = shape
    x, w, nw, res = make(m, n, k, torch.bfloat16, device="cuda", seed=n + 3 * m)
    config = fast.LinearConfig(*cfg, 4, 1, dot=False)
    poisoned_launch(monkeypatch, fast)
    if swiglu:
        out = fast.linear_swiglu_fwd(x, w * 8, nw, 1e-6, 7.0, config=config)
        check(out, naive.linear_swiglu(x, w * 8, nw, 1e-6, 7.0), torch.bfloat16)
    else:
        check(fast.linear_fwd(x, w, nw, 1e-6, res, config=config), naive.linear(x, w, nw, 1e-6, res), torch.bfloat16)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("split_k", [1, 3, 8])
@pytest.mark.parametrize("m", [1, 5, 16])
def test_split_k_cuda(m, split_k):
    n, k = 576, 1536
    x, w, nw, res = make(m, n, k, torch.float32, device="cuda")
    block_n = 16 if m > 1 else 8
    config = fast.LinearConfig(block_n, 64, split_k)
    for _ in range(3):  # counters must be back at zero after each launch
        check(fast.linear_fwd(x, w, nw, 1e-6, res, config=config), naive.linear(x, w, nw, 1e-6, res),
              torch.float32)
        out = fast.linear_swiglu_fwd(x, w, nw, 1e-6, 0.5, config=config)
        check(out, naive.linear_swiglu(x, w, nw, 1e-6, 0.5), torch.float32)


@pytest.mark.gpu
@gpu
def test_graph_capture_chain_cuda():
    """A PDL chain of dependent projections (norm -> swiglu -> down + residual) inside a CUDA graph, replayed on
    new inputs, equals the reference: the chain's waits order each kernel after its producer."""
    d, inter = 2560, 768
    x, w_up, nw, _ = make(6, 2 * inter, d, torch.bfloat16, device="cuda", seed=1)
    _, w_down, _, _ = make(6, d, inter, torch.bfloat16, device="cuda", seed=2)
    split = fast.LinearConfig(16, 128, 4)

    def step(x):  # [6, d] -> [6, 2 * inter]
        h = fast.linear_swiglu_fwd(x, w_up, nw, 1e-6, 7.0)
        h = fast.linear_fwd(h, w_down, residual=x, config=split)
        return fast.linear_fwd(h, w_up, nw)

    def ref(x):
        h = naive.linear_swiglu(x, w_up, nw, 1e-6, 7.0)
        return naive.linear(naive.linear(h, w_down, residual=x), w_up, nw)

    static_x = x.clone()
    step(static_x)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step(static_x)
    for seed in range(3):
        static_x.copy_(make(6, 2 * inter, d, torch.bfloat16, device="cuda", seed=10 + seed)[0])
        graph.replay()
        check(static_out.clone(), ref(static_x), torch.bfloat16)


@pytest.mark.gpu
@gpu
def test_dispatch_cuda(monkeypatch):
    import baton.ops.linear as ops

    calls = []
    real = fast.linear_fwd
    monkeypatch.setattr(fast, "linear_fwd", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    x, w, nw, res = make(4, 96, 64, torch.bfloat16, device="cuda")
    check(ops.linear(x, w, nw, 1e-6, res), naive.linear(x, w, nw, 1e-6, res), torch.bfloat16)
    assert calls, "CUDA with M <= 32 takes the Triton path"
    x33 = make(33, 96, 64, torch.bfloat16, device="cuda")[0]
    ops.linear(x33, w)
    assert len(calls) == 1, "M > 32 falls back to cuBLAS"
