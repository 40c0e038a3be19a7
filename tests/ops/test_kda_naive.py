"""Tests for the plain-PyTorch KDA references in ``baton.ops.kda.naive`` (CPU, fp32)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from baton.ops.kda import kda_chunk, kda_decode_step, kda_gate, kda_recurrent, l2norm

H, K, V = 3, 16, 24
TOL = dict(rtol=1e-4, atol=1e-4)


def make_inputs(T: int, lower_bound: float | None, seed: int = 0, with_state: bool = True):
    """Random q, k, v, g (from kda_gate), beta and initial state; all fp32."""
    gen = torch.Generator().manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen)

    q, k, v = randn(T, H, K), randn(T, H, K), randn(T, H, V)
    f = randn(T, H, K)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log()  # Kimi-style A init
    dt_bias = 0.5 * randn(H * K)
    g = kda_gate(f, A_log, dt_bias, lower_bound)  # [T, H, K]
    beta = torch.sigmoid(randn(T, H))  # [T, H]
    S0 = randn(H, K, V) if with_state else None
    return q, k, v, g, beta, S0


GATES = [-5.0, None]


@pytest.mark.parametrize("lower_bound", GATES)
@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("T", [1, 7, 64, 100, 130])
def test_chunk_matches_recurrent(T, chunk_size, with_state, lower_bound):
    q, k, v, g, beta, S0 = make_inputs(T, lower_bound, seed=T, with_state=with_state)
    o_r, s_r = kda_recurrent(q, k, v, g, beta, S0)
    o_c, s_c = kda_chunk(q, k, v, g, beta, S0, chunk_size=chunk_size)
    assert o_c.shape == (T, H, V) and s_c.shape == (H, K, V)
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c, s_r, **TOL)


def test_chunk_strong_decay_no_overflow():
    # g = -5 every step: cumulative decay reaches -320 within a 64-chunk; exp(320) would overflow fp32.
    T = 130
    q, k, v, _, beta, S0 = make_inputs(T, -5.0, seed=1)
    g = torch.full((T, H, K), -5.0)
    o_c, s_c = kda_chunk(q, k, v, g, beta, S0, chunk_size=64)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    o_r, s_r = kda_recurrent(q, k, v, g, beta, S0)
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c, s_r, **TOL)


def test_chunk_no_l2norm_custom_scale():
    q, k, v, g, beta, S0 = make_inputs(40, -5.0, seed=2)
    k = F.normalize(k, dim=-1)  # keep the delta rule stable without in-kernel normalisation
    o_r, s_r = kda_recurrent(q, k, v, g, beta, S0, scale=0.3, use_qk_l2norm=False)
    o_c, s_c = kda_chunk(q, k, v, g, beta, S0, scale=0.3, use_qk_l2norm=False, chunk_size=16)
    torch.testing.assert_close(o_c, o_r, **TOL)
    torch.testing.assert_close(s_c, s_r, **TOL)


@pytest.mark.parametrize("lower_bound", GATES)
def test_recurrent_split(lower_bound):
    T1, T2 = 37, 29
    q, k, v, g, beta, S0 = make_inputs(T1 + T2, lower_bound, seed=3)
    o, s = kda_recurrent(q, k, v, g, beta, S0)
    o1, s1 = kda_recurrent(q[:T1], k[:T1], v[:T1], g[:T1], beta[:T1], S0)
    o2, s2 = kda_recurrent(q[T1:], k[T1:], v[T1:], g[T1:], beta[T1:], s1)
    torch.testing.assert_close(torch.cat([o1, o2]), o, **TOL)
    torch.testing.assert_close(s2, s, **TOL)


@pytest.mark.parametrize("lower_bound", GATES)
def test_chunk_prefix_then_decode(lower_bound):
    T1, T2 = 70, 9
    q, k, v, g, beta, S0 = make_inputs(T1 + T2, lower_bound, seed=4)
    o, s = kda_chunk(q, k, v, g, beta, S0, chunk_size=64)
    o1, state = kda_chunk(q[:T1], k[:T1], v[:T1], g[:T1], beta[:T1], S0, chunk_size=64)
    outs = [o1]
    for t in range(T1, T1 + T2):
        sl = slice(t, t + 1)
        outs.append(kda_decode_step(q[sl], k[sl], v[sl], g[sl], beta[sl], state))
    torch.testing.assert_close(torch.cat(outs), o, **TOL)
    torch.testing.assert_close(state, s, **TOL)


@pytest.mark.parametrize("lower_bound", GATES)
def test_return_states(lower_bound):
    T = 12
    q, k, v, g, beta, S0 = make_inputs(T, lower_bound, seed=5)
    o, s, states = kda_recurrent(q, k, v, g, beta, S0, return_states=True)
    assert states.shape == (T, H, K, V) and states.dtype == torch.float32
    torch.testing.assert_close(states[-1], s)
    o2, s2 = kda_recurrent(q, k, v, g, beta, S0)
    torch.testing.assert_close(o, o2)
    for t in range(T):
        _, s_t = kda_recurrent(q[: t + 1], k[: t + 1], v[: t + 1], g[: t + 1], beta[: t + 1], S0)
        torch.testing.assert_close(states[t], s_t, **TOL)


def _reference_f64(q, k, v, g, beta, S0, scale):
    """Independent float64 loop over tokens and heads (l2norm eps 1e-6 on q and k)."""
    T, nh, dk = q.shape
    dv = v.shape[-1]
    S = [S0[h].double().clone() for h in range(nh)]
    o = torch.zeros(T, nh, dv, dtype=torch.float64)
    for t in range(T):
        for h in range(nh):
            qt = q[t, h].double()
            kt = k[t, h].double()
            qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6) * scale
            kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
            for i in range(dk):
                S[h][i, :] *= math.exp(float(g[t, h, i]))
            pred = torch.zeros(dv, dtype=torch.float64)
            for i in range(dk):
                pred += kt[i] * S[h][i, :]
            u = float(beta[t, h]) * (v[t, h].double() - pred)
            S[h] = S[h] + torch.outer(kt, u)
            for i in range(dk):
                o[t, h] += qt[i] * S[h][i, :]
    return o, torch.stack(S)


@pytest.mark.parametrize("lower_bound", GATES)
def test_recurrent_matches_float64_loop(lower_bound):
    q, k, v, g, beta, S0 = make_inputs(5, lower_bound, seed=6)
    o, s = kda_recurrent(q, k, v, g, beta, S0)
    o_ref, s_ref = _reference_f64(q, k, v, g, beta, S0, scale=K**-0.5)
    torch.testing.assert_close(o.double(), o_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(s.double(), s_ref, rtol=1e-5, atol=1e-5)


def test_gate_lower_bound():
    gen = torch.Generator().manual_seed(7)
    T = 9
    f = torch.randn(T, H, K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H, K, generator=gen)
    g = kda_gate(f, A_log, dt_bias, -5.0)
    assert g.dtype == torch.float32 and g.shape == (T, H, K)
    assert (g > -5.0).all() and (g < 0.0).all()
    expected = torch.empty(T, H, K)
    for h in range(H):
        expected[:, h] = -5.0 * torch.sigmoid(math.exp(A_log[h]) * (f[:, h] + dt_bias[h]))
    torch.testing.assert_close(g, expected)
    # flat [H*K] dt_bias and a bf16 f give the same (fp32) result
    g_flat = kda_gate(f.bfloat16(), A_log, dt_bias.reshape(H * K), -5.0)
    assert g_flat.dtype == torch.float32
    torch.testing.assert_close(g_flat, kda_gate(f.bfloat16().float(), A_log, dt_bias, -5.0))


def test_gate_softplus():
    gen = torch.Generator().manual_seed(8)
    f = torch.randn(4, H, K, generator=gen)
    A_log = torch.randn(H, generator=gen)
    dt_bias = torch.randn(H * K, generator=gen)
    g = kda_gate(f, A_log, dt_bias, None)
    expected = -A_log.exp()[None, :, None] * F.softplus(f + dt_bias.view(H, K))
    torch.testing.assert_close(g, expected)
    assert (g < 0).all()


def test_l2norm():
    x = torch.randn(5, H, K).bfloat16()
    y = l2norm(x)
    assert y.dtype == torch.float32
    xf = x.float()
    torch.testing.assert_close(y, xf / torch.sqrt((xf * xf).sum(-1, keepdim=True) + 1e-6))
    assert torch.equal(l2norm(torch.zeros(2, K)), torch.zeros(2, K))


def test_initial_state_not_mutated_and_decode_mutates():
    q, k, v, g, beta, S0 = make_inputs(20, -5.0, seed=9)
    S0_copy = S0.clone()
    kda_recurrent(q, k, v, g, beta, S0)
    kda_recurrent(q, k, v, g, beta, S0, return_states=True)
    kda_chunk(q, k, v, g, beta, S0, chunk_size=16)
    assert torch.equal(S0, S0_copy)

    state = S0.clone()
    o = kda_decode_step(q[:1], k[:1], v[:1], g[:1], beta[:1], state)
    o_r, s_r = kda_recurrent(q[:1], k[:1], v[:1], g[:1], beta[:1], S0)
    assert o.shape == (1, H, V)
    assert not torch.equal(state, S0)
    torch.testing.assert_close(state, s_r)
    torch.testing.assert_close(o, o_r)


def test_output_dtype_follows_v():
    q, k, v, g, beta, S0 = make_inputs(10, -5.0, seed=10)
    o_r, s_r = kda_recurrent(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, S0)
    o_c, s_c = kda_chunk(q.bfloat16(), k.bfloat16(), v.bfloat16(), g, beta, S0, chunk_size=16)
    assert o_r.dtype == o_c.dtype == torch.bfloat16
    assert s_r.dtype == s_c.dtype == torch.float32
    torch.testing.assert_close(s_c, s_r, **TOL)
