"""Triton depthwise causal short convolution + SiLU over a carried window, for decode / verify (T = 1..16).

Matches ``naive.short_conv``: output t is ``silu(sum_j w[d, j] * xp[t + j, d])`` where ``xp`` is the carried
window (``conv_state [D, W-1]``, oldest first, cast to x's dtype) followed by the T new rows of x. The window
after token t is ``xp[t+1 : t+W]``.

Design: grid = cdiv(D, BD); a program owns BD channels and all T tokens as [BT, BD] tiles (coalesced along
D). The W shifted tiles xp[t + j] are loaded before any store, so they are all in flight together; then it
writes y [T, D], optionally every post-token window (``out_windows [>=T, D, W-1]``, verify staging; re-read
from L1) and optionally the final window back into ``conv_state`` in place (after a CTA barrier: the
program's own reads of that block come first).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton.ops.kda.triton import pdl_enabled

__all__ = ["short_conv_update", "short_conv_update_fwd"]

MAX_T = 64  # T is a compile-time constant (one compile for decode, one for verify)


@triton.jit
def _gather_xp(x_ptr, state_ptr, r, d, m, stride_x_t, stride_s_d, X_DTYPE: tl.constexpr, WM1: tl.constexpr):
    """xp[r, d] for int tensors r (rows; r < W-1: carried state, else x[r - (W-1)]) and d, as fp32."""
    from_state = r < WM1
    s = tl.load(state_ptr + d * stride_s_d + r, mask=m & from_state, other=0.0)
    xv = tl.load(x_ptr + (r - WM1) * stride_x_t + d, mask=m & (r >= WM1), other=0.0)
    return tl.where(from_state, s.to(X_DTYPE), xv.to(X_DTYPE)).to(tl.float32)


@triton.jit
def short_conv_update_kernel(
    x_ptr, w_ptr, state_ptr, y_ptr, win_ptr,
    D,
    stride_x_t, stride_w_d, stride_s_d, stride_y_t, stride_win_t, stride_win_d,
    T: tl.constexpr, W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr, BW1: tl.constexpr,
    STORE_WINDOWS: tl.constexpr, UPDATE_STATE: tl.constexpr, USE_PDL: tl.constexpr,
):
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    WM1: tl.constexpr = W - 1
    i_d = tl.program_id(0)
    o_t = tl.arange(0, BT)[:, None]  # [BT, 1]
    o_d = i_d * BD + tl.arange(0, BD)[None, :]  # [1, BD]
    m_d = o_d < D
    m = (o_t < T) & m_d  # [BT, BD]
    if USE_PDL:  # x and the state may come from the previous kernel
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()

    # Conv: all loads first (no store in between, so they are all in flight together).
    acc = tl.zeros([BT, BD], dtype=tl.float32)
    for j in tl.static_range(W):
        w_j = tl.load(w_ptr + o_d * stride_w_d + j, mask=m_d, other=0.0).to(tl.float32)  # [1, BD]
        acc += w_j * _gather_xp(x_ptr, state_ptr, o_t + j, o_d, m, stride_x_t, stride_s_d, X_DTYPE, WM1)
    y = acc * tl.sigmoid(acc)  # SiLU
    tl.store(y_ptr + o_t * stride_y_t + o_d, y.to(y_ptr.dtype.element_ty), mask=m)

    if STORE_WINDOWS:  # window after token t: xp[t+1 .. t+W-1] (re-read: L1 hits)
        for i in tl.static_range(WM1):
            xw = _gather_xp(x_ptr, state_ptr, o_t + 1 + i, o_d, m, stride_x_t, stride_s_d, X_DTYPE, WM1)
            tl.store(win_ptr + o_t * stride_win_t + o_d * stride_win_d + i, xw.to(win_ptr.dtype.element_ty), mask=m)
    if UPDATE_STATE:  # window after the last token: xp[T .. T+W-2]
        o_i = tl.arange(0, BW1)[None, :]  # [1, BW1]
        d1 = i_d * BD + tl.arange(0, BD)[:, None]  # [BD, 1]
        m1 = (d1 < D) & (o_i < WM1)  # [BD, BW1]
        last = _gather_xp(x_ptr, state_ptr, T + o_i, d1, m1, stride_x_t, stride_s_d, X_DTYPE, WM1)  # [BD, BW1]
        tl.debug_barrier()  # every read of this program's state block happens before the write below
        tl.store(state_ptr + d1 * stride_s_d + o_i, last.to(state_ptr.dtype.element_ty), mask=m1)


def short_conv_update_fwd(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    y: torch.Tensor,
    out_windows: torch.Tensor | None,
    update_state: bool,
    block_d: int,
    num_warps: int,
) -> None:
    """Launches ``short_conv_update_kernel``; no checks beyond the kernel's needs."""
    T, D = x.shape
    W = weight.shape[1]
    win = out_windows if out_windows is not None else conv_state
    win_strides = (win.stride(0), win.stride(1)) if out_windows is not None else (0, 0)
    pdl = pdl_enabled(x.device)
    short_conv_update_kernel[(triton.cdiv(D, block_d),)](
        x, weight, conv_state, y, win,
        D,
        x.stride(0), weight.stride(0), conv_state.stride(0), y.stride(0), *win_strides,
        T=T, W=W, BT=triton.next_power_of_2(T), BD=block_d, BW1=triton.next_power_of_2(W - 1),
        STORE_WINDOWS=out_windows is not None, UPDATE_STATE=bool(update_state), USE_PDL=pdl,
        num_warps=num_warps, **({"launch_pdl": True} if pdl else {}),
    )


def default_block_d(T: int, D: int) -> tuple[int, int]:
    """(BD, num_warps) used when the caller passes none: BD=64 with 4 warps, the fastest of the H200 sweep at
    D=12288 (bf16) for decode and verify alike (the figures are in docs/performance.md); BD=256 was 1.4-1.6x
    slower. Retune with ``python -m benchmarks.ops.bench_kda conv``."""
    return 64, 4


def short_conv_update(
    x: torch.Tensor,
    weight: torch.Tensor,
    conv_state: torch.Tensor,
    out_windows: torch.Tensor | None = None,
    update_state: bool = True,
    *,
    out: torch.Tensor | None = None,
    block_d: int | None = None,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Depthwise causal conv (width W) + SiLU of T new rows over the carried window.

    x: [T, D] (last dim contiguous; may be a strided view); weight: [D, W]; conv_state: [D, W-1], oldest first.
    out_windows: [>=T, D, W-1], receives the window after every token (verify staging).
    update_state: write the window after the last token into ``conv_state`` in place.
    Returns y: [T, D] in x's dtype (into ``out`` when given).
    """
    T, D = x.shape
    W = weight.shape[-1]
    assert 1 <= T <= MAX_T, f"short_conv_update handles 1..{MAX_T} tokens, got T={T}"
    assert weight.shape == (D, W) and conv_state.shape == (D, W - 1), (
        f"weight {tuple(weight.shape)} conv_state {tuple(conv_state.shape)} for D={D}"
    )
    assert x.stride(-1) == 1 and weight.stride(-1) == 1 and conv_state.stride(-1) == 1
    if out_windows is not None:
        assert out_windows.shape[0] >= T and tuple(out_windows.shape[1:]) == (D, W - 1), tuple(out_windows.shape)
        assert out_windows.stride(-1) == 1
    if out is None:
        out = torch.empty(T, D, dtype=x.dtype, device=x.device)
    assert out.shape == (T, D) and out.stride(-1) == 1
    bd, nw = default_block_d(T, D)
    short_conv_update_fwd(x, weight, conv_state, out, out_windows, update_state,
                          bd if block_d is None else block_d, nw if num_warps is None else num_warps)
    return out
