"""Reference RMSNorm (Llama / Ling style: normalise in fp32, cast back, then scale) and the gated RMSNorm of
KDA's output (fla FusedRMSNormGated: all in fp32, times sigmoid(gate))."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float() * torch.sigmoid(gate.float())).to(x.dtype)
