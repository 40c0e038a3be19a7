"""The short conv inside the KDA recurrence kernel (``kda_recurrent_fused`` with ``conv_weight``) against the
composition of the references (``short_conv_update`` then the recurrence), and the KDA layer's fused forward
against its former two-call form.

Without CUDA the kernel runs in the Triton interpreter on small shapes (a few seconds in all); BV < V makes the
head's V-blocks meet through the ticket counter (the q / k conv windows and the output norm by the last one),
BV = V has one program a head.
"""

from __future__ import annotations

import pytest
import torch

from baton.cache.model_cache import ModelCache
from baton.config import parse_model_config
from baton.layers.context import ForwardContext
from baton.layers.kda import KimiDeltaAttention
from baton.ops import kda as kda_ops
from baton.ops.kda import naive as kda_naive
from baton.ops.short_conv import naive as conv_naive
from baton.types import ForwardMode
from tests.conftest import TINY_LING
from tests.ops.triton_support import DEV, interpreted_module

tk = interpreted_module("baton.ops.kda.triton")
ts = interpreted_module("baton.ops.short_conv.triton")

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_TOL = dict(rtol=1e-2, atol=1e-2)


def conv_kda_inputs(T, H, K, V, dtype, seed, W=4, max_stage=None, device=DEV):
    """Random inputs as the layer has them: raw q|k|v and f|g|b strided views of wider rows, the conv weight a
    [D, W] view of [D, 1, W], conv state and windows in the activations' dtype, the recurrent state fp32."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    P, PV = H * K, H * V
    D = 2 * P + PV
    qkv = randn(T, D + 5).to(dtype).to(device)[:, 2 : 2 + D]
    fgb = randn(T, P + PV + H + 3).to(dtype).to(device)
    return dict(
        q=qkv[:, :P].view(T, H, K), k=qkv[:, P : 2 * P].view(T, H, K), v=qkv[:, 2 * P :].view(T, H, V),
        f=fgb[:, :P].view(T, H, K), gate=fgb[:, P : P + PV].view(T, H, V), b=fgb[:, P + PV : P + PV + H],
        A_log=torch.empty(H).uniform_(1.0, 16.0, generator=gen).log().to(device),
        dt_bias=(0.5 * randn(H * K)).to(device),
        w=(1.0 + 0.3 * randn(V)).to(dtype).to(device),
        conv_weight=(0.5 * randn(D, 1, W)).to(dtype).to(device)[:, 0, :],
        conv_state=randn(D, W - 1).to(dtype).to(device),
        state=(0.5 * randn(H, K, V)).to(device),
        max_stage=max_stage or T + 2,
    )


def run_both(d, lower_bound, bv, nw=1, update_state=True, stage=True, norm=True):
    """(naive, triton) results, each a dict of o, the persistent states after, and the staged buffers (NaN-poisoned
    past what the call should write; None without staging)."""
    T, H, K = d["q"].shape
    V = d["v"].shape[-1]
    D, W = d["conv_weight"].shape
    res = []
    for fn in (kda_naive.kda_recurrent_fused, tk.kda_recurrent_fused):
        state, conv_state = d["state"].clone(), d["conv_state"].clone()
        S = d["max_stage"]
        staged = torch.full((S, H, K, V), float("nan"), device=state.device) if stage else None
        windows = (torch.full((S, D, W - 1), float("nan"), device=state.device, dtype=conv_state.dtype)
                   if stage else None)
        out = torch.full((T, H, V), float("nan"), device=state.device, dtype=d["v"].dtype)
        kw = dict(block_v=bv, num_warps=nw) if fn is tk.kda_recurrent_fused else {}
        o = fn(d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"], lower_bound, state, None, staged,
               update_state, d["w"] if norm else None, d["gate"] if norm else None, 1e-6, out=out,
               conv_weight=d["conv_weight"], conv_state=conv_state, conv_windows=windows, **kw)
        assert o.data_ptr() == out.data_ptr()
        res.append(dict(o=o, state=state, conv=conv_state, staged=staged, windows=windows))
    return res


def check_counters_reset():
    for buf in tk._COUNTERS.values():
        assert not buf.any(), "a head's ticket counter was left non-zero"


def test_reference_is_the_composition():
    """The reference of the fused op is short_conv_update then the recurrence from the conv's output, bit for bit;
    the package entry point takes it on CPU tensors."""
    T, H, K, V = 5, 2, 8, 8
    d = conv_kda_inputs(T, H, K, V, torch.float32, seed=1)
    D, W = d["conv_weight"].shape
    s1, c1, w1 = d["state"].clone(), d["conv_state"].clone(), torch.zeros(T, D, W - 1)
    x = torch.cat([d["q"].reshape(T, -1), d["k"].reshape(T, -1), d["v"].reshape(T, -1)], -1)
    y = conv_naive.short_conv_update(x, d["conv_weight"], c1, w1, True)
    q, k, v = (z.view(T, H, -1) for z in y.split([H * K, H * K, H * V], -1))
    o1 = kda_naive.kda_recurrent_fused(q, k, v, d["f"], d["b"], d["A_log"], d["dt_bias"], -5.0, s1, None, None, True,
                                       d["w"], d["gate"])
    s2, c2, w2 = d["state"].clone(), d["conv_state"].clone(), torch.zeros(T, D, W - 1)
    fused = kda_ops.kda_recurrent_fused if DEV == "cpu" else kda_naive.kda_recurrent_fused
    o2 = fused(d["q"], d["k"], d["v"], d["f"], d["b"], d["A_log"], d["dt_bias"], -5.0, s2, None, None, True,
               d["w"], d["gate"], conv_weight=d["conv_weight"], conv_state=c2, conv_windows=w2)
    for a, b in ((o1, o2), (s1, s2), (c1, c2), (w1, w2)):
        assert torch.equal(a, b)
    assert not torch.equal(c2, d["conv_state"])  # the window moved on


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bv", [4, 8])  # 4: two V-blocks meet on the counter; 8 == V: one program a head
def test_conv_fused_decode(bv, dtype):
    """T = 1, persistent update of the recurrent state and the conv window, output norm, lower-bound gate."""
    d = conv_kda_inputs(1, 3, 8, 8, dtype, seed=bv + (dtype == torch.bfloat16))
    n, t = run_both(d, -5.0, bv, update_state=True, stage=False)
    tol = FP32_TOL if dtype == torch.float32 else BF16_TOL
    torch.testing.assert_close(t["o"], n["o"], **tol)
    torch.testing.assert_close(t["state"], n["state"], **tol)
    assert torch.equal(t["conv"], n["conv"])  # windows are copies of inputs: exact
    check_counters_reset()


@pytest.mark.parametrize("T", [6, 17])
def test_conv_fused_verify_fp32(T):
    """Verify: every position's conv window and recurrent state staged, the persistent states bit-identical."""
    d = conv_kda_inputs(T, 2 if T < 8 else 1, 8, 8, torch.float32, seed=T, max_stage=T + 2)
    n, t = run_both(d, -5.0, 4, nw=1 if T < 8 else 2, update_state=False, stage=True)
    torch.testing.assert_close(t["o"], n["o"], **FP32_TOL)
    assert torch.equal(t["state"], d["state"]) and torch.equal(t["conv"], d["conv_state"])
    assert torch.equal(t["windows"][:T], n["windows"][:T])
    assert t["windows"][T:].isnan().all()
    torch.testing.assert_close(t["staged"][:T], n["staged"][:T], **FP32_TOL)
    assert t["staged"][T:].isnan().all()
    check_counters_reset()


def test_conv_fused_verify_bf16():
    """bf16: against the former two kernels (short_conv_update_kernel, then the recurrence on its output) bit for
    bit in the interpreter (same math, same roundings), and the reference to bf16 tolerance (a 1-ulp flip of a conv
    output against the PyTorch conv moves the 6-token read-out by up to ~2e-2 here)."""
    T = 6
    d = conv_kda_inputs(T, 1, 8, 8, torch.bfloat16, seed=61)
    n, t = run_both(d, -5.0, 4, update_state=False, stage=True)
    assert t["o"].dtype == torch.bfloat16 and t["windows"].dtype == torch.bfloat16
    torch.testing.assert_close(t["o"], n["o"], rtol=3e-2, atol=3e-2)
    assert torch.equal(t["state"], d["state"]) and torch.equal(t["conv"], d["conv_state"])
    assert torch.equal(t["windows"][:T], n["windows"][:T])
    torch.testing.assert_close(t["staged"][:T], n["staged"][:T], **BF16_TOL)

    H, K = d["q"].shape[1:]
    x = torch.cat([d["q"].reshape(T, -1), d["k"].reshape(T, -1), d["v"].reshape(T, -1)], -1)
    windows = torch.full_like(t["windows"], float("nan"))
    y = ts.short_conv_update(x, d["conv_weight"], d["conv_state"].clone(), windows, False)
    q, k, v = (z.view(T, H, -1) for z in y.split([H * K, H * K, H * K], -1))
    staged = torch.full_like(t["staged"], float("nan"))
    o = tk.kda_recurrent_fused(q, k, v, d["f"], d["b"], d["A_log"], d["dt_bias"], -5.0, d["state"].clone(), None,
                               staged, False, d["w"], d["gate"], block_v=4, num_warps=1)
    exact = dict(rtol=0, atol=0) if DEV == "cpu" else BF16_TOL  # compiled, reduction trees may differ
    torch.testing.assert_close(t["o"], o, **exact)
    torch.testing.assert_close(t["staged"][:T], staged[:T], **exact)
    assert torch.equal(t["windows"][:T], windows[:T])


@pytest.mark.parametrize("lower_bound,norm", [(-5.0, True), (None, False)])
def test_conv_fused_extend(lower_bound, norm):
    """Draft / extend: T > 1 with the persistent update (and, as short_conv_update allows, staging as well);
    without the norm the counter serves the q / k windows alone."""
    T = 3
    d = conv_kda_inputs(T, 2, 8, 8, torch.float32, seed=31 + norm)
    n, t = run_both(d, lower_bound, 4, update_state=True, stage=True, norm=norm)
    torch.testing.assert_close(t["o"], n["o"], **FP32_TOL)
    torch.testing.assert_close(t["state"], n["state"], **FP32_TOL)
    assert torch.equal(t["conv"], n["conv"])
    assert torch.equal(t["windows"][:T], n["windows"][:T])
    torch.testing.assert_close(t["staged"][:T], n["staged"][:T], **FP32_TOL)
    torch.testing.assert_close(t["staged"][T - 1], t["state"], rtol=0, atol=0)
    check_counters_reset()


def test_conv_fused_odd_sizes():
    """K != V, neither a power of two, BV not dividing V (three V-blocks, the last one masked); the conv channels
    at 2HK + HV."""
    T, H, K, V = 3, 1, 12, 20
    d = conv_kda_inputs(T, H, K, V, torch.float32, seed=41)
    for update_state, stage in ((False, True), (True, False)):
        n, t = run_both(d, -5.0, 8, update_state=update_state, stage=stage)
        torch.testing.assert_close(t["o"], n["o"], **FP32_TOL)
        torch.testing.assert_close(t["state"], n["state"], **FP32_TOL)
        assert torch.equal(t["conv"], n["conv"])
        if stage:
            assert torch.equal(t["windows"][:T], n["windows"][:T])
            torch.testing.assert_close(t["staged"][:T], n["staged"][:T], **FP32_TOL)
    check_counters_reset()


def test_conv_fused_consecutive_decodes():
    """Three decode steps in a row through the kernel, each from the states the previous one left (the counters
    must be back at zero for the next launch), against the reference doing the same."""
    d = conv_kda_inputs(3, 2, 8, 8, torch.float32, seed=51)
    states = {}
    for fn in (kda_naive.kda_recurrent_fused, tk.kda_recurrent_fused):
        s, c, outs = d["state"].clone(), d["conv_state"].clone(), []
        kw = dict(block_v=4, num_warps=1) if fn is tk.kda_recurrent_fused else {}
        for i in range(3):
            one = {n: d[n][i : i + 1] for n in ("q", "k", "v", "f", "b", "gate")}
            outs.append(fn(one["q"], one["k"], one["v"], one["f"], one["b"], d["A_log"], d["dt_bias"], -5.0, s, None,
                           None, True, d["w"], one["gate"], conv_weight=d["conv_weight"], conv_state=c, **kw))
        states[fn] = (torch.cat(outs), s, c)
    (o_n, s_n, c_n), (o_t, s_t, c_t) = states.values()
    torch.testing.assert_close(o_t, o_n, **FP32_TOL)
    torch.testing.assert_close(s_t, s_n, **FP32_TOL)
    assert torch.equal(c_t, c_n)
    check_counters_reset()


# ---------------------------------------------------------------- the layer


class _Count:
    """A kernel wrapper counting its launches."""

    def __init__(self, kernel) -> None:
        self.kernel, self.launches = kernel, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            return self.kernel[grid](*args, **kwargs)

        return launch


def _layer(device="cpu"):
    cfg = parse_model_config(TINY_LING)
    layer = KimiDeltaAttention(0, cfg, device=device)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * (p.shape[-1] ** -0.5 if p.dim() > 1 else 0.5))
        layer.A_log.copy_(torch.empty(layer.A_log.shape).uniform_(1.0, 16.0, generator=gen).log())
        layer.conv1d.weight.mul_(0.5)
        layer.o_norm.weight.add_(1.0)
    assert layer.lower_bound is not None  # the safe gate, as Ling-3.0-flash
    return layer, cfg


def _layer_forward(layer, cfg, mode, T, fused, seed=7):
    """One forward from a random persistent state; returns (out, persistent states, staged states)."""
    gen = torch.Generator().manual_seed(seed)
    device = layer.A_log.device
    state = layer.make_cache(32, torch.float32, device, max_stage=T + 1)
    state.recurrent.copy_(0.5 * torch.randn(state.recurrent.shape, generator=gen))
    state.conv.copy_(torch.randn(state.conv.shape, generator=gen))
    state.staged_recurrent.fill_(float("nan"))
    state.staged_conv.fill_(float("nan"))
    x = torch.randn(T, cfg.hidden_size, generator=gen).to(device)
    ctx = ForwardContext(mode, torch.arange(10, 10 + T, device=device), ModelCache({0: state}, 32))
    layer.fused_conv_max_tokens = T if fused else 0
    with torch.inference_mode():
        out = layer(x, ctx)
    return out, (state.recurrent, state.conv), (state.staged_recurrent[:T], state.staged_conv[:T])


MODES = [(ForwardMode.DECODE, 1), (ForwardMode.VERIFY, 4), (ForwardMode.EXTEND, 3)]


@pytest.mark.parametrize("mode,T", MODES)
def test_layer_fused_conv_equals_two_calls(mode, T):
    """The layer's fused forward (one call with the conv inside) equals the former short_conv_update + recurrence,
    outputs and every state, in fp32 on the references."""
    layer, cfg = _layer()
    a = _layer_forward(layer, cfg, mode, T, fused=True)
    b = _layer_forward(layer, cfg, mode, T, fused=False)
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, equal_nan=True)
    staged = a[2][0]
    assert staged.isnan().all() != (mode is ForwardMode.VERIFY)  # only verify stages


@pytest.mark.parametrize("mode,T", MODES[:2])  # extend takes decode's path at T > 1 (test_conv_fused_extend)
def test_layer_kernel_launches(mode, T, monkeypatch):
    """The layer through the Triton kernels (interpreted on CPU): fused, ONE kda_recurrent_fused_kernel launch and
    no conv or norm kernel; the two-call form, the conv kernel and the recurrence. Same result to ~1e-6."""
    import baton.layers.kda as layer_mod

    layer, cfg = _layer(DEV)
    ref = _layer_forward(layer, cfg, mode, T, fused=False)  # the references on CPU (the same kernels on CUDA)
    monkeypatch.setattr(layer_mod, "kda_recurrent_fused", tk.kda_recurrent_fused)
    monkeypatch.setattr(layer_mod, "short_conv_update", ts.short_conv_update)
    results, counts = [], []
    for fused in (True, False):
        kernels = {"kda": (tk, "kda_recurrent_fused_kernel"), "norm": (tk, "gated_rms_norm_kernel"),
                   "conv": (ts, "short_conv_update_kernel")}
        wrapped = {}
        for name, (mod, attr) in kernels.items():
            wrapped[name] = _Count(getattr(mod, attr))
            monkeypatch.setattr(mod, attr, wrapped[name])
        results.append(_layer_forward(layer, cfg, mode, T, fused=fused))
        counts.append({name: w.launches for name, w in wrapped.items()})
    assert counts[0] == {"kda": 1, "norm": 0, "conv": 0}
    assert counts[1] == {"kda": 1, "norm": 0, "conv": 1}
    a, b = results
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-6)
    for x, y in zip(a[1] + a[2], b[1] + b[2], strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(a[0], ref[0], **FP32_TOL)
    for x, y in zip(a[1] + a[2], ref[1] + ref[2], strict=True):
        torch.testing.assert_close(x, y, **FP32_TOL, equal_nan=True)
    check_counters_reset()
