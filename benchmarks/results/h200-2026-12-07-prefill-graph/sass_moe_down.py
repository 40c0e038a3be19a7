"""One-off check behind this folder's README (the MoE down kernel at 8 and 9 pairs a token): compile
``moe_down_direct_kernel`` for sm_90 on the CPU as ``moe_down_direct_fwd`` would launch it at T = 6 with the H200
table's fp8 T <= 6 down tile, with TOPK 8 and 9, and print registers, stack and the K loop's SASS.

    PYTHONPATH=. python benchmarks/results/h200-2026-12-07-prefill-graph/sass_moe_down.py
"""

import inspect
import tempfile

import torch

import baton.ops.moe.triton as mt
from baton.ops.moe.table import MoETile
from benchmarks.ops import sass_linear as sl


def main() -> None:
    cap = {}

    class Cap:
        def __getitem__(self, grid):
            def launch(*a, **kw):
                cap["args"], cap["kw"] = a, kw
            return launch

    real = mt.moe_down_direct_kernel
    mt.moe_down_direct_kernel = Cap()
    T, H, inter, E = 6, 2560, 768, 513
    names = list(inspect.signature(real.fn).parameters)
    for topk in (8, 9):
        tile = MoETile(block_n=64, block_k=128, num_warps=8, num_stages=3)
        act = torch.zeros(T * topk, inter)
        w2 = torch.zeros(E, H, inter, dtype=torch.float8_e4m3fn)
        ids, tw = torch.zeros(T, topk, dtype=torch.int32), torch.zeros(T, topk)
        res, out = torch.zeros(T, H, dtype=torch.bfloat16), torch.zeros(T, H, dtype=torch.bfloat16)
        scale = torch.zeros(E, H // 128, inter // 128)
        mt.moe_down_direct_fwd(act, w2, ids, tw, None, res, out, tile, False, w2_scale=scale)
        a, kw = list(cap["args"]), dict(cap["kw"])
        kw.pop("launch_pdl", None)
        a += [None] * (names.index("s_ptr") - len(a))  # the constexprs between, given as keywords
        for name in ("s_ptr", "stride_se", "stride_sn"):
            a.append(kw.pop(name))
        for i in real.constexprs:
            if i < len(a) and a[i] is not None:
                kw[names[i]], a[i] = a[i], None
        compiled = sl.compile_kernel(real, tuple(a), kw)
        with tempfile.TemporaryDirectory() as d:
            sass, regs, stack = sl.disassemble(compiled.asm["cubin"], d)
        ins = sl.instructions(sass)
        lo, hi = sl.longest_loop(ins)
        loop = sum(1 for addr, _ in ins if lo <= addr <= hi)
        print(f"TOPK {topk}: registers {regs}, stack {stack}, kernel {len(ins)} instructions, K loop {loop}",
              sl.opcode_histogram(ins, lo, hi).most_common(8))
    mt.moe_down_direct_kernel = real


if __name__ == "__main__":
    main()
