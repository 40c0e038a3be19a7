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
