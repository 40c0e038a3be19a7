"""The fused KDA decode / verify kernel's machine code, without a GPU: compile ``kda_recurrent_fused_kernel`` as the
layer launches it (``baton.ops.kda.triton.launch_plan``: the same constexprs and warps, the default ``block_v``,
the JIT's divisibility hints) for an NVIDIA target with Triton's own ptxas, disassemble it with its cuobjdump and
report registers per thread, stack bytes and local-memory spill instructions (STL / LDL), which a latency-bound
kernel must not have.

    python -m benchmarks.ops.sass_kda                       # Ling-3.0-flash: H=32, K=V=128, T = 1, 6, 17
    python -m benchmarks.ops.sass_kda --tokens 1 6 --no-conv --dump /tmp/sass_kda

Each T compiles the layer's form: T = 1 the decode (persistent state and conv window updated), T > 1 the verify
(per-position staging, persistent state untouched); ``--extend`` adds the T > 1 persistent form (draft / extend).
Runs on any machine with Triton's NVIDIA backend (its bin/ holds ptxas and cuobjdump)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass

import torch

from benchmarks.ops.sass_linear import (
    available,
    compile_kernel,
    disassemble,
    instructions,
    nvidia_bin,
    opcode_histogram,
)


@dataclass
class Report:
    mode: str
    T: int
    block_v: int
    num_warps: int
    conv: bool
    registers: int
    stack: int
    spill_instructions: int
    instructions: int
    top: dict


def layer_launch(T: int, H: int, K: int, V: int, W: int, dtype: torch.dtype, staged: bool, conv: bool,
                 pdl: bool, block_v: int | None = None, num_warps: int | None = None):
    """(grid, args, kwargs) of the layer's launch at these shapes, on empty CPU tensors laid out as the layer's."""
    from baton.ops.kda import triton as tk

    P, D = H * K, 2 * H * K + H * V
    y = torch.empty(T, D + 2 * P + H, dtype=dtype)  # in_proj's q|k|v|f|g|b row (no LoRA)
    q, k, v = y[:, :P].view(T, H, K), y[:, P:2 * P].view(T, H, K), y[:, 2 * P:D].view(T, H, V)
    f, g, b = y[:, D:D + P].view(T, H, K), y[:, D + P:D + 2 * P].view(T, H, V), y[:, D + 2 * P:]
    bv, nw = tk.default_block_v(T, H, V, staged=staged)
    state = torch.empty(H, K, V)
    return tk.launch_plan(
        q, k, v, f, b, torch.empty(H), torch.empty(H * K), -5.0, state, None, torch.empty(T, H, V, dtype=dtype),
        torch.empty(max(T, 8), H, K, V) if staged else None, not staged, torch.empty(V, dtype=dtype), g, 1e-6,
        block_v or bv, num_warps or nw,
        torch.empty(D, 1, W, dtype=dtype)[:, 0, :] if conv else None,
        torch.empty(D, W - 1, dtype=dtype) if conv else None,
        torch.empty(max(T, 8), D, W - 1, dtype=dtype) if conv and staged else None, pdl)


def analyse(T: int, staged: bool, conv: bool, H: int = 32, K: int = 128, V: int = 128, W: int = 4,
            dtype: torch.dtype = torch.bfloat16, arch: int = 90, pdl: bool = True, dump: str | None = None,
            block_v: int | None = None, num_warps: int | None = None) -> Report:
    from baton.ops.kda import triton as tk

    _, args, kwargs = layer_launch(T, H, K, V, W, dtype, staged, conv, pdl, block_v, num_warps)
    compiled = compile_kernel(tk.kda_recurrent_fused_kernel, args, kwargs, arch)
    mode = "verify" if staged else ("decode" if T == 1 else "extend")
    work = dump or os.path.join("/tmp", f"sass_kda_{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    sass, regs, stack = disassemble(compiled.asm["cubin"], work)
    instrs = instructions(sass)
    ops = opcode_histogram(instrs)
    if dump:
        stem = f"kda_{mode}_t{T}{'_conv' if conv else ''}"
        for ext, text in (("sass", sass), ("ttgir", compiled.asm["ttgir"]), ("ptx", compiled.asm["ptx"])):
            with open(os.path.join(dump, f"{stem}.{ext}"), "w") as f:
                f.write(text)
    return Report(mode, T, kwargs["BV"], kwargs["num_warps"], conv, regs, stack, ops["STL"] + ops["LDL"],
                  len(instrs), dict(ops.most_common(8)))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6, 17])
    ap.add_argument("--no-conv", action="store_true", help="the kernel without the fused short conv")
    ap.add_argument("--extend", action="store_true", help="also the T > 1 persistent form (draft / extend)")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-v", type=int, default=None, help="override default_block_v")
    ap.add_argument("--num-warps", type=int, default=None)
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", default=None, help="write each kernel's SASS, TTGIR and PTX into this folder")
    ap.add_argument("--json", default=None, help="write the reports here")
    args = ap.parse_args(argv)
    from baton import env

    if env.triton_interpret():
        sys.exit("TRITON_INTERPRET is set: the kernels are the interpreter's, not compiled ones (unset it)")
    if not available():
        sys.exit(f"no ptxas / cuobjdump in {nvidia_bin()}: this Triton install has no NVIDIA backend")
    forms = [(t, t > 1) for t in args.tokens] + ([(t, False) for t in args.tokens if t > 1] if args.extend else [])
    reports = []
    print("| mode | T | BV | warps | conv | registers | stack | spill instr | instructions | top opcodes |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for t, staged in forms:
        r = analyse(t, staged, not args.no_conv, args.heads, args.head_dim, args.head_dim, arch=args.arch,
                    dump=args.dump, block_v=args.block_v, num_warps=args.num_warps)
        reports.append(r)
        top = ", ".join(f"{k} {v}" for k, v in r.top.items())
        print(f"| {r.mode} | {r.T} | {r.block_v} | {r.num_warps} | {r.conv} | {r.registers} | {r.stack} | "
              f"{r.spill_instructions} | {r.instructions} | {top} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in reports], f, indent=1)


if __name__ == "__main__":
    main()
