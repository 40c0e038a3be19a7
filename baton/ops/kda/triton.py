"""Fused Triton kernel for the KDA recurrence at decode / verify (T = 1..16 tokens, batch 1).

One launch does, per token, everything between the short conv and ``o_proj``: the L2 norm of q and k, the
forget gate (lower-bound or softplus form) from the raw ``f_proj`` output, beta = sigmoid(b), the decay, the
delta-rule update on the fp32 state, the read-out and, when one program owns a whole head row (BV == V), the
output gated RMSNorm. It matches ``naive.kda_gate`` + ``naive.kda_recurrent`` (+ ``gated_rms_norm``) to fp32
rounding.

Design (batch 1, H=32, K=V=128: the state is 2 MiB per layer, bandwidth-light, latency-bound):

- grid = (H, cdiv(V, BV)). The delta rule reduces over K (S^T k, S^T q) and never mixes V columns, so a
  program owns all of K and a BV-wide slice of V: it loads its fp32 state block [K, BV] once, keeps it in
  registers for the T tokens and stores it once (decode) and/or once per token (verify staging). Small BV
  gives more programs (BV=8: 512 CTAs of one warp) at the price of recomputing the per-token q/k norms and
  the gate in every V-block; BV is the main tunable (``block_v``), with ``num_warps`` (``default_block_v``
  holds the H200's choice: BV=16 at T=1, BV=8 at T=6, one warp).
- The token loop is unrolled (T is a compile-time constant: one compile each for decode and for verify) and
  software-pipelined by hand: token t+2's raw inputs are loaded and token t+1's are prepared (norms, gate)
  while token t runs, so the in-order warp never waits on a load inside the serial chain.
- Per token the serial chain is two independent K-reductions on the incoming state, then elementwise work:
  kv = S^T (d*k), qs = S^T (d*q), u = beta (v - kv), o = qs + (k.q) u, S = d*S + k u^T (d = exp(g)); the
  same result as the naive order (decay, delta update, read-out) up to fp32 rounding, with one reduction
  fewer on the critical path.
- PDL (``BATON_PDL``, compute capability >= 9): constant weights are read before ``gdc_wait``, everything
  a previous kernel may have written after it.
- ``update_state=False`` with ``out_states`` is the verify mode: the persistent state is only read and every
  position's post-state goes to ``out_states[t]``; ``update_state=True`` writes the final state back in place
  (each program reads its own block before it writes it, so in place is safe).
- The fused gated RMSNorm needs the whole V row; with BV < V it runs in a second small kernel
  (``gated_rms_norm_fwd``). Before the norm, o is rounded to the output dtype exactly as the unfused path does.

Layouts: q, k, f, gate [T, H, K|V] and b_logits [T, H] may be strided views of a wider projection output
(only the last dim must be contiguous); state [H, K, V] and out_states [>=T, H, K, V] fp32 with contiguous V.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from baton.env import use_pdl

__all__ = [
    "default_block_v",
    "gated_rms_norm_fwd",
    "kda_recurrent_fused",
    "kda_recurrent_fused_fwd",
    "pdl_enabled",
]


@functools.cache
def _pdl_capable(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Launch with programmatic dependent launch: CUDA, compute capability >= 9 and ``BATON_PDL`` on. Kernels
    then wait (``gdc_wait``) for the previous kernel before touching anything it may have written."""
    return _pdl_capable(device) and use_pdl()


L2_EPS = 1e-6  # fla l2norm eps, used inside the kernel for q and k
MAX_T = 64  # the token loop is unrolled; designed for T <= 16 (decode 1, verify steps+1)


@triton.jit
def _kda_load_token(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, t, i_h, o_k, m_k, o_v, m_v,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h,
    FUSE_NORM: tl.constexpr,
):
    """Raw loads of token t (issued early; consumed by ``_kda_prep_token`` a token later)."""
    q = tl.load(q_ptr + t * stride_q_t + i_h * stride_q_h + o_k, mask=m_k, other=0.0)  # [BK]
    k = tl.load(k_ptr + t * stride_k_t + i_h * stride_k_h + o_k, mask=m_k, other=0.0)  # [BK]
    f = tl.load(f_ptr + t * stride_f_t + i_h * stride_f_h + o_k, mask=m_k, other=0.0)  # [BK]
    b = tl.load(b_ptr + t * stride_b_t + i_h * stride_b_h)
    v = tl.load(v_ptr + t * stride_v_t + i_h * stride_v_h + o_v, mask=m_v, other=0.0)  # [BV]
    if FUSE_NORM:
        gt = tl.load(gate_ptr + t * stride_g_t + i_h * stride_g_h + o_v, mask=m_v, other=0.0)  # [BV]
    else:
        gt = v
    return q, k, f, b, v, gt


@triton.jit
def _kda_prep_token(q, k, f, b, v, gt, dt_bias, a, scale, lower_bound, USE_LOWER_BOUND: tl.constexpr):
    """fp32 per-token terms: k, exp(g), exp(g)*k, exp(g)*q*scale, k.(q*scale), beta, v, gate (q, k L2-normed)."""
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale  # L2_EPS
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    x = f.to(tl.float32) + dt_bias  # [BK]
    if USE_LOWER_BOUND:
        g = lower_bound * tl.sigmoid(a * x)
    else:
        g = -a * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(x)))  # softplus, torch's threshold 20
    d = tl.exp(g)  # [BK]
    kq = tl.sum(k * q, axis=0)
    return k, d, d * k, d * q, kq, tl.sigmoid(b.to(tl.float32)), v.to(tl.float32), gt.to(tl.float32)


@triton.jit
def kda_recurrent_fused_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
    state_ptr, out_states_ptr, o_ptr, w_ptr, gate_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h,
    stride_o_t, stride_o_h,
    stride_s_h, stride_s_k,
    stride_os_t, stride_os_h, stride_os_k,
    scale, lower_bound, eps,
    T: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, STORE_STATES: tl.constexpr, UPDATE_STATE: tl.constexpr,
    FUSE_NORM: tl.constexpr, USE_PDL: tl.constexpr,
):
    i_h = tl.program_id(0)
    i_v = tl.program_id(1)
    o_k = tl.arange(0, BK)  # [BK]
    o_v = i_v * BV + tl.arange(0, BV)  # [BV]
    m_k = o_k < K
    m_v = o_v < V
    m_kv = m_k[:, None] & m_v[None, :]  # [BK, BV]

    dt_bias = tl.load(dt_bias_ptr + i_h * K + o_k, mask=m_k, other=0.0).to(tl.float32)  # [BK]
    a = tl.exp(tl.load(a_log_ptr + i_h).to(tl.float32))
    if FUSE_NORM:
        w = tl.load(w_ptr + o_v, mask=m_v, other=0.0).to(tl.float32)  # [BV]
    if USE_PDL:  # weights above are constants; everything below may come from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # Token t's raw inputs are loaded two tokens ahead and prepared one token ahead, so the in-order warp never
    # waits on a load inside the serial chain. Per token the chain is two independent K-reductions on the
    # incoming state, then elementwise work:
    #   kv = S^T (d*k), qs = S^T (d*q), u = beta (v - kv), o = qs + (k.q) u, S = d*S + k u^T
    # which is the naive order  S = d*S; u = beta (v - S^T k); S += k u^T; o = S^T q  up to fp32 rounding.
    r0 = _kda_load_token(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, 0, i_h, o_k, m_k, o_v, m_v,
                         stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                         stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h, FUSE_NORM)
    if T > 1:
        r1 = _kda_load_token(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, 1, i_h, o_k, m_k, o_v, m_v,
                             stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                             stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h, FUSE_NORM)
    s_off = i_h * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :]  # [BK, BV]
    S = tl.load(state_ptr + s_off, mask=m_kv, other=0.0).to(tl.float32)  # [BK, BV]
    os_off = i_h * stride_os_h + o_k[:, None] * stride_os_k + o_v[None, :]  # [BK, BV]
    k, d, dk, dq, kq, beta, v, gt = _kda_prep_token(r0[0], r0[1], r0[2], r0[3], r0[4], r0[5], dt_bias, a, scale,
                                                    lower_bound, USE_LOWER_BOUND)
    for t in tl.static_range(T):
        if t + 2 < T:
            r2 = _kda_load_token(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, t + 2, i_h, o_k, m_k, o_v, m_v,
                                 stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                                 stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h, FUSE_NORM)
        kv = tl.sum(S * dk[:, None], axis=0)  # [BV]: (d*S)^T k_t
        qs = tl.sum(S * dq[:, None], axis=0)  # [BV]: (d*S)^T q_t
        u = beta * (v - kv)  # [BV]
        o = qs + kq * u  # [BV]: S_t^T q_t
        S = S * d[:, None] + k[:, None] * u[None, :]  # S_t = d*S + k_t u^T
        if STORE_STATES:
            tl.store(out_states_ptr + t * stride_os_t + os_off, S, mask=m_kv)
        if FUSE_NORM:
            o = o.to(o_ptr.dtype.element_ty).to(tl.float32)  # same rounding as the unfused path
            o = tl.where(m_v, o, 0.0)
            rstd = tl.rsqrt(tl.sum(o * o, axis=0) / V + eps)
            o = o * rstd * w * tl.sigmoid(gt)
        tl.store(o_ptr + t * stride_o_t + i_h * stride_o_h + o_v, o.to(o_ptr.dtype.element_ty), mask=m_v)
        if t + 1 < T:
            k, d, dk, dq, kq, beta, v, gt = _kda_prep_token(r1[0], r1[1], r1[2], r1[3], r1[4], r1[5], dt_bias, a,
                                                            scale, lower_bound, USE_LOWER_BOUND)
        if t + 2 < T:
            r1 = r2
    if UPDATE_STATE:
        tl.debug_barrier()
        tl.store(state_ptr + s_off, S, mask=m_kv)


@triton.jit
def gated_rms_norm_kernel(
    x_ptr, gate_ptr, w_ptr, y_ptr,
    H,
    stride_x_t, stride_x_h, stride_g_t, stride_g_h, stride_y_t, stride_y_h,
    eps,
    N: tl.constexpr, BN: tl.constexpr, USE_PDL: tl.constexpr,
):
    """One program per (t, h) row: y = x * rsqrt(mean(x^2) + eps) * w * sigmoid(gate), all in fp32."""
    row = tl.program_id(0)
    i_t = row // H
    i_h = row % H
    o_n = tl.arange(0, BN)
    m_n = o_n < N
    w = tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    x = tl.load(x_ptr + i_t * stride_x_t + i_h * stride_x_h + o_n, mask=m_n, other=0.0).to(tl.float32)
    gt = tl.load(gate_ptr + i_t * stride_g_t + i_h * stride_g_h + o_n, mask=m_n, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    y = x * rstd * w * tl.sigmoid(gt)
    tl.store(y_ptr + i_t * stride_y_t + i_h * stride_y_h + o_n, y.to(y_ptr.dtype.element_ty), mask=m_n)


def gated_rms_norm_fwd(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """KDA output norm over the last dim: x, gate [T, H, N] (last dim contiguous), weight [N].

    Returns y [T, H, N] in x's dtype (``out`` may be ``x`` itself: each row is read before it is written).
    Same math as ``baton.ops.rmsnorm.naive.gated_rms_norm``.
    """
    T, H, N = x.shape
    assert gate.shape == (T, H, N) and weight.shape == (N,), f"gate {tuple(gate.shape)} weight {tuple(weight.shape)}"
    assert x.stride(-1) == 1 and gate.stride(-1) == 1 and weight.stride(-1) == 1
    y = torch.empty_like(x) if out is None else out
    assert y.shape == (T, H, N) and y.stride(-1) == 1
    pdl = pdl_enabled(x.device)
    gated_rms_norm_kernel[(T * H,)](
        x, gate, weight, y,
        H,
        x.stride(0), x.stride(1), gate.stride(0), gate.stride(1), y.stride(0), y.stride(1),
        eps,
        N=N, BN=triton.next_power_of_2(N),
        USE_PDL=pdl, num_warps=1 if N <= 256 else 4, **({"launch_pdl": True} if pdl else {}),
    )
    return y


def default_block_v(T: int, H: int, V: int, staged: bool = False) -> tuple[int, int]:
    """(BV, num_warps) used when the caller passes none: the fastest of the H200 sweep at Ling's shapes (H=32,
    K=V=128; the figures are in docs/performance.md): decode BV=16, one warp; up to 8 tokens, or without staging,
    BV=8, one warp; a staged verify past 8 tokens BV=16, 2 warps. BV=V (the output norm fused) was 2-4x slower
    than BV<V plus the separate norm kernel.
    Retune with ``python -m benchmarks.ops.bench_kda``.
    """
    if T == 1:
        bv, nw = 16, 1
    elif T <= 8 or not staged:
        bv, nw = 8, 1
    else:
        bv, nw = 16, 2
    return min(bv, triton.next_power_of_2(V)), nw


def kda_recurrent_fused_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    state: torch.Tensor,
    scale: float | None,
    o: torch.Tensor,
    out_states: torch.Tensor | None,
    update_state: bool,
    o_norm_weight: torch.Tensor | None,
    gate: torch.Tensor | None,
    eps: float,
    block_v: int,
    num_warps: int,
) -> None:
    """Launches ``kda_recurrent_fused_kernel`` into ``o`` [T, H, V]; no checks beyond the kernel's needs."""
    T, H, K = q.shape
    V = v.shape[-1]
    BV = block_v
    fuse_norm = o_norm_weight is not None and BV >= V
    norm_w = o_norm_weight if fuse_norm else o  # dummies are never dereferenced
    gate_t = gate if fuse_norm else o
    os_t = out_states if out_states is not None else state
    os_strides = (os_t.stride(0), os_t.stride(1), os_t.stride(2)) if out_states is not None else (0, 0, 0)
    grid = (H, triton.cdiv(V, BV))
    pdl = pdl_enabled(q.device)
    kda_recurrent_fused_kernel[grid](
        q, k, v, f, b_logits, A_log, dt_bias,
        state, os_t, o, norm_w, gate_t,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        f.stride(0), f.stride(1), b_logits.stride(0), b_logits.stride(1), gate_t.stride(0), gate_t.stride(1),
        o.stride(0), o.stride(1),
        state.stride(0), state.stride(1),
        *os_strides,
        K**-0.5 if scale is None else float(scale), 0.0 if lower_bound is None else float(lower_bound), float(eps),
        T=T, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        USE_LOWER_BOUND=lower_bound is not None, STORE_STATES=out_states is not None,
        UPDATE_STATE=bool(update_state), FUSE_NORM=fuse_norm, USE_PDL=pdl,
        num_warps=num_warps, **({"launch_pdl": True} if pdl else {}),
    )
    if o_norm_weight is not None and not fuse_norm:
        gated_rms_norm_fwd(o, gate, o_norm_weight, eps, out=o)


def kda_recurrent_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    f: torch.Tensor,
    b_logits: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
    state: torch.Tensor,
    scale: float | None,
    out_states: torch.Tensor | None = None,
    update_state: bool = True,
    o_norm_weight: torch.Tensor | None = None,
    gate: torch.Tensor | None = None,
    eps: float = 1e-6,
    *,
    out: torch.Tensor | None = None,
    block_v: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Fused KDA recurrence for T = 1..16 tokens from the raw projections (batch 1).

    q, k: [T, H, K] (post short-conv, not yet L2-normalised); v: [T, H, V]; f: [T, H, K] raw ``f_proj``;
    b_logits: [T, H] raw ``b_proj``; A_log: [H]; dt_bias: [H*K]; lower_bound: the safe-gate bound (Ling: -5.0)
    or None for the softplus gate; state: [H, K, V] fp32; scale: None means K ** -0.5.
    out_states: [>=T, H, K, V] fp32, receives the post-state of every position (verify staging).
    update_state: write the final state into ``state`` in place; False leaves it bit-identical.
    o_norm_weight [V] and gate [T, H, V]: apply the output gated RMSNorm (eps ``eps``).
    out: optional [T, H, V] output buffer; block_v / num_warps: tunables (``default_block_v``).

    Returns o: [T, H, V] in v's dtype (normed and gated when ``o_norm_weight`` is given).
    """
    T, H, K = q.shape
    V = v.shape[-1]
    assert 1 <= T <= MAX_T, f"kda_recurrent_fused handles 1..{MAX_T} tokens, got T={T}"
    assert k.shape == (T, H, K) and f.shape == (T, H, K), f"k {tuple(k.shape)} f {tuple(f.shape)}"
    assert v.shape == (T, H, V) and b_logits.shape == (T, H), f"v {tuple(v.shape)} b {tuple(b_logits.shape)}"
    assert A_log.numel() == H and dt_bias.numel() == H * K
    assert state.shape == (H, K, V) and state.dtype == torch.float32 and state.stride(-1) == 1
    for name, x in (("q", q), ("k", k), ("v", v), ("f", f), ("b_logits", b_logits)):
        assert x.stride(-1) == 1, f"{name} needs a contiguous last dim"
    A_log, dt_bias = A_log.contiguous(), dt_bias.contiguous()
    if out_states is not None:
        assert out_states.shape[0] >= T and tuple(out_states.shape[1:]) == (H, K, V), tuple(out_states.shape)
        assert out_states.dtype == torch.float32 and out_states.stride(-1) == 1
    if o_norm_weight is not None:
        assert gate is not None and gate.shape == (T, H, V) and gate.stride(-1) == 1
        assert o_norm_weight.shape == (V,)
        o_norm_weight = o_norm_weight.contiguous()
    if out is None:
        out = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    assert out.shape == (T, H, V) and out.stride(-1) == 1
    bv, nw = default_block_v(T, H, V, staged=out_states is not None)
    bv = bv if block_v is None else block_v
    nw = nw if num_warps is None else num_warps
    kda_recurrent_fused_fwd(q, k, v, f, b_logits, A_log, dt_bias, lower_bound, state, scale, out, out_states,
                            update_state, o_norm_weight, gate, eps, bv, nw)
    return out
