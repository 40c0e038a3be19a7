"""Cold-weight timing of the decode MoE at the Ling-3.0-flash shapes (E=512, d=2560, I=768, top-8, bf16).

``python -m benchmarks.ops.bench_moe [--tokens 1 6 16] [--layers 4] [--sweep [--write-table [PATH]]] [--fp8]
[--json out.jsonl]``

Weights: ``--layers`` independent expert sets (6.04 GB each: 512 x 11.8 MB), cycled call after call, so every call
reads weights that the previous calls (>= 94 MB of distinct experts each) have flushed from the 50 MB L2, as in the
model. Each measurement captures ``layers x cycles`` calls into one CUDA graph and replays it (the mean over 20
back-to-back replays, ``benchmarks.ops.timing``), so launch overhead is that of graph replay (what decode pays); the
host-syncing reference ``fused_experts`` runs eagerly.

Routes: ``uniform`` draws every token's 8 experts independently (the worst case: T tokens touch ~8T experts);
``correlated`` keeps each of the previous token's experts with probability 0.6 (verify chains share experts).

Reported per (T, routes, method): µs per call, distinct experts touched (mean over layers), GB/s against the bytes of
the distinct experts (11.8 MB each: what an ideal kernel must read) and that as a fraction of the 4.8 TB/s datasheet.
Methods: ``triton-direct|aligned|hybrid`` (``fused_experts_decode``; with PDL unless ``--no-pdl``), ``triton-direct-up``
(the up-projection alone, to split the direct time), ``torch-gather`` (``fused_experts_dense_gather``, the graph-safe
fallback), ``torch-ref`` (``fused_experts``, eager with its host sync) and the router (``router-triton`` vs
``router-torch`` on [T, 512] logits). ``--sweep`` tries tile variants for each mode (up tiles first, then down tiles,
coordinate descent) and prints the best config per T; with ``--write-table`` the winners of the direct, aligned and
fp8 sweeps go into this GPU's tile table (baton/ops/moe/tuned/<gpu name>.json, or PATH), as the entry of their
(kind, T): kinds ``direct``, ``aligned``, ``fp8`` (baton/ops/moe/table.py; hybrid has no entry of its own).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
from collections.abc import Callable, Sequence

import torch

from benchmarks.ops.timing import eager_time_us, graph_time_us

E, D, INTER, TOPK, N_GROUP, TOPK_GROUP = 512, 2560, 768, 8, 8, 4
EXPERT_BYTES = 3 * INTER * D * 2  # w13 + w2 of one expert, bf16: 11.8 MB
PEAK_GBS = 4800.0


def _routes(num_tokens: int, kind: str, gen: torch.Generator) -> torch.Tensor:
    """[T, k] int32 ids, distinct within each token."""
    rows: list[list[int]] = []
    for t in range(num_tokens):
        keep = []
        if kind == "correlated" and t > 0:
            keep = [e for e in rows[-1] if torch.rand((), generator=gen).item() < 0.6]
        row = list(keep)
        while len(row) < TOPK:
            e = int(torch.randint(0, E, (), generator=gen))
            if e not in row:
                row.append(e)
        perm = torch.randperm(TOPK, generator=gen).tolist()
        rows.append([row[i] for i in perm])
    return torch.tensor(rows, dtype=torch.int32)


def _time_graph(calls: Sequence[Callable[[], object]], replays: int = 20) -> float:
    """Capture all ``calls`` into one CUDA graph; µs per call over ``replays`` back-to-back replays."""
    return graph_time_us(calls, replays, stat="mean")


def _time_eager(calls: Sequence[Callable[[], object]], reps: int = 3) -> float:
    return eager_time_us(calls, reps, warmup=True, stat="mean")


def _tile_variants(mode: str) -> tuple[list, list]:
    from baton.ops.moe.triton import MoETile

    if mode == "fp8":  # BLOCK_N divides the 128-row scale blocks; BLOCK_K divides 128 or is a multiple of it
        tiles = [(8, 128, 4, 4), (8, 256, 4, 4), (8, 512, 4, 3), (16, 64, 4, 6), (16, 128, 4, 4), (16, 128, 8, 4),
                 (16, 256, 4, 4), (16, 256, 8, 3), (16, 512, 4, 3), (16, 512, 8, 3), (32, 128, 4, 4), (32, 256, 4, 3),
                 (32, 256, 8, 3), (64, 128, 8, 3), (64, 256, 8, 3)]
        return [MoETile(*t) for t in tiles], [MoETile(*t) for t in tiles]
    if mode == "direct":
        up = [MoETile(bn, bk, w, s) for bn, bk, w, s in [(8, 256, 4, 4), (16, 128, 4, 4), (16, 256, 4, 3),
                                                           (16, 256, 4, 4), (16, 512, 8, 3), (32, 256, 4, 3),
                                                           (32, 128, 4, 4)]]
        down = [MoETile(bn, bk, w, s) for bn, bk, w, s in [(8, 256, 4, 4), (8, 128, 4, 6), (16, 128, 4, 4),
                                                             (16, 256, 4, 3), (16, 256, 4, 4), (32, 256, 4, 3),
                                                             (32, 128, 4, 4)]]
    else:
        up = [MoETile(bn, bk, w, s) for bn, bk, w, s in [(16, 128, 4, 4), (32, 64, 4, 6), (32, 128, 4, 3),
                                                           (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3),
                                                           (32, 256, 4, 3)]]
        down = [MoETile(bn, bk, w, s) for bn, bk, w, s in [(16, 128, 4, 4), (32, 64, 4, 6), (32, 128, 4, 3),
                                                             (32, 128, 4, 4), (64, 64, 4, 4), (64, 128, 4, 3),
                                                             (32, 256, 4, 3)]]
    return up, down


def bench_moe(tokens: Sequence[int] = (1, 6, 16), layers: int = 4, cycles: int = 2, route_kinds: Sequence[str] = (
        "uniform", "correlated"), modes: Sequence[str] = ("direct", "aligned", "hybrid"), pdl: bool = True,
        sweep: bool = False, torch_baselines: bool = True, seed: int = 0, fp8: bool = False,
        tp_size: int = 1, write_table: str | None = None) -> list[dict]:
    """Time the decode MoE on CUDA with cold weights; returns one dict per measurement (also printed).
    ``tp_size``: the experts as one tensor-parallel rank holds them (intermediate size I / tp_size).
    ``write_table`` (with ``sweep``): "default" (this GPU's table) or a path; each sweep's winner is merged into it as
    soon as it is known (the first route kind swept at a (kind, T) gives its entry)."""
    if INTER % tp_size or (fp8 and (INTER // tp_size) % 128):
        raise SystemExit(f"--tp-size {tp_size}: I = {INTER} must split into whole 128-wide fp8 blocks")
    inter = INTER // tp_size
    import baton.ops.moe.triton as mt
    from baton.ops.moe.naive import fused_experts, fused_experts_dense_gather, grouped_topk

    assert torch.cuda.is_available(), "bench_moe needs CUDA"
    dev = torch.device("cuda")
    if not pdl:
        mt.pdl_enabled = lambda device: False  # type: ignore[assignment]
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    # [layers] x (w13 [E, 2I, d], w2 [E, d, I]) bf16: 6.04 GB per layer
    weights = []
    scales = []  # fp8: (w13_scale, w2_scale) per layer
    for _ in range(layers):
        w13 = torch.empty(E, 2 * inter, D, device=dev, dtype=torch.bfloat16).normal_(0, D**-0.5)
        w2 = torch.empty(E, D, inter, device=dev, dtype=torch.bfloat16).normal_(0, inter**-0.5)
        if fp8:
            from baton.ops.quant import quantize_fp8_block, quantize_fp8_gate_up

            (w13, s13), (w2, s2) = quantize_fp8_gate_up(w13), quantize_fp8_block(w2)
            scales.append((s13, s2))
        weights.append((w13, w2))
    expert_bytes = EXPERT_BYTES // tp_size // (2 if fp8 else 1)
    print(f"# {layers} layers of experts: {layers * E * expert_bytes / 1e9:.1f} GB{' fp8' if fp8 else ''}, "
          f"pdl={pdl and mt.pdl_enabled(dev)}")
    if fp8:  # the direct work list only, and the torch baselines are bf16
        modes, torch_baselines = ["fp8"], False
    results: list[dict] = []
    tuned: dict[tuple[str, int], dict] = {}

    def record(num_tokens: int, kind: str, distinct: float, method: str, us: float, extra: dict | None = None,
               bytes_per_expert: int = expert_bytes):
        gbs = distinct * bytes_per_expert / (us * 1e-6) / 1e9
        row = dict(T=num_tokens, routes=kind, distinct=round(distinct, 1), method=method, us=round(us, 2),
                   gbs=round(gbs, 1), frac_peak=round(gbs / PEAK_GBS, 3), **(extra or {}))
        results.append(row)
        print(f"T={num_tokens:<3} {kind:<10} distinct={distinct:6.1f} {method:<22} {us:9.2f} us "
              f"{gbs:8.1f} GB/s ({100 * gbs / PEAK_GBS:5.1f}% of 4.8 TB/s)" + (f" {extra}" if extra else ""))
        return row

    for num_tokens in tokens:
        x = torch.randn(num_tokens, D, device=dev, dtype=torch.bfloat16)
        res = torch.randn_like(x)
        shared = torch.randn_like(x)
        logits = torch.randn(num_tokens, E, device=dev) * 2
        bias = torch.randn(E, device=dev) * 0.05
        # router (hot: it is tiny)
        router = functools.partial(mt.grouped_topk_fused, logits, bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)
        record(num_tokens, "-", 0.0, "router-triton", _time_graph([router] * 8))
        router = functools.partial(_torch_router, grouped_topk, logits, bias)
        record(num_tokens, "-", 0.0, "router-torch", _time_graph([router] * 8))
        for kind in route_kinds if num_tokens > 1 else route_kinds[:1]:
            ids = [_routes(num_tokens, kind, gen).to(dev) for _ in range(layers)]
            tw = [torch.rand(num_tokens, TOPK, device=dev) / 4 + 0.1 for _ in range(layers)]
            distinct = sum(len(set(i.flatten().tolist())) for i in ids) / layers
            per_layer = [(x, *weights[i], ids[i], tw[i], *(scales[i] if fp8 else ())) for i in range(layers)]

            def calls_for(fn: Callable[..., object], per_layer=per_layer, **kw) -> list[Callable[[], object]]:
                return [functools.partial(fn, *per_layer[i], **kw) for _ in range(cycles) for i in range(layers)]

            ref_args = per_layer[0][:5]
            if fp8:  # the reference computes with the dequantised experts
                from baton.ops.quant import dequantize_fp8_block, dequantize_fp8_gate_up

                (w13_0, w2_0), (s13_0, s2_0) = weights[0], scales[0]
                ref_args = (x, dequantize_fp8_gate_up(w13_0, s13_0), dequantize_fp8_block(w2_0, s2_0), ids[0], tw[0])
            ref = fused_experts(*ref_args, 4.0) + shared.float() + res.float()
            for mode in modes:
                run = functools.partial(_decode, mt, residual=res, shared_out=shared, mode=mode)
                err = (run(*per_layer[0]).float() - ref).abs().max().item()
                record(num_tokens, kind, distinct, f"triton-{mode}", _time_graph(calls_for(run)),
                       {"max_err": round(err, 4)})
                if mode == "direct" and not fp8:
                    up = functools.partial(_up_direct, mt, mt.get_config(num_tokens, "direct").up, mt.pdl_enabled(dev))
                    record(num_tokens, kind, distinct, "triton-direct-up", _time_graph(calls_for(up)),
                           bytes_per_expert=2 * inter * D * 2)  # GB/s against the w13 bytes only
                if sweep:
                    best = _sweep(mt, mode, num_tokens, calls_for, run)
                    record(num_tokens, kind, distinct, f"triton-{mode}-best", best[0], {"config": repr(best[1])})
                    if write_table and mode != "hybrid" and (mode, num_tokens) not in tuned:
                        tuned[(mode, num_tokens)] = {"kind": mode, "max_tokens": num_tokens, "config": best[1],
                                                     "us": round(best[0], 2), "routes": kind, "inter": inter}
                        _write_table(list(tuned.values()), write_table)
            if torch_baselines:
                gather = calls_for(fused_experts_dense_gather, swiglu_limit=4.0)
                record(num_tokens, kind, distinct, "torch-gather", _time_graph(gather[:layers], replays=5))
                eager = calls_for(fused_experts, swiglu_limit=4.0)
                record(num_tokens, kind, distinct, "torch-ref", _time_eager(eager[:layers]))
    return results


def _write_table(rows: list[dict], path: str) -> None:
    from baton.ops.moe import table

    out = table.write_table(rows, torch.cuda.get_device_name(), path)
    print(f"# wrote {len(rows)} tuned entries to {out}", flush=True)


def _torch_router(grouped_topk, logits: torch.Tensor, bias: torch.Tensor):
    return grouped_topk(torch.sigmoid(logits), bias, TOPK, N_GROUP, TOPK_GROUP, True, 2.5)


def _decode(mt, x, w13, w2, ids, tw, w13_scale=None, w2_scale=None, *, mode, **kw):
    """One decode MoE call; mode "fp8" is the direct work list over fp8 experts (their scales passed along)."""
    if mode == "fp8":
        return mt.fused_experts_decode(x, w13, w2, ids, tw, 4.0, mode="direct", w13_scale=w13_scale,
                                       w2_scale=w2_scale, **kw)
    return mt.fused_experts_decode(x, w13, w2, ids, tw, 4.0, mode=mode, **kw)


def _up_direct(mt, tile, pdl: bool, x, w13, w2, ids, tw):
    return mt.moe_up_direct_fwd(x, w13, ids.view(-1), TOPK, 4.0, tile, pdl)


def _sweep(mt, mode: str, num_tokens: int, calls_for, run) -> tuple[float, object]:
    """Coordinate descent: best up tile with the default down tile, then the best down tile."""
    base = mt.get_config(num_tokens, mode if mode in ("direct", "fp8") else "aligned")
    if mode == "hybrid":
        base = dataclasses.replace(base, down=mt.get_config(num_tokens, "direct").down)
    up_tiles, down_tiles = _tile_variants(mode if mode in ("direct", "fp8") else "aligned")
    if mode == "hybrid":
        down_tiles = _tile_variants("direct")[1]
    best_us, best_cfg = float("inf"), base
    for up in up_tiles:
        cfg = dataclasses.replace(base, up=up)
        us = _time_graph(calls_for(run, config=cfg))
        print(f"  sweep {mode} T={num_tokens} up {up}: {us:.2f} us", flush=True)  # a sweep cut short still tells
        if us < best_us:
            best_us, best_cfg = us, cfg
    for down in down_tiles:
        cfg = dataclasses.replace(best_cfg, down=down)
        us = _time_graph(calls_for(run, config=cfg))
        print(f"  sweep {mode} T={num_tokens} down {down}: {us:.2f} us", flush=True)
        if us < best_us:
            best_us, best_cfg = us, cfg
    return best_us, best_cfg


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6, 16])
    ap.add_argument("--layers", type=int, default=4, help="expert sets cycled (6.04 GB each)")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["direct", "aligned", "hybrid"])
    ap.add_argument("--routes", nargs="+", default=["uniform", "correlated"])
    ap.add_argument("--no-pdl", action="store_true")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--write-table", nargs="?", const="default", default=None, metavar="PATH",
                    help="with --sweep: merge the winners into this GPU's tile table (default path: "
                         "baton/ops/moe/tuned/<gpu name>.json), which the kernels then read")
    ap.add_argument("--no-torch", action="store_true", help="skip the torch baselines")
    ap.add_argument("--fp8", action="store_true",
                    help="fp8 e4m3 experts with 128 x 128 block scales (the direct work list; 3.0 GB a layer)")
    ap.add_argument("--tp-size", type=int, default=1,
                    help="the experts as one rank of this tensor-parallel size holds them (I / tp-size wide)")
    ap.add_argument("--json", default=None, help="write one JSON line per measurement")
    args = ap.parse_args(argv)
    if args.write_table and not args.sweep:
        raise SystemExit("--write-table needs --sweep")
    rows = bench_moe(args.tokens, args.layers, args.cycles, args.routes, args.modes, not args.no_pdl, args.sweep,
                     not args.no_torch, fp8=args.fp8, tp_size=args.tp_size, write_table=args.write_table)
    if args.json:
        with open(args.json, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
