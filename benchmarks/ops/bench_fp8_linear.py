"""The drafts' lm_head pass at decode shapes: bf16 through cuBLAS (``hidden @ w.t()``, what
``CausalLM.compute_local_logits`` runs) against the fp8 Triton kernel (``--enable-fp8-draft-lm-head``), cold weights
(a rotation of copies larger than L2), in CUDA graphs.

    python -m benchmarks.ops.bench_fp8_linear [--shapes 157184x2560 78592x2560 49152x576] [--rows 1 16] [--sweep]
        [--json F]

Floor: the weight bytes (N * K: 1 byte fp8, 2 bytes bf16) over 4.8 TB/s. ``--sweep`` times every (BLOCK_N, BLOCK_K,
num_warps, num_stages) tile; the best per row count belongs in ``triton.pick_tiles``.

    python -m benchmarks.ops.bench_fp8_linear --dense [--rows 1 6 17] [--sweep] [--json F]

``--dense``: the dense projections of ``--quantization fp8`` at every Ling-3.0-flash dense decode shape (KDA and MLA
in_proj with their RMSNorm prologue, o_proj / dense / down_proj with the residual epilogue, the dense and shared
gate_up with SwiGLU, eh_proj), through the dispatch (``fp8_dense_linear``: the Triton kernel up to 32 rows, the
dequantise-then-matmul reference above) against the bf16 projection with the same fusion (``baton.ops.linear``),
cold weights, in CUDA graphs; floors at 4.2 TB/s (the census' copy bandwidth; bytes: the fp8 weight and its scales).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json

import torch

from benchmarks.ops.timing import cold_copies, graph_time_us

PEAK_BANDWIDTH = 4.8e12


def _copies(nbytes: int) -> int:
    return cold_copies(nbytes)  # 4 L2s of weights per replay


def _graph_time_us(calls, replays: int = 20) -> float:
    """As the linear bench times: the median replay, the first 2 calls warmed up, 3 untimed replays."""
    return graph_time_us(calls, replays, warmup=2, warm_replays=3)


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


CENSUS_BANDWIDTH = 4.2e12

# name: (row parts, K, fusion) at Ling-3.0-flash's shape (one GPU); fusion: norm / residual / swiglu (with the norm).
LING_DENSE_SHAPES = {
    "kda_in_proj": ([4096, 4096, 4096, 4096, 4096, 32], 2560, "norm"),
    "kda_o_proj": ([2560], 4096, "residual"),
    "mla_in_proj": ([6144, 576, 32], 2560, "norm"),
    "mla_dense": ([2560], 4096, "residual"),
    "dense_gate_up": ([6144, 6144], 2560, "swiglu"),
    "dense_down": ([2560], 6144, "residual"),
    "shared_gate_up": ([768, 768], 2560, "swiglu"),
    "shared_down": ([2560], 768, "residual"),
    "eh_proj": ([2560], 5120, "plain"),
}

DENSE_SWEEP_TILES = [(bn, 128, w, st) for bn in (4, 8, 16, 32, 64) for w in (4, 8) for st in (1, 2, 3)]


LIMIT = 7.0  # the SwiGLU clamp of the shapes' gate_up (Ling's last layers)


def _fp8_dense_call(x, qi, si, rb=None, nw=None, res=None, swiglu=False, tiles=None):
    from baton.ops.fp8_linear import fp8_dense_linear, fp8_dense_linear_swiglu
    from baton.ops.fp8_linear import triton as fast

    if tiles is not None:
        return fast.fp8_dense(x, qi, si, rb, nw, 1e-6, res, swiglu, LIMIT if swiglu else 0.0, tiles=tiles)
    if swiglu:
        return fp8_dense_linear_swiglu(x, qi, si, rb, nw, 1e-6, LIMIT)
    return fp8_dense_linear(x, qi, si, rb, nw, 1e-6, res)


def _bf16_dense_call(x, wi, nw=None, res=None, swiglu=False):
    from baton.ops.linear import linear, linear_swiglu

    return linear_swiglu(x, wi, nw, 1e-6, LIMIT) if swiglu else linear(x, wi, nw, 1e-6, res)


def bench_fp8_dense(rows=(1, 6, 17), names=None, sweep: bool = False, tp_size: int = 1) -> list[dict]:
    """One row per (shape, M): the fp8 dispatch's and the bf16 projection's µs, the floors, the relative error of the
    fp8 result against the dequantised fp32 reference. ``tp_size``: one rank's shard (column parts / rows split)."""
    from baton.ops.fp8_linear import naive
    from baton.ops.fp8_linear import triton as fast
    from baton.ops.quant import quantize_fp8_parts, row_block_map

    assert torch.cuda.is_available(), "the fp8 dense bench needs CUDA"
    dev = torch.device("cuda")
    out: list[dict] = []
    for name in names or list(LING_DENSE_SHAPES):
        parts, k, fusion = LING_DENSE_SHAPES[name]
        if tp_size > 1:  # column-parallel parts (MLA's latent kv_a replicated), row-parallel K
            if fusion == "residual":
                k //= tp_size
            else:
                parts = [p if (name == "mla_in_proj" and p == 576) else p // tp_size for p in parts]
        n, swiglu = sum(parts), fusion == "swiglu"
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * k**-0.5
        q, s = quantize_fp8_parts(w, parts)
        rb = row_block_map(parts)
        rb = None if rb is None else torch.tensor(rb, dtype=torch.int32, device=dev)
        nw = (torch.rand(k, device=dev) + 0.5).bfloat16() if fusion in ("norm", "swiglu") else None
        n_out = n // 2 if swiglu else n
        fp8_bytes = q.nbytes + s.nbytes
        copies = _copies(q.nbytes)
        ws = [w] + [w.clone() for _ in range(_copies(w.nbytes) - 1)]
        qs = [(q, s)] + [(q.clone(), s.clone()) for _ in range(copies - 1)]
        for m in rows:
            x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
            res = torch.randn(m, n_out, device=dev, dtype=torch.bfloat16) if fusion == "residual" else None
            f8 = functools.partial(_fp8_dense_call, x, rb=rb, nw=nw, res=res, swiglu=swiglu)
            b16 = functools.partial(_bf16_dense_call, x, nw=nw, res=res, swiglu=swiglu)
            nw32 = None if nw is None else nw.float()
            if swiglu:
                want = naive.fp8_dense_linear_swiglu(x.float(), q, s, rb, nw32, 1e-6, LIMIT)
            else:
                want = naive.fp8_dense_linear(x.float(), q, s, rb, nw32, 1e-6, None if res is None else res.float())
            err = ((f8(q, s).float() - want).norm() / want.norm()).item()
            fp8_us = _graph_time_us([functools.partial(f8, qi, si) for qi, si in qs])
            bf16_us = _graph_time_us([functools.partial(b16, wi) for wi in ws])
            row = dict(name=name, n=n, k=k, m=m, fusion=fusion, tp_size=tp_size, row_map=rb is not None,
                       fp8_us=round(fp8_us, 2), fp8_floor_us=round(fp8_bytes / CENSUS_BANDWIDTH * 1e6, 2),
                       bf16_us=round(bf16_us, 2), bf16_floor_us=round(w.nbytes / CENSUS_BANDWIDTH * 1e6, 2),
                       fp8_path="triton" if m <= fast.DENSE_MAX_M else "triton, launches of 32 rows"
                       if m <= fast.DENSE_CHUNKED_MAX_M else "dequantise+cuBLAS",
                       tiles=list(fast.pick_dense_tiles(m, n_out, swiglu)) if m <= fast.DENSE_MAX_M else None,
                       rel_err=err)
            if sweep and m <= fast.DENSE_MAX_M:
                times = []
                for tiles in DENSE_SWEEP_TILES:
                    if m > 1 and tiles[0] < 16:
                        continue
                    try:
                        t = _graph_time_us([functools.partial(f8, qi, si, tiles=tiles) for qi, si in qs], replays=10)
                    except Exception:  # a tile that does not compile (resources) is skipped
                        continue
                    times.append((round(t, 2), list(tiles)))
                row["sweep_best"] = sorted(times)[:3]
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
    ap.add_argument("--dense", action="store_true", help="the Ling dense projections under --quantization fp8")
    ap.add_argument("--names", nargs="+", default=None, help=f"--dense: some of {', '.join(LING_DENSE_SHAPES)}")
    ap.add_argument("--tp-size", type=int, default=1, help="--dense: one rank's shard of each projection")
    args = ap.parse_args(argv)
    if args.dense:
        rows = bench_fp8_dense(args.rows if args.rows != [1, 16] else [1, 6, 17], args.names, args.sweep,
                               args.tp_size)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
        return
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes]
    rows = bench_fp8_linear(shapes, args.rows, args.sweep)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
