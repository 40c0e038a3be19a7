"""The CPU GGUF matmul kernels (baton/ops/quant_cpu/kernels.c: bq_q4_1_linear, bq_q8_0_linear) at a few rows of x:
decode (M = 1) and the speculative verify of a small model (4 rows for NEXTN, 9 for DSpark gamma 8, 17 for block
16), on SmolLM2-135M's projection shapes, with random (valid) Q4_1 / Q8_0 blocks.

    python -m benchmarks.bench_quant_cpu_rows [--m 1 2 3 4 5 6 8 9 12 16 17] [--shapes qkv o gate_up down lm_head]
        [--formats q4_1 q8_0] [--threads N] [--repeats 15] [--min-time 0.02] [--baseline path/to/old/kernels.c]
        [--json NAME]

Each figure is the median over ``--repeats`` timings of a loop of calls lasting at least ``--min-time`` seconds (after
a warm-up), in microseconds per call and per row of x; GFLOP/s counts 2 M N K. The weights of a shape stay in the
cache where they fit (SmolLM2's layer matrices: 0.3 to 1.8 MB; the lm_head's 30 MB does not fit L2), as in a decode
step that runs the same layer's matmuls back to back. ``--baseline`` builds another copy of kernels.c (say, the one
of the previous commit: ``git show HEAD:baton/ops/quant_cpu/kernels.c > /tmp/old.c``) and times it in the same
process, interleaved shape by shape with the current one, so both see the same machine; the table then shows both
and the speed-up. The kernels are called through ctypes directly (as baton.ops.quant_cpu.cpu.linear does for up to
GEMV_MAX_ROWS rows), so no PyTorch overhead is counted.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from baton.ops.quant_cpu import naive, native
from benchmarks.common import env_card, save

# SmolLM2-135M (hidden 576, 9 heads of 64, 3 KV heads, intermediate 1536, vocab 49152): name -> (N, K)
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "lm_head": (49152, 576)}
DEFAULT_M = [1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 17]


def random_blocks(fmt: str, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Random valid GGUF block rows (uint8 [n, k/32 * block bytes]): small positive d (and negative m for Q4_1),
    random codes."""
    nb = n * k // 32
    if fmt == "q4_1":
        raw = torch.randint(0, 256, (nb, naive.Q4_1_BLOCK_BYTES), dtype=torch.uint8, generator=gen)
        raw[:, 0:2] = (torch.rand(nb, generator=gen) * 0.01).half().view(torch.uint8).view(-1, 2)
        raw[:, 2:4] = (torch.rand(nb, generator=gen) * -0.01).half().view(torch.uint8).view(-1, 2)
    else:
        raw = torch.randint(0, 256, (nb, naive.Q8_0_BLOCK_BYTES), dtype=torch.uint8, generator=gen)
        raw[:, 0:2] = (torch.rand(nb, generator=gen) * 0.001).half().view(torch.uint8).view(-1, 2)
    return raw.view(n, -1)


def load(source: Path | None):
    """The native kernels: the tree's (None), or those built from another copy of kernels.c."""
    if source is None:
        lib = native.lib()
        if lib is None:
            raise SystemExit(f"the kernels do not build here: {native.error()}")
        return lib
    return native._build("native", Path(source))  # cached under a key of the source, beside the tree's build


def caller(lib, fmt: str, x: torch.Tensor, packed: torch.Tensor, n: int, y: torch.Tensor):
    m, k = x.shape
    if fmt == "q4_1":
        fn, args = lib.bq_q4_1_linear, (x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr(), None)
    else:
        fn, args = lib.bq_q8_0_linear, (x.data_ptr(), m, k, packed.data_ptr(), n, y.data_ptr())

    def call():
        if fn(*args):
            raise MemoryError("kernel: out of memory")

    return call


def time_us(call, repeats: int, min_time: float) -> float:
    """Median over ``repeats`` of the mean time of a loop of calls lasting at least ``min_time`` s, in us."""
    t0, n = time.perf_counter(), 0
    while time.perf_counter() - t0 < min_time:  # warm-up, and the loop length
        call()
        n += 1
    loops = max(1, n)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        for _ in range(loops):
            call()
        times.append((time.perf_counter() - t) / loops)
    return statistics.median(times) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", type=int, nargs="+", default=DEFAULT_M, help="rows of x")
    ap.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--formats", nargs="+", default=["q4_1", "q8_0"], choices=["q4_1", "q8_0"])
    ap.add_argument("--threads", type=int, default=None, help="the kernels' threads (default torch's)")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--min-time", type=float, default=0.02, help="seconds per timed loop")
    ap.add_argument("--baseline", type=Path, default=None, help="another kernels.c to time beside the tree's")
    ap.add_argument("--json", default=None, help="save the results as benchmarks/results/NAME.json")
    args = ap.parse_args()

    threads = args.threads or torch.get_num_threads()
    libs = {"new": load(None)}
    if args.baseline is not None:
        libs = {"base": load(args.baseline), **libs}
    for lib in libs.values():
        lib.bq_set_threads(threads)
    card = {**env_card(), "threads": threads, "isa": native.isa(), "baseline": str(args.baseline or "")}
    print(card)
    gen = torch.Generator().manual_seed(0)
    rows = []
    hdr = f"{'shape':>8} {'fmt':>5} {'N':>6} {'K':>5} {'M':>3} "
    hdr += " ".join(f"{name + ' us':>10} {'us/row':>8} {'GF/s':>6}" for name in libs)
    print(hdr + ("  speed-up" if len(libs) > 1 else ""))
    for shape in args.shapes:
        n, k = SHAPES[shape]
        for fmt in args.formats:
            packed = naive.pack(fmt, random_blocks(fmt, n, k, gen))
            for m in args.m:
                x = torch.randn(m, k, generator=gen)
                rec = {"shape": shape, "fmt": fmt, "n": n, "k": k, "m": m}
                outs = {}
                for name, lib in libs.items():
                    y = torch.empty(m, n)
                    us = time_us(caller(lib, fmt, x, packed, n, y), args.repeats, args.min_time)
                    rec[f"{name}_us"] = us
                    outs[name] = y
                if len(outs) > 1 and not torch.equal(outs["base"], outs["new"]):
                    rec["differs"] = True  # the two builds do not give the same bits
                line = f"{shape:>8} {fmt:>5} {n:>6} {k:>5} {m:>3} "
                line += " ".join(f"{rec[f'{name}_us']:10.1f} {rec[f'{name}_us'] / m:8.1f} "
                                 f"{2 * m * n * k / rec[f'{name}_us'] / 1e3:6.1f}" for name in libs)
                if len(libs) > 1:
                    rec["speedup"] = rec["base_us"] / rec["new_us"]
                    line += f"  {rec['speedup']:7.2f}x" + ("  (bits differ)" if rec.get("differs") else "")
                print(line, flush=True)
                rows.append(rec)
    if args.json:
        save(args.json, {**card, "runs": rows})


if __name__ == "__main__":
    main()
