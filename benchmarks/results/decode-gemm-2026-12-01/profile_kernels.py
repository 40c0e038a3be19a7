"""Nsight Compute input for the README's "why": three production launches at Ling-3.0-flash's KDA in-projection
(20512 x 2560, RMSNorm prologue) with the tables as tuned: bf16 M = 1 (GEMV), bf16 M = 6 (swap form), fp8 M = 1.

    ncu --clock-control none -k regex:linear_kernel --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats \\
        python3 benchmarks/results/decode-gemm-2026-12-01/profile_kernels.py
"""

import torch

from baton.ops.fp8_linear import fp8_dense_linear
from baton.ops.linear import linear
from baton.ops.quant import quantize_fp8_parts

n, k = 20512, 2560
w = torch.randn(n, k, device="cuda") * k**-0.5
wb = w.bfloat16()
q, s = quantize_fp8_parts(w, [4096] * 5 + [32])
nw = (torch.rand(k, device="cuda") + 0.5).bfloat16()
for m, fp8 in ((1, False), (6, False), (1, True)):
    x = torch.randn(m, k, device="cuda").bfloat16()
    for _ in range(2):  # the first call compiles
        y = fp8_dense_linear(x, q, s, None, nw) if fp8 else linear(x, wb, nw)
    torch.cuda.synchronize()
    print(m, fp8, y.shape, flush=True)
