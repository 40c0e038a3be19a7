"""Fused Triton KDA recurrence and short conv against the naive references.

Without CUDA the kernels run in the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is imported)
on small odd shapes; with CUDA the same tests run compiled on the GPU, and the ``gpu`` tests add the real
Ling-3.0-flash shapes (H=32, K=V=128, 3P=12288).
"""

from __future__ import annotations

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
triton = pytest.importorskip("triton")

from baton.ops import kda as kda_ops  # noqa: E402
from baton.ops import short_conv as conv_ops  # noqa: E402
from baton.ops.kda import naive as kda_naive  # noqa: E402
from baton.ops.short_conv import naive as conv_naive  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _load(name: str):
    """The Triton module, re-imported if something loaded it before TRITON_INTERPRET was set."""
    mod = importlib.import_module(name)
    if DEV == "cpu" and not any(type(v).__name__ == "InterpretedFunction" for v in vars(mod).values()):
        mod = importlib.reload(mod)
    return mod


tk = _load("baton.ops.kda.triton")
ts = _load("baton.ops.short_conv.triton")

H, K, V = 3, 16, 32
FP32_TOL = dict(rtol=1e-4, atol=1e-5)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)


def kda_inputs(T, H, K, V, dtype, seed, device=DEV, max_stage=None):
    """Random non-zero inputs; q|k|v and f|g|b are strided views of wider buffers, as in the layer."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    P = H * K
    qkv = randn(T, 2 * P + H * V + 5).to(dtype).to(device)  # padded rows: non-trivial strides
    fgb = randn(T, P + H * V + H + 3).to(dtype).to(device)
    return dict(
        q=qkv[:, :P].view(T, H, K), k=qkv[:, P : 2 * P].view(T, H, K),
        v=qkv[:, 2 * P : 2 * P + H * V].view(T, H, V),
        f=fgb[:, :P].view(T, H, K), gate=fgb[:, P : P + H * V].view(T, H, V), b=fgb[:, P + H * V : P + H * V + H],
        A_log=torch.empty(H).uniform_(1.0, 16.0, generator=gen).log().to(device),
        dt_bias=(0.5 * randn(H * K)).to(device),
        w=(1.0 + 0.3 * randn(V)).to(dtype).to(device),
        state=(0.5 * randn(H, K, V)).to(device),
        max_stage=max_stage or T + 2,
    )


def run_both(d, lower_bound, bv, nw=None, update_state=True, stage=True, norm=False, scale=None, eps=1e-6):
    """(naive result, triton result); each as (o, state after, out_states or None), outputs NaN-poisoned."""
    T, Hh, Kk = d["q"].shape
    Vv = d["v"].shape[-1]
    res = []
    for fn in (kda_naive.kda_recurrent_fused, tk.kda_recurrent_fused):
        state = d["state"].clone()
        os_ = torch.full((d["max_stage"], Hh, Kk, Vv), float("nan"), device=state.device) if stage else None
        out = torch.full((T, Hh, Vv), float("nan"), device=state.device, dtype=d["v"].dtype)
        kw = dict(block_v=bv, num_warps=nw) if fn is tk.kda_recurrent_fused else {}
        o = fn(d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"], lower_bound, state, scale, os_,
               update_state, d["w"] if norm else None, d["gate"] if norm else None, eps, out=out, **kw)
        assert o.data_ptr() == out.data_ptr()
        res.append((o, state, os_))
    return res


@pytest.mark.parametrize("lower_bound", [-5.0, None])
@pytest.mark.parametrize("T", [1, 4, 7])
@pytest.mark.parametrize("bv", [4, 8, 32])
def test_kda_fused_fp32(T, bv, lower_bound):
    d = kda_inputs(T, H, K, V, torch.float32, seed=10 * T + bv)
    (o_n, s_n, os_n), (o_t, s_t, os_t) = run_both(d, lower_bound, bv, update_state=True, stage=True)
    torch.testing.assert_close(o_t, o_n, **FP32_TOL)
    torch.testing.assert_close(s_t, s_n, **FP32_TOL)
    # staging: every position's post-state, nothing past T touched
    torch.testing.assert_close(os_t[:T], os_n[:T], **FP32_TOL)
    assert os_t[T:].isnan().all()
    torch.testing.assert_close(os_t[T - 1], s_t, rtol=0, atol=0)


@pytest.mark.parametrize("T", [1, 7])
def test_kda_fused_verify_leaves_state(T):
    """update_state=False (verify): the persistent state is bit-identical afterwards; staging is complete."""
    d = kda_inputs(T, H, K, V, torch.float32, seed=3 + T)
    (o_n, _, os_n), (o_t, s_t, os_t) = run_both(d, -5.0, 8, update_state=False, stage=True)
    assert torch.equal(s_t, d["state"])
    torch.testing.assert_close(o_t, o_n, **FP32_TOL)
    torch.testing.assert_close(os_t[:T], os_n[:T], **FP32_TOL)
    assert os_t[T:].isnan().all()


def test_kda_fused_no_staging_scale():
    """Decode form: no out_states, explicit scale, state updated in place."""
    d = kda_inputs(1, H, K, V, torch.float32, seed=5)
    (o_n, s_n, _), (o_t, s_t, _) = run_both(d, -5.0, 4, stage=False, scale=0.3)
    torch.testing.assert_close(o_t, o_n, **FP32_TOL)
    torch.testing.assert_close(s_t, s_n, **FP32_TOL)


@pytest.mark.parametrize("T", [1, 4])
@pytest.mark.parametrize("bv", [8, 32])
def test_kda_fused_bf16(T, bv):
    """bf16 activations, fp32 state."""
    d = kda_inputs(T, H, K, V, torch.bfloat16, seed=7 * T + bv)
    (o_n, s_n, os_n), (o_t, s_t, os_t) = run_both(d, -5.0, bv, update_state=True, stage=True)
    assert o_t.dtype == torch.bfloat16 and s_t.dtype == torch.float32
    torch.testing.assert_close(o_t, o_n, **BF16_TOL)
    torch.testing.assert_close(s_t, s_n, **BF16_TOL)
    torch.testing.assert_close(os_t[:T], os_n[:T], **BF16_TOL)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bv", [8, 32])  # 32 == V: norm fused in the kernel; 8: separate gated_rms_norm_fwd
def test_kda_fused_gated_norm(bv, dtype):
    T = 4
    d = kda_inputs(T, H, K, V, dtype, seed=11 + bv)
    (o_n, s_n, _), (o_t, s_t, _) = run_both(d, -5.0, bv, norm=True, stage=False)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(o_t, o_n, **tol)
    torch.testing.assert_close(s_t, s_n, **tol)


def test_kda_fused_odd_sizes():
    """Non-power-of-two K and V (masked lanes) and BV not dividing V."""
    T, Hh, Kk, Vv = 3, 2, 12, 20
    d = kda_inputs(T, Hh, Kk, Vv, torch.float32, seed=21)
    (o_n, s_n, os_n), (o_t, s_t, os_t) = run_both(d, None, 8, norm=True)
    torch.testing.assert_close(o_t, o_n, **FP32_TOL)
    torch.testing.assert_close(s_t, s_n, **FP32_TOL)
    torch.testing.assert_close(os_t[:T], os_n[:T], **FP32_TOL)


def test_gated_rms_norm_fwd_in_place():
    from baton.ops.rmsnorm.naive import gated_rms_norm

    x, gate = torch.randn(5, 3, 24, device=DEV), torch.randn(5, 3, 24, device=DEV)
    w = torch.randn(24, device=DEV)
    ref = gated_rms_norm(x, gate, w, 1e-6)
    y = tk.gated_rms_norm_fwd(x, gate, w, 1e-6, out=x)
    assert y.data_ptr() == x.data_ptr()
    torch.testing.assert_close(y, ref, **FP32_TOL)


def test_kda_dispatch_matches_naive():
    """The package-level entry point takes the naive path on CPU and the kernel on CUDA; same answer."""
    d = kda_inputs(2, H, K, V, torch.float32, seed=1)
    s1, s2 = d["state"].clone(), d["state"].clone()
    args = (d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"], -5.0)
    o1 = kda_ops.kda_recurrent_fused(*args, s1, None)
    o2 = kda_naive.kda_recurrent_fused(*args, s2, None)
    torch.testing.assert_close(o1, o2, **FP32_TOL)
    torch.testing.assert_close(s1, s2, **FP32_TOL)


# ---------------------------------------------------------------- short conv


def conv_inputs(T, D, W, dtype, seed, device=DEV):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D + 7, generator=gen).to(dtype).to(device)[:, 3 : 3 + D]  # strided view
    weight = torch.randn(D, W, generator=gen).to(device)
    state = torch.randn(D, W - 1, generator=gen).to(dtype).to(device)
    return x, weight, state


def conv_both(x, weight, state, update_state, stage, block_d=None):
    res = []
    T, D = x.shape
    for fn in (conv_naive.short_conv_update, ts.short_conv_update):
        s = state.clone()
        win = None
        if stage:
            win = torch.full((T + 2, D, weight.shape[1] - 1), float("nan"), device=x.device, dtype=x.dtype)
        out = torch.full((T, D), float("nan"), device=x.device, dtype=x.dtype)
        kw = dict(block_d=block_d) if fn is ts.short_conv_update else {}
        y = fn(x, weight, s, win, update_state, out=out, **kw)
        assert y.data_ptr() == out.data_ptr()
        res.append((y, s, win))
    return res


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 2, 4, 7])
def test_short_conv_update(T, dtype):
    D, W = 40, 4
    x, weight, state = conv_inputs(T, D, W, dtype, seed=T)
    (y_n, s_n, w_n), (y_t, s_t, w_t) = conv_both(x, weight, state, update_state=True, stage=True, block_d=16)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(y_t, y_n, **tol)
    assert torch.equal(w_t[:T], w_n[:T])  # windows are copies of inputs: exact
    assert w_t[T:].isnan().all()
    assert torch.equal(s_t, s_n)


@pytest.mark.parametrize("T", [1, 5])
def test_short_conv_verify_leaves_state(T):
    x, weight, state = conv_inputs(T, 33, 4, torch.float32, seed=9)
    (y_n, _, w_n), (y_t, s_t, w_t) = conv_both(x, weight, state, update_state=False, stage=True, block_d=32)
    assert torch.equal(s_t, state)
    torch.testing.assert_close(y_t, y_n, **FP32_TOL)
    assert torch.equal(w_t[:T], w_n[:T])


def test_short_conv_dispatch_matches_naive():
    x, weight, state = conv_inputs(3, 24, 4, torch.float32, seed=2)
    s1, s2 = state.clone(), state.clone()
    torch.testing.assert_close(conv_ops.short_conv_update(x, weight, s1), conv_naive.short_conv_update(x, weight, s2))
    assert torch.equal(s1, s2)


# ---------------------------------------------------------------- real shapes on the GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 6, 16])
@pytest.mark.parametrize("bv,nw", [(4, 1), (16, 1), (128, 4)])  # 128 == V: norm fused in the kernel
def test_kda_fused_real_shapes(T, bv, nw):
    d = kda_inputs(T, 32, 128, 128, torch.bfloat16, seed=T + bv, device="cuda", max_stage=16)
    for update_state in (True, False):
        (o_n, s_n, os_n), (o_t, s_t, os_t) = run_both(d, -5.0, bv, nw, update_state=update_state, norm=True)
        torch.testing.assert_close(o_t, o_n, **BF16_TOL)
        torch.testing.assert_close(s_t, s_n, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(os_t[:T], os_n[:T], rtol=1e-4, atol=1e-4)
        assert os_t[T:].isnan().all()
        if not update_state:
            assert torch.equal(s_t, d["state"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("T", [1, 6, 16])
def test_short_conv_real_shapes(T):
    x, weight, state = conv_inputs(T, 3 * 4096, 4, torch.bfloat16, seed=T, device="cuda")
    for update_state, stage in ((True, False), (False, True), (True, True)):
        (y_n, s_n, w_n), (y_t, s_t, w_t) = conv_both(x, weight, state, update_state, stage)
        torch.testing.assert_close(y_t, y_n, **BF16_TOL)
        assert torch.equal(s_t, s_n)
        if stage:
            assert torch.equal(w_t[:T], w_n[:T])
