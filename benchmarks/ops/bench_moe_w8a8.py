"""Cold-weight timing of the fp8 decode / verify MoE at the Ling-3.0-flash shapes (E=512, d=2560, I=768, top-8, fp8
e4m3 experts with 128 x 128 block scales, bf16 activations): today's default fp8 path against the w8a8 path
(``act_fp8=True``) and the one-program alignment against the torch one, in one run.

``python -m benchmarks.ops.bench_moe_w8a8 [--tokens 1 6 17] [--layers 4] [--sweep] [--write-table [PATH]]
[--json out.jsonl]``

Weights: ``--layers`` independent fp8 expert sets (3.0 GB each), cycled call after call (``layers x cycles`` calls
with fresh independent uniform routes each) in one CUDA graph, replayed back to back (``benchmarks.ops.timing``):
between two reads of an expert set the other calls stream >= 3 x 47 MB, past the 50 MB L2. Reported per (T,
method): µs per call, distinct experts touched (mean), GB/s against the bytes of those experts (fp8 weights + scales:
what an ideal kernel must read) and that as a fraction of 4.2 TB/s (the copy bandwidth measured on this card).

Methods: ``before`` (``fused_experts_decode`` as it was: direct fp8 for T*k <= 128 pairs, else aligned fp8 with the
torch alignment), ``default`` (the same numerics with the one-program alignment), ``w8a8`` (``act_fp8=True``, this
GPU's ``fp8_w8a8`` tiles, or the sweep's best), and the alignment alone (``align-triton`` / ``align-torch``).
``--sweep`` tries w8a8 up tiles then down tiles (coordinate descent) per T; ``--write-table`` writes the winners as
kind ``fp8_w8a8`` into this GPU's MoE table (T = 1 for T <= 2, T = 6 for T <= 8, T = 17 for every larger T).

``--act f16``: the same kernels with fp16 activations (``mode="f16"``, w8a16 numerics on the fp16 MMA) against the
direct fp8 kernels (``before``, forced: the table may already prefer f16); the sweep's winners are written as kind
``fp8_f16``, each with ``preferred`` = whether it beat the direct kernels at its T (what the default then takes).
Both sweeps end with the token-down form (``token_down``: no alignment at any T, the down kernel with the combine
per token, two launches).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable, Sequence

import torch

from benchmarks.ops.timing import graph_time_us

E, D, INTER, TOPK = 512, 2560, 768, 8
PEAK_GBS = 4200.0
SCALE_BYTES = 4 * (2 * math.ceil(INTER / 128) * math.ceil(D / 128) + math.ceil(D / 128) * math.ceil(INTER / 128))
EXPERT_BYTES = 3 * INTER * D + SCALE_BYTES  # fp8 w13 + w2 + their scales: 5.9 MB


# w8a8 tile sweep per T: up tiles (BLOCK_N, warps, stages[, split_k]; BLOCK_K is 128), then down tiles with the
# best up
SWEEP = {
    1: ([(64, 4, 5), (64, 4, 6), (64, 4, 8), (64, 8, 6), (32, 4, 8), (128, 8, 4), (64, 4, 5, 2)],
        [(128, 4, 4), (128, 8, 3), (128, 8, 4), (64, 4, 5), (128, 4, 6)]),
    6: ([(64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 8, 3), (128, 8, 4), (64, 4, 6)],
        [(128, 8, 3), (128, 8, 4), (128, 4, 3), (128, 4, 6), (64, 4, 3)]),
    17: ([(128, 8, 3), (128, 8, 4), (128, 4, 3), (64, 4, 3), (128, 8, 5)],
         [(128, 8, 3), (128, 8, 4), (128, 4, 4), (128, 8, 5)]),
}


# the token-down form's down tiles (moe_down_token_kernel: program = (N-block, token), so wide tiles halve the
# per-chunk activation work a weight carries; narrow ones give T = 1 more programs)
TOKEN_DOWN = [(128, 4, 3), (128, 8, 3), (64, 4, 3), (64, 4, 4)]


class _Skip:
    """Stands in for a kernel in the time breakdown: ``kernel[grid](...)`` launches nothing."""

    def __getitem__(self, grid):
        return lambda *a, **k: None


def _routes(num_tokens: int, gen: torch.Generator) -> torch.Tensor:
    """[T, k] int32: each token's 8 distinct experts uniform at random, tokens independent."""
    return torch.stack([torch.randperm(E, generator=gen)[:TOPK] for _ in range(num_tokens)]).int()


def _fp8_layer(dev: torch.device, gen: torch.Generator):
    w13 = torch.empty(E, 2 * INTER, D, dtype=torch.float8_e4m3fn, device=dev)
    w2 = torch.empty(E, D, INTER, dtype=torch.float8_e4m3fn, device=dev)
    for w in (w13, w2):  # random normal fp8 values, drawn in chunks
        for i in range(0, E, 64):
            w[i:i + 64] = (torch.randn(w[i:i + 64].shape, device=dev, generator=gen) * 40).to(torch.float8_e4m3fn)
    s13 = torch.rand(E, 2 * math.ceil(INTER / 128), math.ceil(D / 128), device=dev, generator=gen) * 1e-3 + 1e-4
    s2 = torch.rand(E, math.ceil(D / 128), math.ceil(INTER / 128), device=dev, generator=gen) * 1e-3 + 1e-4
    return w13, s13, w2, s2


def bench(tokens: Sequence[int], layers: int, cycles: int, sweep: bool, log: Callable[[dict], None],
          act: str = "e4m3") -> list[dict]:
    import baton.ops.moe.triton as mt
    from baton.ops.moe.table import MoEConfig, MoETile

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    cpu_gen = torch.Generator().manual_seed(0)
    sets = [_fp8_layer(dev, gen) for _ in range(layers)]
    winners = []
    def one(num_tokens: int) -> None:
        n_calls = layers * cycles
        ids = [_routes(num_tokens, cpu_gen).to(dev) for _ in range(n_calls)]
        tw = [torch.rand(num_tokens, TOPK, device=dev, generator=gen) + 0.1 for _ in range(n_calls)]
        xs = [torch.randn(num_tokens, D, device=dev, generator=gen).to(torch.bfloat16) for _ in range(n_calls)]
        res = torch.randn(num_tokens, D, device=dev, generator=gen).to(torch.bfloat16)
        distinct = sum(int(torch.unique(i).numel()) for i in ids) / n_calls
        nbytes = distinct * EXPERT_BYTES

        def calls(**kw) -> list[Callable[[], object]]:
            out = []
            for c in range(n_calls):
                w13, s13, w2, s2 = sets[c % layers]
                out.append(lambda c=c, w13=w13, s13=s13, w2=w2, s2=s2: mt.fused_experts_decode(
                    xs[c], w13, w2, ids[c], tw[c], 7.0, residual=res, w13_scale=s13, w2_scale=s2, **kw))
            return out

        def run(method: str, extra: dict | None = None, **kw) -> float:
            try:
                us = graph_time_us(calls(**kw), 20, stat="mean")
            except Exception as exc:  # a tile that does not compile: reported, skipped
                log({"tokens": num_tokens, "method": method, "error": repr(exc)[:300], **(extra or {})})
                return float("inf")
            gbs = nbytes / us / 1e3
            rec = {"tokens": num_tokens, "method": method, "us": round(us, 2), "distinct_experts": distinct,
                   "mbytes": round(nbytes / 1e6, 1), "gbs": round(gbs, 1),
                   "pct_4p2": round(100 * gbs / PEAK_GBS, 1), **(extra or {})}
            log(rec)
            return us

        old_align = "torch" if num_tokens * TOPK > 128 else None
        direct = {"mode": "direct"} if num_tokens * TOPK <= mt.FP8_DIRECT_MAX_PAIRS else {}
        before_us = run("before", {"note": "default fp8 path, torch alignment past 128 pairs" if old_align
                                   else "the direct fp8 kernels"}, align=old_align, **direct)
        if old_align:
            run("default", {"note": "default fp8 numerics, one-program alignment"})
        name, kind = ("f16", "fp8_f16") if act == "f16" else ("w8a8", "fp8_w8a8")
        form = {"mode": "f16"} if act == "f16" else {"act_fp8": True}
        base = mt.get_config(num_tokens, kind)
        best_us = run(name, {"config": repr(base)}, config=base, **form)
        best = base
        if sweep:
            ups, downs = SWEEP.get(num_tokens, SWEEP[17])
            cur = base
            for bn, w, st, *split in ups:
                cfg = MoEConfig(up=MoETile(bn, 128, w, st, *split), down=cur.down, block_m=16)
                us = run(f"{name}-sweep", {"config": repr(cfg)}, config=cfg, **form)
                if us < best_us:
                    best_us, best = us, cfg
            cur = best
            for bn, w, st in downs:
                cfg = MoEConfig(up=cur.up, down=MoETile(bn, 128, w, st), block_m=16)
                us = run(f"{name}-sweep", {"config": repr(cfg)}, config=cfg, **form)
                if us < best_us:
                    best_us, best = us, cfg
            # direct at any T with the combine in the down kernel (two launches, no alignment, no per-pair rows)
            for bn, w, st in TOKEN_DOWN:
                cfg = MoEConfig(up=best.up, down=MoETile(bn, 128, w, st), block_m=16, token_down=True)
                us = run(f"{name}-sweep-token-down", {"config": repr(cfg)}, config=cfg, **form)
                if us < best_us:
                    best_us, best = us, cfg
            best = dataclasses.replace(best, preferred=act != "f16" or best_us < before_us)
            run(f"{name}-best", {"config": repr(best), "before_us": round(before_us, 2)}, config=best, **form)
            winners.append({"tokens": num_tokens, "config": best, "us": round(best_us, 2), "kind": kind})
        if act == "f16":  # the fp16 form against the direct kernels' numerics on one call's inputs
            w13, s13, w2, s2 = sets[0]
            ref = mt.fused_experts_decode(xs[0], w13, w2, ids[0], tw[0], 7.0, w13_scale=s13, w2_scale=s2,
                                          **direct).float()
            got = mt.fused_experts_decode(xs[0], w13, w2, ids[0], tw[0], 7.0, w13_scale=s13, w2_scale=s2,
                                          config=best, **form).float()
            rel = ((got - ref).norm() / ref.norm()).item()
            log({"tokens": num_tokens, "method": "f16-error", "rel_vs_direct": rel})
            return
        # the L2 prefetches (off by default) on: the down kernel's, then both; then where the w8a8 time goes: the
        # up kernel alone (down and combine skipped), up + down (combine skipped): the differences are the later
        # stages' share
        mt.W8A8_PREFETCH = True
        run("w8a8-prefetch-down", {"config": repr(best)}, act_fp8=True, config=best)
        if num_tokens >= mt.ALIGNED_MIN_TOKENS:  # the up kernel's prefetch (aligned only)
            mt.W8A8_PREFETCH_UP_GROUPS = 4
            run("w8a8-prefetch-both", {"config": repr(best)}, act_fp8=True, config=best)
        mt.W8A8_PREFETCH, mt.W8A8_PREFETCH_UP_GROUPS = False, 0
        saved = mt.moe_down_w8a8_kernel, mt.moe_combine_fwd
        mt.moe_combine_fwd = lambda y, flat_ids, top_k, shared_out, residual, out, tile, pdl: out
        run("w8a8-up+down-only", {"config": repr(best)}, act_fp8=True, config=best)
        mt.moe_down_w8a8_kernel = _Skip()
        run("w8a8-up-only", {"config": repr(best)}, act_fp8=True, config=best)
        mt.moe_down_w8a8_kernel, mt.moe_combine_fwd = saved
        # w8a8 against the default fp8 numerics on one call's inputs (relative norm of the routed part)
        w13, s13, w2, s2 = sets[0]
        ref = mt.fused_experts_decode(xs[0], w13, w2, ids[0], tw[0], 7.0, w13_scale=s13, w2_scale=s2).float()
        got = mt.fused_experts_decode(xs[0], w13, w2, ids[0], tw[0], 7.0, w13_scale=s13, w2_scale=s2, act_fp8=True,
                                      config=best).float()
        log({"tokens": num_tokens, "method": "w8a8-error", "rel_vs_default": ((got - ref).norm() / ref.norm()).item()})
        # the alignment alone
        flat = [i.view(-1) for i in ids]
        if num_tokens == tokens[-1]:  # and the most pairs the one-program alignment takes: 32 tokens x 8
            flat32 = [_routes(32, cpu_gen).to(dev).view(-1) for _ in range(n_calls)]
            for name, fn in (("align-triton", lambda f: mt.moe_align_fwd(f, E, 16, mt.pdl_enabled(dev))),
                             ("align-torch", lambda f: mt.moe_align_torch(f, E, 16))):
                us = graph_time_us([lambda f=f, fn=fn: fn(f) for f in flat32], 20, stat="mean")
                log({"tokens": 32, "method": name, "us": round(us, 2), "pairs": 256})
        if num_tokens >= mt.ALIGNED_MIN_TOKENS:
            for name, fn in (("align-triton", lambda f: mt.moe_align_fwd(f, E, 16, mt.pdl_enabled(dev))),
                             ("align-torch", lambda f: mt.moe_align_torch(f, E, 16))):
                us = graph_time_us([lambda f=f, fn=fn: fn(f) for f in flat], 20, stat="mean")
                log({"tokens": num_tokens, "method": name, "us": round(us, 2), "pairs": num_tokens * TOPK})

    for num_tokens in tokens:
        one(num_tokens)
    return winners


def write_winners(winners: list[dict], path: str) -> str:
    from baton.ops.moe import table

    keys = {1: [1, 2], 6: [8], 17: [table.ANY_T]}
    rows = []
    for w in winners:
        for key in keys.get(w["tokens"], []):
            rows.append({"kind": w["kind"], "max_tokens": key, "config": w["config"], "us": w["us"],
                         "tuned_at_tokens": w["tokens"]})
    return table.write_table(rows, torch.cuda.get_device_name(), path)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 6, 17])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--write-table", nargs="?", const="default", default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--act", choices=("e4m3", "f16"), default="e4m3",
                    help="the tensor-core form timed and swept: e4m3 (w8a8) or f16 (w8a16 on the fp16 MMA)")
    args = ap.parse_args(argv)
    fh = open(args.json, "a") if args.json else None

    def log(rec: dict) -> None:
        print(json.dumps(rec), flush=True)
        if fh:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()

    winners = bench(args.tokens, args.layers, args.cycles, args.sweep, log, args.act)
    if args.write_table and winners:
        print("table:", write_winners(winners, args.write_table), flush=True)


if __name__ == "__main__":
    main()
