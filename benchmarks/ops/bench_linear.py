"""Timing of the decode-shape projections on CUDA: the Triton kernels (with and without PDL) against the
PyTorch reference path (cuBLAS F.linear plus separate norm / add / SwiGLU ops) and a bare F.linear.

Each variant is captured in a CUDA graph that calls it once per weight copy, cycling over enough copies to
exceed the 60 MB L2 (cold weights, as in a decode step), and the replays are timed with CUDA events; the figure
per call is the median replay time over the number of calls (``benchmarks.ops.timing``), so it includes the
in-graph launch gap, as a decode step pays it. GB/s counts every byte a call must move (weights, x, norm weight,
residual, output).

    python -m benchmarks.ops.bench_linear [--m 1 6 16] [--json out.json] [--tune] [--tp-size 2 --only ling]
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from baton.ops.linear import naive
from baton.ops.linear.table import dump_json, write_table
from benchmarks.ops.timing import L2_BYTES, cold_copies, graph_time_us

__all__ = ["LING_SHAPES", "SMOL_SHAPES", "BenchShape", "bench_linear", "ling_tp_shapes", "tune_linear", "untuned"]

COLD_BYTES = 4 * L2_BYTES  # weight bytes cycled through per graph replay


@dataclass(frozen=True)
class BenchShape:
    """One projection: weight [n, k] (for SwiGLU n = 2I rows, output I), its fusions and the rows ``m``."""

    name: str
    n: int
    k: int
    norm: bool = False
    residual: bool = False
    swiglu: bool = False
    limit: float = 0.0
    m: int = 1

    def with_m(self, m: int) -> BenchShape:
        return BenchShape(self.name, self.n, self.k, self.norm, self.residual, self.swiglu, self.limit, m)


# Ling-3.0-flash: d=2560, 32 heads x 128 (KDA, no LoRA), MLA q 32 x 192 + kv_a 576 + gate 32, experts 768 wide.
LING_SHAPES = [
    BenchShape("ling.kda_in_proj", 5 * 4096 + 32, 2560, norm=True),
    BenchShape("ling.mla_in_proj", 6144 + 576 + 32, 2560, norm=True),
    BenchShape("ling.o_proj", 2560, 4096, residual=True),
    BenchShape("ling.shared_gate_up", 2 * 768, 2560, swiglu=True, limit=7.0),
    BenchShape("ling.shared_down", 2560, 768, residual=True),
    BenchShape("ling.dense_gate_up", 2 * 6144, 2560, norm=True, swiglu=True),
    BenchShape("ling.dense_down", 2560, 6144, residual=True),
    BenchShape("ling.router", 512, 2560),
    BenchShape("ling.lm_head", 157184, 2560, norm=True),
]

# SmolLM2-135M: d=576, 9 q heads + 3 kv heads of 64, intermediate 1536, vocab 49152.
SMOL_SHAPES = [
    BenchShape("smol.qkv", 960, 576, norm=True),
    BenchShape("smol.o_proj", 576, 576, residual=True),
    BenchShape("smol.gate_up", 2 * 1536, 576, norm=True, swiglu=True),
    BenchShape("smol.down", 576, 1536, residual=True),
    BenchShape("smol.lm_head", 49152, 576, norm=True),
]


def ling_tp_shapes(tp_size: int) -> list[BenchShape]:
    """LING_SHAPES as one rank of ``tp_size`` holds them (column-parallel N, row-parallel K and the fused
    projections' parts divided as baton shards them): read from the model built on the meta device at that layout,
    matching each shape to the modules that have it at TP 1. A shape no module has (the router, replicated)
    stays whole."""
    import re
    from importlib import resources

    from torch import nn

    from baton import dist
    from baton.config import parse_model_config
    from baton.models.build import build_model

    cfg = parse_model_config(json.loads(resources.files("baton.data").joinpath("ling-3.0-flash.config.json")
                                        .read_text()))

    def linears(size: int) -> dict[str, tuple[int, int]]:
        with dist.layout_context(0, size):
            model = build_model(cfg, "meta", torch.bfloat16)
        return {n: tuple(m.weight.shape) for n, m in model.named_modules() if isinstance(m, nn.Linear)}

    whole, part = linears(1), linears(tp_size)
    out = []
    for s in LING_SHAPES:
        per_rank = {part[n] for n, shape in whole.items() if shape == (s.n, s.k)}
        if len(per_rank) > 1:
            raise ValueError(f"{s.name}: modules of shape {(s.n, s.k)} shard differently: {sorted(per_rank)}")
        n, k = per_rank.pop() if per_rank else (s.n, s.k)
        name = re.sub(r"^ling\.", f"ling.tp{tp_size}.", s.name)
        out.append(BenchShape(name, n, k, s.norm, s.residual, s.swiglu, s.limit, s.m))
    return out


def _bytes_moved(s: BenchShape, elt: int) -> int:
    n_out = s.n // 2 if s.swiglu else s.n
    total = s.n * s.k + s.m * s.k + s.m * n_out  # weight, x, output
    total += s.k if s.norm else 0
    total += s.m * n_out if s.residual else 0
    return total * elt


def _graph_time_us(calls: list[Callable[[], object]], replays: int = 20) -> float:
    """Median time per call (µs) of a CUDA graph that runs ``calls`` in order (the first two warm up: the rest are
    the same kernel on other weights)."""
    return graph_time_us(calls, replays, warmup=2, warm_replays=3)


def _inputs(s: BenchShape, dtype: torch.dtype, gen: torch.Generator) -> dict:
    dev = torch.device("cuda")
    w_bytes = s.n * s.k * torch.finfo(dtype).bits // 8
    copies = cold_copies(w_bytes, COLD_BYTES, 2, 512)
    n_out = s.n // 2 if s.swiglu else s.n
    weights = [(torch.randn(s.n, s.k, device=dev, generator=gen) / s.k**0.5).to(dtype) for _ in range(copies)]
    return dict(
        x=torch.randn(s.m, s.k, device=dev, generator=gen).to(dtype),
        norm_weight=(torch.rand(s.k, device=dev, generator=gen) + 0.5).to(dtype) if s.norm else None,
        residual=torch.randn(s.m, n_out, device=dev, generator=gen).to(dtype) if s.residual else None,
        weights=weights,
    )


def _triton_call(s: BenchShape, inp: dict, w: torch.Tensor, config=None, use_pdl: bool = False):
    from baton.ops.linear import triton as fast

    if s.swiglu:
        return lambda: fast.linear_swiglu_fwd(inp["x"], w, inp["norm_weight"], 1e-6, s.limit, config, use_pdl)
    return lambda: fast.linear_fwd(inp["x"], w, inp["norm_weight"], 1e-6, inp["residual"], config, use_pdl)


def _reference_call(s: BenchShape, inp: dict, w: torch.Tensor):
    if s.swiglu:
        return lambda: naive.linear_swiglu(inp["x"], w, inp["norm_weight"], 1e-6, s.limit)
    return lambda: naive.linear(inp["x"], w, inp["norm_weight"], 1e-6, inp["residual"])


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def bench_linear(shapes: list[BenchShape], dtype: torch.dtype = torch.bfloat16, ms: tuple[int, ...] = (1, 6, 16),
                 seed: int = 0) -> list[dict]:
    """Time every shape at every M in ``ms``; one dict per (shape, M) with µs and GB/s per variant:
    ``triton`` (no PDL), ``triton_pdl`` (when the GPU has it), ``torch_ref`` (the naive path: F.linear plus
    separate ops) and ``torch_gemm`` (F.linear alone), plus the Triton-vs-reference relative error."""
    from baton.ops.linear import triton as fast

    gen = torch.Generator(device="cuda").manual_seed(seed)
    has_pdl = fast.pdl_enabled(torch.device("cuda"))
    rows = []
    for base in shapes:
        for m in ms:
            s = base.with_m(m)
            inp = _inputs(s, dtype, gen)
            ws = inp["weights"]
            nbytes = _bytes_moved(s, torch.finfo(dtype).bits // 8)
            cfg = fast.pick_config(m, s.n // 2 if s.swiglu else s.n, s.k, s.swiglu)
            row = dict(name=s.name, m=m, n=s.n, k=s.k, norm=s.norm, residual=s.residual, swiglu=s.swiglu,
                       bytes=nbytes, copies=len(ws), config=cfg.__dict__)
            row["rel_err"] = _rel_err(_triton_call(s, inp, ws[0], use_pdl=has_pdl)(), _reference_call(s, inp, ws[0])())
            variants = {"triton": [_triton_call(s, inp, w) for w in ws],
                        "torch_ref": [_reference_call(s, inp, w) for w in ws],
                        "torch_gemm": [(lambda w=w, x=inp["x"]: F.linear(x, w)) for w in ws]}
            if has_pdl:
                variants["triton_pdl"] = [_triton_call(s, inp, w, use_pdl=True) for w in ws]
            for name, calls in variants.items():
                us = _graph_time_us(calls)
                row[f"{name}_us"] = us
                row[f"{name}_gbps"] = nbytes / us / 1e3
            rows.append(row)
            del inp, ws, variants
            torch.cuda.empty_cache()
    return rows


def _candidates(m: int, n_out: int, k: int, swiglu: bool) -> list:
    from baton.ops.linear.triton import LinearConfig

    rows_per_col = 2 if swiglu else 1
    out = []
    if m == 1:
        for bk in (256, 512, 1024):
            for bn in (2, 4, 8, 16, 32):
                tile = bn * bk * rows_per_col
                if 1024 <= tile <= 16384 and bk <= max(256, 2 * k):
                    for warps in (4, 8) if tile >= 8192 else (4,):
                        out.append(LinearConfig(bn, bk, 1, warps, 1))
        return out
    for bk in (64, 128, 256):
        for bn in (16, 32, 64):
            n_blocks = -(-n_out // bn)
            for split in (1, 2, 4, 8):
                if split == 1 or (n_blocks * split <= 1024 and bk * split <= k):
                    out.append(LinearConfig(bn, bk, split, 4, 1))
    rows = 1 << (m - 1).bit_length()
    if rows <= 16:  # the GEMV form over next_pow2(M) rows: products [rows, BLOCK_N, BLOCK_K] in registers
        for bk in (64, 128, 256, 512):
            for bn in (2, 4, 8, 16):
                n_blocks = -(-n_out // bn)
                if rows * bn * bk * rows_per_col > 8192 or bk > max(64, 2 * k):
                    continue
                for split in (1, 2, 4):
                    if split == 1 or (n_blocks * split <= 1024 and bk * split <= k):
                        out.append(LinearConfig(bn, bk, split, 4, 1, dot=False))
    return out


def untuned(shapes: list[BenchShape], ms: tuple[int, ...], table: dict) -> list[tuple[int, BenchShape]]:
    """The (M, shape) pairs, M-major, whose own table entry (kind of M's bucket, n_out, k, swiglu) ``table`` lacks
    (``--skip-tuned``: a tune cut short by its time limit goes on where it stopped)."""
    from baton.ops.linear import triton as fast

    return [(m, s) for m in ms for s in shapes
            if (fast.table_kinds(m)[0], s.n // 2 if s.swiglu else s.n, s.k, s.swiglu) not in table]


def tune_linear(shapes: list[BenchShape], dtype: torch.dtype = torch.bfloat16, ms: tuple[int, ...] = (1, 16),
                use_pdl: bool | None = None, seed: int = 0,
                on_row: Callable[[list[dict]], object] | None = None,
                work: list[tuple[int, BenchShape]] | None = None) -> list[dict]:
    """Sweep LinearConfig candidates per (shape, M) and return the best per row with its µs, next to the
    bucket rule's choice (what ``write_table`` turns into this GPU's table). M-major: every shape at the first
    M, then at the next (or the (M, shape) pairs of ``work``); ``on_row(rows so far)`` after each row (a sweep
    cut short still leaves a table)."""
    from baton.ops.linear import triton as fast

    gen = torch.Generator(device="cuda").manual_seed(seed)
    pdl = fast.pdl_enabled(torch.device("cuda")) if use_pdl is None else use_pdl
    rows: list[dict] = []
    for m, base in work if work is not None else [(m, s) for m in ms for s in shapes]:
        s = base.with_m(m)
        n_out = s.n // 2 if s.swiglu else s.n
        inp = _inputs(s, dtype, gen)
        ws = inp["weights"]
        nbytes = _bytes_moved(s, torch.finfo(dtype).bits // 8)
        default = fast.pick_config(m, n_out, s.k, s.swiglu)
        ref = _reference_call(s, inp, ws[0])()
        results = []
        for cfg in dict.fromkeys([default, *_candidates(m, n_out, s.k, s.swiglu)]):
            try:
                if _rel_err(_triton_call(s, inp, ws[0], cfg, pdl)(), ref) > 2e-2:
                    continue
                us = _graph_time_us([_triton_call(s, inp, w, cfg, pdl) for w in ws], replays=10)
            except Exception:  # a candidate that does not compile (resources) is skipped
                continue
            results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        default_us = next((us for us, c in results if c == default), float("nan"))
        best_us, best = results[0]
        rows.append(dict(name=s.name, m=m, n_out=n_out, k=s.k, swiglu=s.swiglu, best=best.__dict__,
                         best_us=best_us, best_gbps=nbytes / best_us / 1e3, default=default.__dict__,
                         default_us=default_us, top=[(us, c.__dict__) for us, c in results[:5]]))
        del inp, ws
        torch.cuda.empty_cache()
        if on_row is not None:
            on_row(rows)
    return rows


def _print_table(rows: list[dict]) -> None:
    keys = [k[:-3] for k in rows[0] if k.endswith("_us")]
    print(f"{'shape':24s} {'M':>3s} " + " ".join(f"{k + ' us':>14s} {'GB/s':>6s}" for k in keys) + "  rel_err")
    for r in rows:
        cells = " ".join(f"{r[k + '_us']:14.2f} {r[k + '_gbps']:6.0f}" for k in keys)
        print(f"{r['name']:24s} {r['m']:3d} {cells}  {r['rel_err']:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, nargs="+", default=[1, 6, 16])
    ap.add_argument("--only", default="", help="substring filter on shape names")
    ap.add_argument("--json", default="", help="write the rows here")
    ap.add_argument("--tune", action="store_true", help="sweep configs instead of timing variants")
    ap.add_argument("--write-table", nargs="?", const="default", default=None, metavar="PATH",
                    help="with --tune: write the winners as this GPU's table (default path: "
                         "baton/ops/linear/tuned/<gpu name>.json), which pick_config then reads")
    ap.add_argument("--skip-tuned", action="store_true",
                    help="with --tune: only the (M, shape) pairs the table read (this GPU's, or --write-table PATH "
                         "when it exists) has no entry for: a tune cut short goes on where it stopped")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="the Ling shapes as one rank of this tensor-parallel size holds them (named ling.tpN.*)")
    args = ap.parse_args()
    ling = LING_SHAPES if args.tp_size == 1 else ling_tp_shapes(args.tp_size)
    shapes = [s for s in ling + SMOL_SHAPES if args.only in s.name]
    if args.write_table and not args.tune:
        raise SystemExit("--write-table needs --tune")

    def save(rows: list[dict]) -> None:
        if args.json:
            dump_json(rows, args.json)
        if args.write_table:
            write_table(rows, torch.cuda.get_device_name(), args.write_table)

    if args.tune:
        work = None
        if args.skip_tuned:
            from baton.ops.linear import triton as fast

            path = fast.table_path(torch.cuda.get_device_name())
            if args.write_table and args.write_table != "default" and os.path.isfile(args.write_table):
                path = args.write_table
            table = fast.read_table(path) if os.path.isfile(path) else {}
            work = untuned(shapes, tuple(args.m), table)
            print(f"--skip-tuned: {len(work)} of {len(shapes) * len(args.m)} (M, shape) pairs lack an entry in {path}")
        rows = tune_linear(shapes, ms=tuple(args.m), work=work,
                           on_row=lambda rows: (save(rows), _print_tuned(rows[-1])))
    else:
        rows = bench_linear(shapes, ms=tuple(args.m))
        _print_table(rows)
    save(rows)
    if args.write_table:
        print(f"wrote {len(rows)} tuned entries to {args.write_table}")
    print(json.dumps({"rows": len(rows)}))


def _print_tuned(r: dict) -> None:
    print(f"{r['name']:24s} M={r['m']:2d} best {r['best_us']:8.2f} us {r['best_gbps']:6.0f} GB/s {r['best']}  "
          f"default {r['default_us']:8.2f} us", flush=True)


if __name__ == "__main__":
    main()
