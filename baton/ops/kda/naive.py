"""Plain-PyTorch reference ops for KDA (Kimi Delta Attention), as used in Ling-3.0-flash.

These are the slow, readable references that the fused kernels (Triton / fla) are tested against. Batch is
always 1, so no layout has a batch dimension: tokens are ``[T, H, D]`` and the recurrent state is
``[H, K, V]`` fp32, key-first (fla's default layout). All recurrence math runs in fp32.

Per token t and head h (fla ``naive_recurrent_kda``)::

    q_t, k_t = l2norm(q_t), l2norm(k_t)        # when use_qk_l2norm
    q_t = q_t * scale                          # scale defaults to K ** -0.5
    S = diag(exp(g_t)) @ S                     # decay row k of S by exp(g_t[k])
    u = beta_t * (v_t - S^T k_t)               # delta-rule correction
    S = S + k_t u^T
    o_t = S^T q_t

``kda_chunk`` computes the same thing in chunks with the WY / UT-transform form (fla ``naive_chunk_kda``),
but it only ever exponentiates non-positive log-decay differences, so strong decays cannot overflow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from baton.ops.rmsnorm.naive import gated_rms_norm
from baton.ops.short_conv.naive import short_conv_update

__all__ = ["kda_chunk", "kda_decode_step", "kda_gate", "kda_recurrent", "kda_recurrent_fused", "l2norm"]


def kda_gate(
    f: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    lower_bound: float | None,
) -> torch.Tensor:
    """Forget-gate log-decays from the ``f_proj`` pre-activation.

    f: [T, H, K] (any float dtype); A_log: [H]; dt_bias: [H*K] or [H, K]. Returns fp32 g: [T, H, K].

    With ``lower_bound`` (the "safe gate"; Ling uses -5.0):
    ``g = lower_bound * sigmoid(exp(A_log[h]) * (f + dt_bias[h]))``, so g lies in (lower_bound, 0).
    With ``lower_bound=None`` (Kimi-Linear form): ``g = -exp(A_log[h]) * softplus(f + dt_bias[h])``.
    """
    T, H, K = f.shape
    x = f.float() + dt_bias.float().reshape(H, K)  # [T, H, K]
    a = A_log.float().exp().reshape(1, H, 1)  # [1, H, 1]
    if lower_bound is None:
        return -a * F.softplus(x)  # [T, H, K]
    return lower_bound * torch.sigmoid(a * x)  # [T, H, K]


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2, -1) + eps)`` over the last dim, computed and returned in fp32 (fla's l2norm)."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _prep(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Checks shapes and returns fp32 (q*scale, k, v, g, beta, S0); S0 is always a fresh tensor."""
    T, H, K = q.shape
    V = v.shape[-1]
    assert k.shape == (T, H, K), f"k {tuple(k.shape)} != {(T, H, K)}"
    assert v.shape == (T, H, V), f"v {tuple(v.shape)} != {(T, H, V)}"
    assert g.shape == (T, H, K), f"g {tuple(g.shape)} != {(T, H, K)}"
    assert beta.shape == (T, H), f"beta {tuple(beta.shape)} != {(T, H)}"
    if scale is None:
        scale = K**-0.5
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)  # [T, H, K] fp32
    q = q.float() * scale  # [T, H, K]
    k = k.float()  # [T, H, K]
    if initial_state is None:
        S0 = q.new_zeros(H, K, V)  # [H, K, V]
    else:
        assert initial_state.shape == (H, K, V), f"initial_state {tuple(initial_state.shape)} != {(H, K, V)}"
        S0 = initial_state.detach().to(device=q.device, dtype=torch.float32).clone()  # [H, K, V]
    return q, k, v.float(), g.float(), beta.float(), S0


def kda_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    return_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token-by-token KDA recurrence (fla ``naive_recurrent_kda``).

    q, k: [T, H, K]; v: [T, H, V]; g: [T, H, K] fp32 log-decays; beta: [T, H] (already sigmoided);
    initial_state: [H, K, V] fp32 or None (zeros); it is never modified.

    Returns ``(o, final_state)``: o [T, H, V] in v's dtype, final_state [H, K, V] fp32. With
    ``return_states`` also returns states [T, H, K, V] fp32, the state after each token (what speculative
    verify stages per draft position); ``states[-1]`` equals ``final_state``.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    qf, kf, vf, gf, bf, S = _prep(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)
    o = vf.new_empty(T, H, V)  # [T, H, V]
    states = vf.new_empty(T, H, K, V) if return_states else None  # [T, H, K, V]
    for t in range(T):
        S = S * gf[t].exp().unsqueeze(-1)  # [H, K, V]: row k scaled by exp(g_t[k])
        kv = torch.einsum("hkv,hk->hv", S, kf[t])  # [H, V]: S^T k_t
        u = bf[t].unsqueeze(-1) * (vf[t] - kv)  # [H, V]
        S = S + kf[t].unsqueeze(-1) * u.unsqueeze(-2)  # [H, K, V]: S + k_t u^T
        o[t] = torch.einsum("hkv,hk->hv", S, qf[t])  # [H, V]: S^T q_t
        if states is not None:
            states[t] = S
    o = o.to(v.dtype)
    if states is not None:
        return o, S, states
    return o, S


def kda_chunk(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked-parallel KDA (WY / UT-transform form, as fla ``naive_chunk_kda``); same result as
    ``kda_recurrent``. Same arguments and returns (without ``return_states``); T need not be a multiple of
    ``chunk_size``.

    Inside a chunk of C tokens starting from state S0, let G_i = sum_{s<=i} g_s (per key channel). Unrolling
    the recurrence gives

        S_i = diag(exp(G_i)) S0 + sum_{j<=i} diag(exp(G_i - G_j)) k_j u_j^T
        u_i = beta_i (v_i - S0^T (exp(G_i) * k_i) - sum_{j<i} M_ij u_j),
              M_ij = sum_c k_i[c] k_j[c] exp(G_i[c] - G_j[c])

    so with L = I + diag(beta) tril(M, -1) (unit lower-triangular):

        U = L^-1 (beta * V) - L^-1 (beta * exp(G) * K) S0 = U~ - W S0
        O = (exp(G) * Q) S0 + tril(A) U,  A_ij = sum_c q_i[c] k_j[c] exp(G_i[c] - G_j[c])
        S_C = diag(exp(G_last)) S0 + (exp(G_last - G) * K)^T U

    Every exponent is G_i - G_j with i >= j, or G_i itself, which is <= 0 for a decaying gate; the j > i
    entries are masked to -inf before ``exp``, so nothing overflows however strong the decay is.
    """
    T, H, K = q.shape
    V = v.shape[-1]
    C = chunk_size
    qf, kf, vf, gf, bf, S = _prep(q, k, v, g, beta, initial_state, scale, use_qk_l2norm)

    # Pad T up to a multiple of C. Padded tokens have k = 0, beta = 0 and g = 0: they leave the state
    # unchanged and their outputs are dropped.
    NT = (T + C - 1) // C
    pad = NT * C - T

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [T, H, *D] -> [NT, H, C, *D]
        x = torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x
        return x.reshape(NT, C, *x.shape[1:]).transpose(1, 2)

    qc, kc, vc, gc, bc = chunks(qf), chunks(kf), chunks(vf), chunks(gf), chunks(bf)
    # qc, kc, gc: [NT, H, C, K]; vc: [NT, H, C, V]; bc: [NT, H, C]
    gc = gc.cumsum(-2)  # [NT, H, C, K]: G_i, cumulative log-decay within the chunk

    strict = torch.ones(C, C, dtype=torch.bool, device=qf.device).triu(1)  # [C, C]: True where j > i
    eye = torch.eye(C, dtype=torch.float32, device=qf.device)  # [C, C]

    o = vf.new_empty(NT, H, C, V)  # [NT, H, C, V]
    for n in range(NT):
        q_n, k_n, v_n, g_n, b_n = qc[n], kc[n], vc[n], gc[n], bc[n]  # [H, C, K|V] / [H, C]

        # decay[h, i, j, c] = exp(G_i[c] - G_j[c]) for j <= i, else 0.
        diff = g_n.unsqueeze(-2) - g_n.unsqueeze(-3)  # [H, C, C, K]
        decay = diff.masked_fill(strict.unsqueeze(-1), float("-inf")).exp()  # [H, C, C, K]

        # Intra-chunk delta-rule system, solved by forward substitution (UT transform).
        M = torch.einsum("hic,hjc,hijc->hij", k_n, k_n, decay)  # [H, C, C]
        L = eye + b_n.unsqueeze(-1) * M.tril(-1)  # [H, C, C], unit lower-triangular
        k_dec = g_n.exp() * k_n  # [H, C, K]: exp(G_i) * k_i
        rhs = b_n.unsqueeze(-1) * torch.cat([v_n, k_dec], dim=-1)  # [H, C, V+K]
        sol = torch.linalg.solve_triangular(L, rhs, upper=False, unitriangular=True)  # [H, C, V+K]
        u_tilde, w = sol[..., :V], sol[..., V:]  # [H, C, V], [H, C, K]

        # Inter-chunk: correct with the incoming state, read out, then pass the state on.
        u = u_tilde - w @ S  # [H, C, V]
        A = torch.einsum("hic,hjc,hijc->hij", q_n, k_n, decay)  # [H, C, C], zero above the diagonal
        o[n] = (g_n.exp() * q_n) @ S + A @ u  # [H, C, V]
        g_last = g_n[:, -1:, :]  # [H, 1, K]
        k_to_end = (g_last - g_n).exp() * k_n  # [H, C, K]: exp(G_last - G_j) * k_j
        S = g_last.transpose(-1, -2).exp() * S + k_to_end.transpose(-1, -2) @ u  # [H, K, V]

    o = o.transpose(1, 2).reshape(NT * C, H, V)[:T]  # [T, H, V]
    return o.to(v.dtype), S


def kda_decode_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    scale: float | None = None,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One decode token (T = 1). q, k, g: [1, H, K]; v: [1, H, V]; beta: [1, H]; state: [H, K, V] fp32,
    the persistent slot, which is updated IN PLACE. Returns o: [1, H, V] in v's dtype.
    """
    assert q.shape[0] == 1, f"kda_decode_step takes one token, got T={q.shape[0]}"
    o, final_state = kda_recurrent(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm)
    state.copy_(final_state)
    return o


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
    """Reference for the fused decode / verify kernel (``baton.ops.kda.triton.kda_recurrent_fused``), same
    signature: ``kda_gate`` + sigmoid(b) + ``kda_recurrent`` (L2-normalised q, k) [+ ``gated_rms_norm``].

    q, k, f: [T, H, K] (f is the raw ``f_proj`` output); v: [T, H, V]; b_logits: [T, H] raw; state [H, K, V]
    fp32. ``out_states[:T]`` (fp32) receives every position's post-state; ``update_state`` writes the final
    state into ``state``. With ``o_norm_weight`` [V] and ``gate`` [T, H, V] the output is gated-RMS-normed.
    ``block_v`` / ``num_warps`` are the kernel's tunables, ignored here. Returns o [T, H, V] in v's dtype.

    With ``conv_weight`` [D, W] and ``conv_state`` [D, W-1] (D = 2*H*K + H*V), q, k, v are the raw projections
    before the short conv: first ``short_conv_update`` over x = q|k|v (staging the per-token windows into
    ``conv_windows`` and, with ``update_state``, writing the last one into ``conv_state``), then the above.
    """
    T, H, K = q.shape
    if conv_weight is not None:
        x = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)  # [T, D]
        y = short_conv_update(x, conv_weight, conv_state, conv_windows, update_state)
        q, k, v = (z.view(T, H, -1) for z in y.split([H * K, H * K, v.shape[1] * v.shape[2]], dim=-1))
    else:
        assert conv_state is None and conv_windows is None, "conv_state / conv_windows need conv_weight"
    g = kda_gate(f, A_log, dt_bias, lower_bound)  # [T, H, K] fp32
    beta = torch.sigmoid(b_logits.float())  # [T, H]
    o, final, states = kda_recurrent(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=True, return_states=True)
    if out_states is not None:
        out_states[:T].copy_(states)
    if update_state:
        state.copy_(final)
    if o_norm_weight is not None:
        assert gate is not None, "the output norm needs the gate"
        o = gated_rms_norm(o, gate, o_norm_weight, eps)
    if out is not None:
        return out.copy_(o)
    return o
