"""Nsight Compute input for the README's "why": production launches with the tables as tuned in the same run,
M = 6 (the NEXTN verify): the KDA in-projection (20512 x 2560, RMSNorm prologue) in w8a16 then w8a8, and
dense_down (2560 x 6144, residual, split-K) in w8a8. Each is called twice (the first call compiles).

    ncu --clock-control none -k regex:linear_kernel --section SpeedOfLight --section Occupancy \\
        --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis \\
        python3 benchmarks/results/fp8-w8a8-2026-12-02/profile_w8a8.py
"""

import torch

from baton.ops.fp8_linear import fp8_dense_linear
from baton.ops.quant import quantize_fp8_parts

m = 6
for name, parts, k, norm, res, act in (("kda_in_proj", [4096] * 5 + [32], 2560, True, False, False),
                                       ("kda_in_proj", [4096] * 5 + [32], 2560, True, False, True),
                                       ("dense_down", [2560], 6144, False, True, True)):
    n = sum(parts)
    w = torch.randn(n, k, device="cuda") * k**-0.5
    q, s = quantize_fp8_parts(w, parts)
    nw = (torch.rand(k, device="cuda") + 0.5).bfloat16() if norm else None
    r = torch.randn(m, n, device="cuda").bfloat16() if res else None
    x = torch.randn(m, k, device="cuda").bfloat16()
    for _ in range(2):
        y = fp8_dense_linear(x, q, s, None, nw, 1e-6, r, act_fp8=act)
    torch.cuda.synchronize()
    print(name, "w8a8" if act else "w8a16", tuple(y.shape), flush=True)
