"""The drafts' lm_head pass at decode shapes: bf16 through cuBLAS (``hidden @ w.t()``, what
``CausalLM.compute_local_logits`` runs) against the fp8 Triton kernel (``--enable-fp8-draft-lm-head``), cold weights
(a rotation of copies larger than L2), in CUDA graphs.

    python -m baton.ops.fp8_linear.bench [--shapes 157184x2560 78592x2560 49152x576] [--rows 1 16] [--sweep]
        [--json F]

Floor: the weight bytes (N * K: 1 byte fp8, 2 bytes bf16) over 4.8 TB/s. ``--sweep`` times every (BLOCK_N, BLOCK_K,
num_warps, num_stages) tile; the best per row count belongs in ``triton.pick_tiles``.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from baton.ops.linear.bench import _graph_time_us

PEAK_BANDWIDTH = 4.8e12
L2_BYTES = 60 << 20


def _copies(nbytes: int) -> int:
    return max(2, -(-4 * L2_BYTES // nbytes))


def bench_fp8_linear(shapes=((157184, 2560), (78592, 2560), (49152, 576)), rows=(1, 16), sweep: bool = False
                     ) -> list[dict]:
    from baton.ops.fp8_linear import triton as fast
    from baton.ops.quant import dequantize_fp8_block, quantize_fp8_block

    assert torch.cuda.is_available(), "the fp8 linear bench needs CUDA"
    dev = torch.device("cuda")
    out: list[dict] = []
    for (n, k), m in itertools.product(shapes, rows):
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        q, s = quantize_fp8_block(w)
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        want = x.float() @ dequantize_fp8_block(q, s, torch.float32).t()
        err = ((fast.fp8_linear(x, q, s) - want).norm() / want.norm()).item()
        ws = [w] + [w.clone() for _ in range(_copies(w.nbytes) - 1)]
        qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(_copies(q.nbytes) - 1)]
        bf16_us = _graph_time_us([functools.partial(torch.matmul, x, wi.t()) for wi in ws])
        fp8_us = _graph_time_us([functools.partial(fast.fp8_linear, x, qi, si) for qi, si in qs])
        row = dict(n=n, k=k, m=m, bf16_cublas_us=round(bf16_us, 2), bf16_floor_us=round(2 * n * k / PEAK_BANDWIDTH
                   * 1e6, 2), fp8_us=round(fp8_us, 2), fp8_floor_us=round(n * k / PEAK_BANDWIDTH * 1e6, 2),
                   fp8_tiles=list(fast.pick_tiles(m)), rel_err=err)
        if sweep:
            times = []
            for tiles in itertools.product((32, 64, 128), (64, 128), (4, 8), (1, 2, 3, 4)):
                try:
                    t = _graph_time_us([functools.partial(fast.fp8_linear, x, qi, si, tiles) for qi, si in qs])
                except Exception:  # a tile that does not compile (resources) is skipped
                    continue
                times.append((round(t, 2), list(tiles)))
            row["sweep_best"] = sorted(times)[:5]
        out.append(row)
        print(json.dumps(row), flush=True)
        del ws, qs
        torch.cuda.empty_cache()
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["157184x2560", "78592x2560", "49152x576"],
                    help="N x K of each weight (Ling-3.0-flash's lm_head, one TP2 rank's, SmolLM2's)")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--sweep", action="store_true", help="time every tile too")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args(argv)
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    rows = bench_fp8_linear(shapes, args.rows, args.sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
