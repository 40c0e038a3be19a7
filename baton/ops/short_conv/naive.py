"""Reference depthwise causal short convolution with SiLU (fla ShortConvolution) over a carried window.

The state holds the last W-1 inputs per channel, oldest first. Output t is
``silu(sum_j w[c, j] * x[t - (W-1) + j])``: ``w[:, -1]`` multiplies the current token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def short_conv(x: torch.Tensor, weight: torch.Tensor, state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, D], weight [D, W], state [D, W-1] -> (silu(conv) [T, D] in x's dtype, windows [T, D, W-1]).

    ``windows[t]`` is the state after token t (what verify stages per position); ``windows[-1]`` is the
    state to carry after the whole input. ``state`` is not modified.
    """
    width = weight.shape[1]
    xp = torch.cat([state.t().to(x.dtype), x], dim=0)  # [W-1+T, D]
    frames = xp.unfold(0, width, 1)  # [T, D, W]
    y = (frames.float() * weight.float()[None]).sum(-1)
    windows = xp.unfold(0, width - 1, 1)[1:]  # [T, D, W-1]
    return F.silu(y).to(x.dtype), windows


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
    """Reference for the Triton decode / verify conv (``baton.ops.short_conv.triton.short_conv_update``), same
    signature, built on ``short_conv``: x [T, D], weight [D, W], conv_state [D, W-1].

    ``out_windows[:T]`` receives the window after every token; ``update_state`` writes the last one into
    ``conv_state``. ``block_d`` / ``num_warps`` are the kernel's tunables, ignored here. Returns y [T, D].
    """
    T = x.shape[0]
    y, windows = short_conv(x, weight, conv_state)
    if out_windows is not None:
        out_windows[:T].copy_(windows)
    if update_state:
        conv_state.copy_(windows[-1])
    if out is not None:
        return out.copy_(y)
    return y
