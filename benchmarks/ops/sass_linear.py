"""The decode GEMM's machine code, without a GPU: compile ``linear_kernel`` exactly as a call would launch it
(``baton.ops.linear.triton.launch_plan``: the same constexprs, warps, stages and the JIT's divisibility hints)
for an NVIDIA target with Triton's own ptxas, disassemble it with its cuobjdump, and count the SASS instructions of
the K loop: per chunk, per thread, and per weight the thread streams. A kernel that issues more than a few
instructions a weight cannot stream at bandwidth (about 3.5 a weight at 4.2 TB/s of fp8 on an H200 at two
instructions a cycle per SM), so the count says which form to time before a device call is spent on it.

    python -m benchmarks.ops.sass_linear kda_in_proj:fp8:6 kda_in_proj:fp8:6:swap-256x128-s1-w8-st4-f16-fold
    python -m benchmarks.ops.sass_linear smol_gate_up:bf16:4 --table "NVIDIA H200" --dump /tmp/sass

A spec is SHAPE:DTYPE:M[:CONFIG] (``benchmarks/bench_decode_gemm.py``'s shapes; DTYPE bf16, fp8 = w8a16 or w8a8;
CONFIG as ``cfg_name`` writes it, else the ``--table`` GPU's tuned entry or the bucket rules). The loop is the
kernel's longest backward branch; weights a thread streams per trip = BLOCK_N (x 2 for SwiGLU) x BLOCK_K /
threads. Runs on any machine with Triton's NVIDIA backend (its bin/ holds ptxas and cuobjdump)."""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass

import torch

from benchmarks.bench_decode_gemm import EPS, cfg_name, make_inputs, make_weights
from benchmarks.ops.profile_linear import parse_spec

TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
         torch.int32: "i32", torch.int64: "i64"}


def nvidia_bin() -> str:
    import triton

    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def available() -> bool:
    """Whether this Triton install can compile and disassemble for NVIDIA GPUs."""
    b = nvidia_bin()
    return all(os.access(os.path.join(b, t), os.X_OK) for t in ("ptxas", "cuobjdump"))


@dataclass
class Report:
    spec: str
    config: str
    registers: int
    kernel_instructions: int
    loop_instructions: int
    weights_per_trip: float
    histogram: dict

    @property
    def per_weight(self) -> float:
        return self.loop_instructions / self.weights_per_trip if self.weights_per_trip else float("nan")


def signature(kernel, args: tuple, kwargs: dict):
    """A Triton kernel's signature, constexprs and hints for a launch's arguments, as the JIT specialises them:
    tensors by dtype (16-byte aligned ones marked), None and ints equal to 1 as constexprs, ints divisible by 16
    marked, floats fp32; keyword arguments are constexprs but for the launch options."""
    names = list(inspect.signature(kernel.fn).parameters)
    sig, const, aligned = {}, {}, []
    for name, value in zip(names, args, strict=False):
        if isinstance(value, torch.Tensor):
            sig[name] = "*" + TYPES[value.dtype]
            if value.data_ptr() % 16 == 0:
                aligned.append(name)
        elif value is None:
            sig[name], const[name] = "constexpr", None
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                sig[name], const[name] = "constexpr", 1
            else:
                sig[name] = "i32" if -2**31 <= value < 2**31 else "i64"
                if value % 16 == 0:
                    aligned.append(name)
        else:
            sig[name] = "fp32"
    options = {}
    for name, value in kwargs.items():
        if name in ("num_warps", "num_stages"):
            options[name] = value
        elif name != "launch_pdl":
            sig[name], const[name] = "constexpr", value
    idx = {n: i for i, n in enumerate(names)}
    return sig, {(idx[n],): v for n, v in const.items()}, {(idx[n],): [["tt.divisibility", 16]] for n in aligned}, \
        options


def compile_kernel(kernel, args: tuple, kwargs: dict, arch: int = 90):
    """The compiled ``kernel`` (``.asm``: ttgir, ptx, cubin) for one launch's arguments, for sm_``arch``."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, const, attrs, options = signature(kernel, args, kwargs)
    return triton.compile(ASTSource(kernel, sig, const, attrs), target=GPUTarget("cuda", arch, 32), options=options)


def compile_plan(plan, arch: int = 90):
    """The compiled ``linear_kernel`` of a ``launch_plan`` for sm_``arch``."""
    from baton.ops.linear.triton import linear_kernel

    return compile_kernel(linear_kernel, plan.args, plan.kwargs, arch)


def disassemble(cubin: bytes, work: str) -> tuple[str, int, int]:
    """(SASS text, registers per thread, stack bytes per thread) of a cubin, through Triton's cuobjdump."""
    path = os.path.join(work, "kernel.cubin")
    with open(path, "wb") as f:
        f.write(cubin)
    tool = os.path.join(nvidia_bin(), "cuobjdump")
    sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    res = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
    m, st = re.search(r"REG:(\d+)", res), re.search(r"STACK:(\d+)", res)
    return sass, int(m.group(1)) if m else -1, int(st.group(1)) if st else -1


def instructions(sass: str) -> list[tuple[int, str]]:
    """(address, instruction) of every SASS line."""
    out = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m:
            out.append((int(m.group(1), 16), m.group(2)))
    return out


def longest_loop(instrs: list[tuple[int, str]]) -> tuple[int, int] | None:
    """(first, last) address of the longest backward branch's body: the K loop."""
    loops = []
    for addr, ins in instrs:
        if re.search(r"\bBRA\b", ins):
            t = re.search(r"0x([0-9a-f]+)", ins)
            if t and int(t.group(1), 16) < addr:
                loops.append((int(t.group(1), 16), addr))
    return max(loops, key=lambda t: t[1] - t[0]) if loops else None


def opcode_histogram(instrs: list[tuple[int, str]], lo: int = 0, hi: int | None = None) -> collections.Counter:
    """Opcodes (without modifiers or predicates) between two addresses (default: the whole kernel)."""
    c = collections.Counter()
    for addr, ins in instrs:
        if lo <= addr and (hi is None or addr <= hi):
            op = re.sub(r"^@!?U?P[T\d]+\s+", "", ins).split()[0]
            c[op.split(".")[0]] += 1
    return c


def analyse(spec: str, table: str | None = None, arch: int = 90, dump: str | None = None) -> Report:
    from baton.ops.linear import triton as lt

    shape, dtype, m, cfg = parse_spec(spec)
    fp8, act8 = dtype in ("fp8", "w8a8"), dtype == "w8a8"
    cfg = cfg or lt.pick_config(m, shape.n_out, shape.k, shape.swiglu, fp8, act8, device_name=table)
    if cfg.cublas:
        raise SystemExit(f"{spec}: the table says cuBLAS for this shape and bucket (no Triton kernel)")
    if cfg.tma:
        raise SystemExit(f"{spec}: tma configs need a GPU to build their tensor descriptor")
    w = make_weights(shape, "cpu", fp8, copies=False, empty=True)
    inp = make_inputs(shape, m, "cpu", 0, empty=True)
    if fp8:
        weight, scale, row_block = w.fp8[0]
    else:
        weight, scale, row_block = w.bf16[0], None, None
    plan = lt.launch_plan(inp["x"], weight, inp["nw"], EPS, None if shape.swiglu else inp["res"], shape.swiglu,
                          shape.limit, cfg, True, scale, row_block, act8)
    kernel = compile_plan(plan, arch)
    work = dump or os.path.join("/tmp", f"sass_linear_{os.getpid()}")
    os.makedirs(work, exist_ok=True)
    sass, regs, _ = disassemble(kernel.asm["cubin"], work)
    if dump:
        stem = spec.replace(":", "_")
        for ext, text in (("sass", sass), ("ttgir", kernel.asm["ttgir"]), ("ptx", kernel.asm["ptx"])):
            with open(os.path.join(dump, f"{stem}.{ext}"), "w") as f:
                f.write(text)
    instrs = instructions(sass)
    loop = longest_loop(instrs)
    hist = opcode_histogram(instrs, *loop) if loop else collections.Counter()
    kw = plan.kwargs
    threads = 32 * kw["num_warps"]
    weights = kw["BLOCK_N"] * (2 if kw["SWIGLU"] else 1) * kw["BLOCK_K"] / threads if loop else 0.0
    return Report(spec, cfg_name(cfg), regs, len(instrs), sum(hist.values()), weights, dict(hist.most_common()))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+", help="SHAPE:DTYPE:M[:CONFIG]")
    ap.add_argument("--table", default=None,
                    help="take configs from this GPU's tuned tables (torch.cuda.get_device_name(), e.g. "
                         "'NVIDIA H200'); default: the bucket rules")
    ap.add_argument("--arch", type=int, default=90, help="the compute capability to compile for (default 90)")
    ap.add_argument("--dump", default=None, help="write each kernel's SASS, TTGIR and PTX into this folder")
    ap.add_argument("--json", default=None, help="write the reports here")
    ap.add_argument("--top", type=int, default=10, help="opcodes listed per kernel")
    args = ap.parse_args(argv)
    from baton import env

    if env.triton_interpret():
        sys.exit("TRITON_INTERPRET is set: the kernels are the interpreter's, not compiled ones (unset it)")
    if not available():
        sys.exit(f"no ptxas / cuobjdump in {nvidia_bin()}: this Triton install has no NVIDIA backend")
    reports = []
    print("| spec | config | registers | loop instructions | weights / thread / trip | per weight | top opcodes |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for spec in args.specs:
        r = analyse(spec, args.table, args.arch, args.dump)
        reports.append(r)
        top = ", ".join(f"{k} {v}" for k, v in list(r.histogram.items())[:args.top])
        print(f"| {r.spec} | {r.config} | {r.registers} | {r.loop_instructions} | {r.weights_per_trip:g} | "
              f"{r.per_weight:.2f} | {top} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r.__dict__, "per_weight": r.per_weight} for r in reports], f, indent=1)


if __name__ == "__main__":
    main()
