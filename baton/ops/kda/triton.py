"""Fused Triton kernel for the KDA recurrence at decode / verify (T = 1..17 tokens, batch 1).

One launch does, per token, everything between ``in_proj`` and ``o_proj``: optionally the depthwise causal short
conv + SiLU of the raw q|k|v (``conv_weight``; its window updated in place or staged per position), the L2 norm
of q and k, the forget gate (lower-bound or softplus form) from the raw ``f_proj`` output, beta = sigmoid(b), the
decay, the delta-rule update on the fp32 state, the read-out and the output gated RMSNorm. It matches
``short_conv_update`` + ``naive.kda_gate`` + ``naive.kda_recurrent`` (+ ``gated_rms_norm``) to fp32 rounding.
Launches of a KDA decode / verify forward's core: 1 (before: the short conv, the recurrence and, at the
default BV < V, a separate norm: 3).

Design (batch 1, H=32, K=V=128: the state is 2 MiB per layer, bandwidth-light, latency-bound):

- grid = (H, cdiv(V, BV)). The delta rule reduces over K (S^T k, S^T q) and never mixes V columns, so a
  program owns all of K and a BV-wide slice of V: it loads its fp32 state block [K, BV] once, keeps it in
  registers for the T tokens and stores it once (decode) and/or once per token (verify staging). Small BV
  gives more programs (BV=8: 512 CTAs of one warp) at the price of recomputing the per-token q/k conv, norms
  and gate in every V-block; BV is the main tunable (``block_v``), with ``num_warps`` (``default_block_v``
  holds the H200's choice: BV=16 at T=1, BV=8 at T=6, one warp).
- The token loop is unrolled (T is a compile-time constant: one compile each for decode and for verify) and
  software-pipelined by hand: token t+2's raw inputs are loaded and token t+1's are prepared (conv, norms, gate)
  while token t runs, so the in-order warp never waits on a load inside the serial chain.
- Per token the serial chain is two independent K-reductions on the incoming state, then elementwise work:
  kv = S^T (d*k), qs = S^T (d*q), u = beta (v - kv), o = qs + (k.q) u, S = d*S + k u^T (d = exp(g)); the
  same result as the naive order (decay, delta update, read-out) up to fp32 rounding, with one reduction
  fewer on the critical path.
- The short conv (``conv_weight`` [2HK + HV, W], ``conv_state`` [2HK + HV, W-1], the channels q | k | v as
  ``short_conv_update``'s x): the carried window (the last W-1 rows of each of the program's q, k and v
  channels) lives in registers, loaded once from the conv state; token t's raw loads are its one row, as without
  the conv, and its preparation computes silu(sum_j w_j * [window; row]_j) in fp32 (weights held in registers),
  rounds it to x's dtype as the separate conv hands it on, and moves the window on by that row (a first form
  that loaded all W taps of every token two tokens ahead spilled at T = 6: 8 rows a group live instead of 5).
  Verify staging stores each new window into ``conv_windows[t]`` (KDAState.staged_conv's [S, 3P, W-1] layout):
  q and k by the V-block-0 program only, v by each block's owner. The persistent window (``update_state``) is
  written once per channel after the loop: v by its block's owner, q and k, which every V-block of the head
  reads, by the head's last V-block to finish (below).
- The head's V-blocks meet through a per-head ticket counter (``SYNC``: BV < V with the output norm or a
  persistent conv update): each stores its o rows (rounded to the output dtype, as the unfused path hands them
  to the norm), then takes an acq_rel ticket; the last to arrive writes the q / k conv windows, runs the gated
  RMSNorm over the whole V row of every token in place (``gated_rms_norm_kernel``'s math and order: bit-equal to
  the former separate launch) and resets the counter to 0 for the next launch (the project's split-K and
  split-KV pattern: no co-residency needed). With BV >= V one program owns the head: the norm runs per token
  inline, no counter.
- PDL (``BATON_PDL``, compute capability >= 9): constant weights are read before ``gdc_wait``, everything
  a previous kernel may have written after it (the states included: the verify's commit writes them).
- ``update_state=False`` with ``out_states`` is the verify mode: the persistent state is only read and every
  position's post-state goes to ``out_states[t]``; ``update_state=True`` writes the final state back in place
  (each program reads its own block before it writes it, so in place is safe).

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
    "launch_plan",
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
MAX_T = 64  # the token loop is unrolled; designed for T <= 17 (decode 1, verify steps+1)


@triton.jit
def _conv_window(cs_ptr, s_off, m, X_DTYPE: tl.constexpr, W: tl.constexpr):
    """The carried conv window at one channel group: the W-1 columns of the conv state (oldest first), cast to x's
    dtype, as a tuple of vectors."""
    win = ()
    for j in tl.static_range(W - 1):
        win = win + (tl.load(cs_ptr + s_off + j, mask=m, other=0.0).to(X_DTYPE),)
    return win


@triton.jit
def _conv_silu(taps, wts, W: tl.constexpr):
    """silu(sum_j w_j * xp[t + j]) in fp32, rounded to x's dtype (what ``short_conv_update`` hands on)."""
    acc = taps[0].to(tl.float32) * wts[0]
    for j in tl.static_range(1, W):
        acc += taps[j].to(tl.float32) * wts[j]
    return (acc * tl.sigmoid(acc)).to(taps[0].dtype)


@triton.jit
def _conv_weights(cw_ptr, w_off, m, W: tl.constexpr):
    """The W taps of the conv weight at one channel group, fp32 (constants: loaded once, before ``gdc_wait``)."""
    wts = ()
    for j in tl.static_range(W):
        wts = wts + (tl.load(cw_ptr + w_off + j, mask=m, other=0.0).to(tl.float32),)
    return wts


@triton.jit
def _store_window(ptr, off, win, m, W: tl.constexpr):
    """A conv window (W-1 vectors, oldest first) into ``ptr + off + [0, W-1)``."""
    for i in tl.static_range(W - 1):
        tl.store(ptr + off + i, win[i].to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _kda_load_token(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, t, i_h, o_k, m_k, o_v, m_v,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h,
    FUSE_NORM: tl.constexpr,
):
    """Raw loads of token t (issued early; consumed by ``_kda_prep_token`` a token later). With the fused conv,
    q, k and v are the raw rows before it."""
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
def _kda_conv_token(r, win_q, win_k, win_v, wq, wk, wv, t: tl.constexpr, cwin_ptr, stride_cwin_t, cw_q, cw_k, cw_v,
                    m_kw, m_v, CONV: tl.constexpr, CONV_STAGE: tl.constexpr, W: tl.constexpr):
    """Token t's conv (CONV): taps = the carried window (xp rows t .. t+W-2) + token t's raw row; q, k, v =
    silu(conv) of their taps; the window moves on to taps[1:], which CONV_STAGE stores into ``staged_conv[t]``
    (q and k by the V-block-0 program only, ``m_kw``; v by each block's owner). Returns (the prepared raw tuple,
    the three new windows). Without CONV everything passes through."""
    if CONV:
        tq = win_q + (r[0],)
        tk_ = win_k + (r[1],)
        tv = win_v + (r[4],)
        win_q = tq[1:]
        win_k = tk_[1:]
        win_v = tv[1:]
        if CONV_STAGE:
            base = cwin_ptr + t * stride_cwin_t
            _store_window(base, cw_q, win_q, m_kw, W)
            _store_window(base, cw_k, win_k, m_kw, W)
            _store_window(base, cw_v, win_v, m_v, W)
        r = (_conv_silu(tq, wq, W), _conv_silu(tk_, wk, W), r[2], r[3], _conv_silu(tv, wv, W), r[5])
    return r, win_q, win_k, win_v


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
def _gated_norm_rows(o_ptr, gate_ptr, w_ptr, i_h, stride_o_t, stride_o_h, stride_g_t, stride_g_h, eps,
                     T: tl.constexpr, V: tl.constexpr, VP: tl.constexpr, NR: tl.constexpr):
    """The output gated RMSNorm of head i_h's T rows, in place in ``o`` (each row read whole before it is written;
    NR rows a chunk). The same math and order as ``gated_rms_norm_kernel``; o is read past L1 (``.cg``): the
    other V-blocks' programs wrote it."""
    o_n = tl.arange(0, VP)[None, :]  # [1, VP]
    m_n = o_n < V
    w = tl.load(w_ptr + o_n, mask=m_n, other=0.0).to(tl.float32)  # [1, VP]
    for c in tl.static_range(0, T, NR):
        rows = c + tl.arange(0, NR)[:, None]  # [NR, 1]
        m = (rows < T) & m_n  # [NR, VP]
        po = o_ptr + rows * stride_o_t + i_h * stride_o_h + o_n
        x = tl.load(po, mask=m, other=0.0, cache_modifier=".cg").to(tl.float32)
        gt = tl.load(gate_ptr + rows * stride_g_t + i_h * stride_g_h + o_n, mask=m, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, axis=1) / V + eps)  # [NR]
        y = x * rstd[:, None] * w * tl.sigmoid(gt)
        tl.store(po, y.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def kda_recurrent_fused_kernel(
    q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, a_log_ptr, dt_bias_ptr,
    state_ptr, out_states_ptr, o_ptr, w_ptr, gate_ptr,
    cw_ptr, cs_ptr, cwin_ptr, count_ptr,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h,
    stride_o_t, stride_o_h,
    stride_s_h, stride_s_k,
    stride_os_t, stride_os_h, stride_os_k,
    HK, stride_cw_d, stride_cs_d, stride_cwin_t, stride_cwin_d,
    scale, lower_bound, eps,
    T: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_LOWER_BOUND: tl.constexpr, STORE_STATES: tl.constexpr, UPDATE_STATE: tl.constexpr,
    FUSE_NORM: tl.constexpr, NORM_LAST: tl.constexpr, VP: tl.constexpr, NR: tl.constexpr,
    CONV: tl.constexpr, W: tl.constexpr, CONV_STAGE: tl.constexpr, CONV_UPDATE: tl.constexpr,
    SYNC: tl.constexpr, USE_PDL: tl.constexpr,
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
    # conv channels of this head: q rows h*K.., k rows H*K + h*K.., v rows 2*H*K + h*V.. (weight, state, windows)
    c_q = i_h * K + o_k
    c_k = HK + i_h * K + o_k
    c_v = 2 * HK + i_h * V + o_v
    m_kw = m_k & (i_v == 0)  # the q / k staged windows: written by one program of the head
    wq = dt_bias  # placeholders without CONV
    wk = dt_bias
    wv = dt_bias
    if CONV:  # in registers for the whole token loop
        wq = _conv_weights(cw_ptr, c_q * stride_cw_d, m_k, W)
        wk = _conv_weights(cw_ptr, c_k * stride_cw_d, m_k, W)
        wv = _conv_weights(cw_ptr, c_v * stride_cw_d, m_v, W)
    cs_q, cs_k, cs_v = c_q * stride_cs_d, c_k * stride_cs_d, c_v * stride_cs_d
    cw_q, cw_k, cw_v = c_q * stride_cwin_d, c_k * stride_cwin_d, c_v * stride_cwin_d
    if USE_PDL:  # weights above are constants; everything below may come from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # Token t's raw inputs are loaded two tokens ahead and prepared one token ahead, so the in-order warp never
    # waits on a load inside the serial chain. Per token the chain is two independent K-reductions on the
    # incoming state, then elementwise work:
    #   kv = S^T (d*k), qs = S^T (d*q), u = beta (v - kv), o = qs + (k.q) u, S = d*S + k u^T
    # which is the naive order  S = d*S; u = beta (v - S^T k); S += k u^T; o = S^T q  up to fp32 rounding.
    # With CONV the raw loads are the rows before the conv; the preparation runs it over the carried window (the
    # last W-1 rows, in registers), which then moves on by one row.
    r0 = _kda_load_token(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, 0, i_h, o_k, m_k, o_v, m_v,
                         stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                         stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h, FUSE_NORM)
    if T > 1:
        r1 = _kda_load_token(q_ptr, k_ptr, v_ptr, f_ptr, b_ptr, gate_ptr, 1, i_h, o_k, m_k, o_v, m_v,
                             stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
                             stride_f_t, stride_f_h, stride_b_t, stride_b_h, stride_g_t, stride_g_h, FUSE_NORM)
    win_q = dt_bias  # placeholders without CONV
    win_k = dt_bias
    win_v = dt_bias
    if CONV:
        X_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
        win_q = _conv_window(cs_ptr, cs_q, m_k, X_DTYPE, W)
        win_k = _conv_window(cs_ptr, cs_k, m_k, X_DTYPE, W)
        win_v = _conv_window(cs_ptr, cs_v, m_v, X_DTYPE, W)
    s_off = i_h * stride_s_h + o_k[:, None] * stride_s_k + o_v[None, :]  # [BK, BV]
    S = tl.load(state_ptr + s_off, mask=m_kv, other=0.0).to(tl.float32)  # [BK, BV]
    os_off = i_h * stride_os_h + o_k[:, None] * stride_os_k + o_v[None, :]  # [BK, BV]
    c0, win_q, win_k, win_v = _kda_conv_token(r0, win_q, win_k, win_v, wq, wk, wv, 0, cwin_ptr, stride_cwin_t,
                                              cw_q, cw_k, cw_v, m_kw, m_v, CONV, CONV_STAGE, W)
    k, d, dk, dq, kq, beta, v, gt = _kda_prep_token(c0[0], c0[1], c0[2], c0[3], c0[4], c0[5], dt_bias, a, scale,
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
            c1, win_q, win_k, win_v = _kda_conv_token(r1, win_q, win_k, win_v, wq, wk, wv, t + 1, cwin_ptr,
                                                      stride_cwin_t, cw_q, cw_k, cw_v, m_kw, m_v, CONV, CONV_STAGE, W)
            k, d, dk, dq, kq, beta, v, gt = _kda_prep_token(c1[0], c1[1], c1[2], c1[3], c1[4], c1[5], dt_bias, a,
                                                            scale, lower_bound, USE_LOWER_BOUND)
        if t + 2 < T:
            r1 = r2
    if UPDATE_STATE:
        tl.debug_barrier()
        tl.store(state_ptr + s_off, S, mask=m_kv)
    if CONV_UPDATE:  # the window after the last token; v: this program's own channels, read above by it alone
        tl.debug_barrier()
        _store_window(cs_ptr, cs_v, win_v, m_v, W)
    if SYNC:
        # The head's V-blocks meet: each takes a ticket (acq_rel: its o rows and its reads of the conv state come
        # before it); the last to arrive writes the q / k conv windows (every program of the head has read the old
        # ones by then), runs the output norm over the whole V row and resets the counter for the next launch.
        tl.debug_barrier()  # every thread's stores and loads precede the release
        ticket = tl.atomic_add(count_ptr + i_h, 1, sem="acq_rel", scope="gpu")
        if ticket == tl.num_programs(1) - 1:
            tl.debug_barrier()  # and every thread's accesses follow the acquire
            if CONV_UPDATE:
                _store_window(cs_ptr, cs_q, win_q, m_k, W)
                _store_window(cs_ptr, cs_k, win_k, m_k, W)
            if NORM_LAST:
                _gated_norm_rows(o_ptr, gate_ptr, w_ptr, i_h, stride_o_t, stride_o_h, stride_g_t, stride_g_h, eps,
                                 T, V, VP, NR)
            tl.atomic_xchg(count_ptr + i_h, 0)
    elif CONV_UPDATE:  # one program owns the head
        _store_window(cs_ptr, cs_q, win_q, m_k, W)
        _store_window(cs_ptr, cs_k, win_k, m_k, W)


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
    """KDA output norm over the last dim: x, gate [T, H, N] (last dim contiguous), weight [N]. A standalone
    launch; ``kda_recurrent_fused`` no longer calls it (its kernel runs the same math in its epilogue).

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
    BV=8, one warp; a staged verify past 8 tokens BV=16, 2 warps. BV=V (the output norm inline, one program a
    head) was 2-4x slower than BV<V plus the then separate norm kernel. These were measured before the norm moved
    into the last V-block's epilogue and the short conv into the prologue (``conv_weight``): untimed since.
    Retune with ``python -m benchmarks.ops.bench_kda``.

    Compiled for sm_90 with the fused conv at Ling's shapes (bf16; ``python -m benchmarks.ops.sass_kda``), these
    choices have no spills: T=1 221 registers, T=6 249, T=17 219 (without the conv 167 / 128 / 128). BV=16 with
    one warp at T > 1 (a 64-register state tile, 235-249 registers without the conv) spills with it (T=6: 148
    local-memory instructions, T=17: 358); give it 2 warps.
    """
    if T == 1:
        bv, nw = 16, 1
    elif T <= 8 or not staged:
        bv, nw = 8, 1
    else:
        bv, nw = 16, 2
    return min(bv, triton.next_power_of_2(V)), nw


_COUNTERS: dict[tuple[str, int], torch.Tensor] = {}


def _counters(device: torch.device, n: int) -> torch.Tensor:
    """Zeroed int32 per-head tickets [n], one buffer per device and size for the whole process: each launch's last
    V-block program resets its head's counter to 0, and launches on a stream run one after another (a PDL
    successor waits for this grid's completion before it touches anything), so layers, calls and graph replays
    share them."""
    key = (str(device), n)
    buf = _COUNTERS.get(key)
    if buf is None:
        buf = _COUNTERS[key] = torch.zeros(n, dtype=torch.int32, device=device)
    return buf


def _norm_rows(T: int, VP: int, num_warps: int) -> int:
    """Rows a chunk of the last program's output norm: a power of two, at most 32 elements a thread a tensor."""
    rows = max(1, 1024 * num_warps // VP)
    return min(triton.next_power_of_2(T), 1 << (rows.bit_length() - 1))


def launch_plan(
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
    conv_weight: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_windows: torch.Tensor | None = None,
    pdl: bool = False,
) -> tuple[tuple[int, int], tuple, dict]:
    """(grid, positional args, keyword args) of one ``kda_recurrent_fused_kernel`` launch (also what the SASS
    check compiles: benchmarks/ops/sass_kda.py). No checks beyond the kernel's needs; dummies are never
    dereferenced."""
    T, H, K = q.shape
    V = v.shape[-1]
    BV = block_v
    nv = triton.cdiv(V, BV)
    norm = o_norm_weight is not None
    fuse_norm = norm and nv == 1  # one program owns the row: the norm inline, per token
    norm_last = norm and nv > 1  # the last V-block of the head to finish norms the whole row
    conv = conv_weight is not None
    conv_stage = conv and conv_windows is not None
    conv_update = conv and bool(update_state)
    sync = nv > 1 and (norm_last or conv_update)
    norm_w = o_norm_weight if norm else o
    gate_t = gate if norm else o
    os_t = out_states if out_states is not None else state
    os_strides = (os_t.stride(0), os_t.stride(1), os_t.stride(2)) if out_states is not None else (0, 0, 0)
    cw = conv_weight if conv else o
    cs = conv_state if conv else o
    cwin = conv_windows if conv_stage else o
    count = _counters(q.device, H) if sync else o
    width = conv_weight.shape[1] if conv else 1
    VP = triton.next_power_of_2(V)
    args = (
        q, k, v, f, b_logits, A_log, dt_bias,
        state, os_t, o, norm_w, gate_t,
        cw, cs, cwin, count,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        f.stride(0), f.stride(1), b_logits.stride(0), b_logits.stride(1), gate_t.stride(0), gate_t.stride(1),
        o.stride(0), o.stride(1),
        state.stride(0), state.stride(1),
        *os_strides,
        H * K, cw.stride(0) if conv else 0, cs.stride(0) if conv else 0,
        cwin.stride(0) if conv_stage else 0, cwin.stride(1) if conv_stage else 0,
        K**-0.5 if scale is None else float(scale), 0.0 if lower_bound is None else float(lower_bound), float(eps),
    )
    kwargs = dict(
        T=T, K=K, V=V, BK=triton.next_power_of_2(K), BV=BV,
        USE_LOWER_BOUND=lower_bound is not None, STORE_STATES=out_states is not None,
        UPDATE_STATE=bool(update_state), FUSE_NORM=fuse_norm, NORM_LAST=norm_last, VP=VP,
        NR=_norm_rows(T, VP, num_warps), CONV=conv, W=width, CONV_STAGE=conv_stage, CONV_UPDATE=conv_update,
        SYNC=sync, USE_PDL=pdl, num_warps=num_warps, **({"launch_pdl": True} if pdl else {}),
    )
    return (H, nv), args, kwargs


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
    conv_weight: torch.Tensor | None = None,
    conv_state: torch.Tensor | None = None,
    conv_windows: torch.Tensor | None = None,
) -> torch.Tensor:
    """Fused KDA recurrence for T = 1..17 tokens from the raw projections (batch 1), in one launch.

    q, k: [T, H, K] (post short-conv, not yet L2-normalised); v: [T, H, V]; f: [T, H, K] raw ``f_proj``;
    b_logits: [T, H] raw ``b_proj``; A_log: [H]; dt_bias: [H*K]; lower_bound: the safe-gate bound (Ling: -5.0)
    or None for the softplus gate; state: [H, K, V] fp32; scale: None means K ** -0.5.
    out_states: [>=T, H, K, V] fp32, receives the post-state of every position (verify staging).
    update_state: write the final state into ``state`` in place; False leaves it bit-identical.
    o_norm_weight [V] and gate [T, H, V]: apply the output gated RMSNorm (eps ``eps``).
    out: optional [T, H, V] output buffer; block_v / num_warps: tunables (``default_block_v``).

    With ``conv_weight`` [D, W] (D = 2*H*K + H*V: the q, k, v channels in that order, as ``short_conv_update``'s
    x = q|k|v) and ``conv_state`` [D, W-1]: q, k, v are the raw projections BEFORE the short conv, which the
    kernel applies itself (``short_conv_update`` then the recurrence, in one launch); ``update_state`` then also
    writes the window after the last token into ``conv_state``, and ``conv_windows`` [>=T, D, W-1] (verify
    staging, ``KDAState.staged_conv``'s layout) receives the window after every token.

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
    if conv_weight is not None:
        D, W = 2 * H * K + H * V, conv_weight.shape[-1]
        assert conv_state is not None, "the fused conv needs its state"
        assert conv_weight.shape == (D, W) and conv_state.shape == (D, W - 1), (
            f"conv_weight {tuple(conv_weight.shape)} conv_state {tuple(conv_state.shape)} for D={D}")
        assert conv_weight.stride(-1) == 1 and conv_state.stride(-1) == 1
        assert q.dtype == k.dtype == v.dtype, "q, k, v are one projection's q|k|v"
        if conv_windows is not None:
            assert conv_windows.shape[0] >= T and tuple(conv_windows.shape[1:]) == (D, W - 1), (
                tuple(conv_windows.shape))
            assert conv_windows.stride(-1) == 1
    else:
        assert conv_state is None and conv_windows is None, "conv_state / conv_windows need conv_weight"
    if out is None:
        out = torch.empty(T, H, V, dtype=v.dtype, device=v.device)
    assert out.shape == (T, H, V) and out.stride(-1) == 1
    bv, nw = default_block_v(T, H, V, staged=out_states is not None)
    bv = bv if block_v is None else block_v
    nw = nw if num_warps is None else num_warps
    grid, args, kwargs = launch_plan(q, k, v, f, b_logits, A_log, dt_bias, lower_bound, state, scale, out, out_states,
                                     update_state, o_norm_weight, gate, eps, bv, nw, conv_weight, conv_state,
                                     conv_windows, pdl_enabled(q.device))
    kda_recurrent_fused_kernel[grid](*args, **kwargs)  # one launch: conv, recurrence and norm
    return out
