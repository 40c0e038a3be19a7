"""RMSNorm variants; ``rms_norm`` picks the implementation for the device.

CUDA tensors take the one-kernel Triton RMSNorm (``triton.py``) when triton imports, ``baton.env.use_triton()``
allows and no gradient is needed (draft training runs these norms under autograd: it keeps the reference).
Everything else runs the plain-PyTorch reference (``naive.py``). Triton is imported on the first CUDA call.
"""

from __future__ import annotations

import torch

from baton.ops.rmsnorm import naive
from baton.ops.rmsnorm.naive import gated_rms_norm

__all__ = ["gated_rms_norm", "rms_norm"]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * (x / rms(x)).to(x.dtype)`` over the last dim, normalised in fp32."""
    if x.is_cuda and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
        from baton.ops.attention import triton_module

        impl = triton_module("baton.ops.rmsnorm.triton", x)
        if impl is not None and impl.supports(x, weight):
            return impl.rms_norm(x, weight, eps)
    return naive.rms_norm(x, weight, eps)
