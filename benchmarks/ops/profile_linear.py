"""Nsight Compute input: production decode-GEMM launches at one Ling / SmolLM2 shape (benchmarks/bench_decode_gemm.py's
shapes), each called twice (the first call compiles), with the table's config or one given on the command line.

    ncu --clock-control none -k regex:linear_kernel --section SpeedOfLight --section WarpStateStats \\
        --section SourceCounters python3 -m benchmarks.ops.profile_linear kda_in_proj:fp8:6 kda_in_proj:bf16:6

Each argument is SHAPE:DTYPE:M with DTYPE bf16, fp8 (w8a16) or w8a8, optionally :CONFIG as
``bench_decode_gemm.cfg_name`` writes it (``swap-64x128-s1-w4-st4-f16-fold``)."""

from __future__ import annotations

import argparse
import re

import torch

from benchmarks.bench_decode_gemm import EPS, SHAPE_BY_NAME, make_inputs, make_weights


def parse_config(name: str):
    """``cfg_name``'s string back to a LinearConfig (forms swap / dot / gemv / prow and the flags it writes)."""
    from baton.ops.linear.triton import LinearConfig

    m = re.fullmatch(r"(swap|dot|gemv|prow)-(\d+)x(\d+)-s(\d+)-w(\d+)((?:-[a-z0-9]+)*)", name)
    if m is None:
        raise SystemExit(f"not a config name: {name!r} (e.g. swap-64x128-s1-w4-st4-f16)")
    form, bn, bk, split, warps, extra = m.groups()
    flags = [f for f in extra.split("-") if f]
    stages = next((int(f[2:]) for f in flags if f.startswith("st")), 1)
    return LinearConfig(int(bn), int(bk), int(split), int(warps), stages, dot=form in ("swap", "dot"),
                        swap=form == "swap", f16="f16" in flags, fold="fold" in flags, bits="bits" in flags,
                        tma="tma" in flags, per_row=form == "prow", pre="pre" in flags)


def parse_spec(spec: str):
    """SHAPE:DTYPE:M[:CONFIG] -> (bench_decode_gemm Shape, dtype, M, LinearConfig or None); a clear exit else."""
    parts = spec.split(":")
    if len(parts) not in (3, 4) or parts[0] not in SHAPE_BY_NAME or parts[1] not in ("bf16", "fp8", "w8a8") \
            or not parts[2].isdigit():
        raise SystemExit(f"not a spec: {spec!r} (SHAPE:DTYPE:M[:CONFIG], DTYPE bf16 | fp8 | w8a8; shapes: "
                         f"{', '.join(SHAPE_BY_NAME)})")
    return SHAPE_BY_NAME[parts[0]], parts[1], int(parts[2]), parse_config(parts[3]) if len(parts) == 4 else None


def call(spec: str) -> None:
    from baton.ops.fp8_linear import triton as ft
    from baton.ops.linear import triton as lt

    shape, dtype, m, cfg = parse_spec(spec)
    fp8 = dtype in ("fp8", "w8a8")
    w = make_weights(shape, "cuda", fp8, copies=False)
    inp = make_inputs(shape, m, "cuda", 7)
    x, nw, res = inp["x"], inp["nw"], inp["res"]
    for _ in range(2):
        if fp8:
            q, sc, rb = w.fp8[0]
            y = ft.fp8_dense(x, q, sc, rb, nw, EPS, None if shape.swiglu else res, shape.swiglu, shape.limit,
                             config=cfg, act_fp8=dtype == "w8a8")
        elif shape.swiglu:
            y = lt.linear_swiglu_fwd(x, w.bf16[0], nw, EPS, shape.limit, config=cfg)
        else:
            y = lt.linear_fwd(x, w.bf16[0], nw, EPS, res, config=cfg)
    torch.cuda.synchronize()
    picked = cfg or lt.pick_config(m, shape.n_out, shape.k, shape.swiglu, fp8, dtype == "w8a8")
    print(f"{spec}: out {tuple(y.shape)}, config {picked}", flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", nargs="+", help="SHAPE:DTYPE:M[:CONFIG], DTYPE bf16 | fp8 | w8a8")
    for spec in ap.parse_args(argv).specs:
        call(spec)


if __name__ == "__main__":
    main()
