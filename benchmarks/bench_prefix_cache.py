"""The prefix cache (baton/cache/prefix.py) on a two-turn conversation, in process: an ``--input-len``-token first
turn, its ``--output-len``-token answer, then a follow-up of ``--followup-len`` new tokens. TTFT of the follow-up
cached (the first turn's states in the cache) against cold (after flush_cache), the first turn's TTFT with the
cache on (its snapshots taken) and off, TPOT with the cache on and off, and the cache's memory (bytes per
snapshot, per token of rows, what the conversation holds, the GPU memory left).

    python -m benchmarks.bench_prefix_cache --num-layers 42 --quantization fp8 [--modes plain,nextn]
        [--input-len 8192] [--output-len 32] [--followup-len 100] [--repeats 3]   # Ling-3.0-flash dummy, one H200
    python -m benchmarks.bench_prefix_cache --model-path embedded --device cpu --input-len 1024   # the CPU model
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

import torch

from benchmarks.bench_ling_flash import flash_dir
from benchmarks.common import env_card, save
from benchmarks.common import timed_request as common_timed_request


def timed_request(engine, prompt: list[int], max_new_tokens: int) -> dict:
    """benchmarks.common.timed_request without its flush: the prefix cache is what is measured."""
    return common_timed_request(engine, prompt, max_new_tokens, cold=False)


def _tokens(engine, prompt: list[int], n: int) -> list[int]:
    from baton.types import Request, SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    return [t for out in engine.generate(Request(list(prompt), sp)) for t in out.token_ids]


def _median(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def run_mode(args, spec: dict) -> dict:
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine

    ling = args.model_path is None
    vocab = 150000 if ling else 49152
    total = args.input_len + args.output_len + args.followup_len
    kw = dict(model_path=flash_dir(), load_format="dummy", dtype="bfloat16", quantization=args.quantization,
              json_model_override_args=json.dumps({"num_hidden_layers": args.num_layers})) if ling else \
        dict(model_path=args.model_path)
    engine = Engine(ServerArgs(device=args.device, context_length=total + args.tpot_len + 64,
                               spec=SpecConfig(**spec), prefix_snapshot_stride=args.stride, **kw))
    gen = torch.Generator().manual_seed(0)
    first = torch.randint(0, vocab, (args.input_len,), generator=gen).tolist()
    new = torch.randint(0, vocab, (args.followup_len,), generator=gen).tolist()
    pc = engine.prefix_cache
    timed_request(engine, first, 16)  # warm: the prefill pieces compile at these lengths
    answer = _tokens(engine, first, args.output_len)
    follow = first + answer + new
    timed_request(engine, follow, 4)
    engine.flush_cache()
    turn1_on, turn1_off, cached, cached_eager, cold, hits = [], [], [], [], [], []
    graphs = engine.prefill_graphs
    for _ in range(args.repeats):
        engine.flush_cache()
        turn1_on.append(timed_request(engine, first, args.output_len))
        cached.append(timed_request(engine, follow, args.output_len))
        hits.append(engine.last_cached_tokens)
        if graphs is not None:  # A/B in the same engine: the follow-up's rest as the eager prefill
            engine.flush_cache()
            timed_request(engine, first, args.output_len)
            engine.prefill_graphs = None
            cached_eager.append(timed_request(engine, follow, args.output_len))
            engine.prefill_graphs = graphs
        engine.flush_cache()
        cold.append(timed_request(engine, follow, args.output_len))
        engine.prefix_cache = None
        turn1_off.append(timed_request(engine, first, args.output_len))
        engine.prefix_cache = pc
    engine.flush_cache()
    timed_request(engine, first, args.output_len)
    timed_request(engine, follow, args.output_len)
    held = pc.stats()
    tpot_on = [timed_request(engine, first, args.tpot_len) for _ in range(2)]
    engine.prefix_cache = None
    tpot_off = [timed_request(engine, first, args.tpot_len) for _ in range(2)]
    engine.prefix_cache = pc
    record = {
        "spec": spec, "cached_tokens": hits,
        "followup_ttft_cached_ms": _median(cached, "ttft_ms"), "followup_ttft_cold_ms": _median(cold, "ttft_ms"),
        "followup_ttft_cached_eager_prefill_ms": _median(cached_eager, "ttft_ms") if cached_eager else None,
        "prefill_graph_buckets": list(graphs.buckets) if graphs is not None else [],
        "turn1_ttft_cache_on_ms": _median(turn1_on, "ttft_ms"),
        "turn1_ttft_cache_off_ms": _median(turn1_off, "ttft_ms"),
        "tpot_cache_on_ms": _median(tpot_on, "tpot_ms"), "tpot_cache_off_ms": _median(tpot_off, "tpot_ms"),
        "prefix_cache_after_conversation": held,
        "runs": {"turn1_on": turn1_on, "turn1_off": turn1_off, "cached": cached, "cached_eager": cached_eager,
                 "cold": cold,
                 "tpot_on": tpot_on, "tpot_off": tpot_off},
    }
    record["ratio"] = record["followup_ttft_cached_ms"] / record["followup_ttft_cold_ms"]
    if torch.cuda.is_available() and args.device != "cpu":
        free, _ = torch.cuda.mem_get_info()
        record.update(gpu_mem_gb=torch.cuda.max_memory_allocated() / 1e9, gpu_free_gb=free / 1e9,
                      snapshots_that_fit_free=int(free // max(held["prefix_cache_snapshot_bytes"], 1)))
    print(json.dumps({k: v for k, v in record.items() if k != "runs"}), flush=True)
    del engine, pc
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return record


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", default=None, help="default: Ling-3.0-flash's config on dummy weights")
    p.add_argument("--device", default="cuda")
    p.add_argument("--num-layers", type=int, default=42)
    p.add_argument("--quantization", default="fp8")
    p.add_argument("--input-len", type=int, default=8192)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--followup-len", type=int, default=100)
    p.add_argument("--tpot-len", type=int, default=256)
    p.add_argument("--stride", type=int, default=4096, help="--prefix-snapshot-stride")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--modes", default="plain,nextn")
    p.add_argument("--nextn-accept", type=float, default=3.25)
    args = p.parse_args()
    modes = {"plain": {}, "nextn": {"algorithm": "NEXTN", "num_steps": 5, "eagle_topk": 1, "num_draft_tokens": 6,
                                     "simulate_accept_len": args.nextn_accept}}
    record = {"benchmark": "prefix_cache", "env": env_card(), "input_len": args.input_len,
              "output_len": args.output_len, "followup_len": args.followup_len, "num_layers": args.num_layers,
              "quantization": args.quantization, "stride": args.stride, "model_path": args.model_path}
    for name in [m.strip() for m in args.modes.split(",") if m.strip()]:
        record[name] = run_mode(args, modes[name])
    save(f"prefix_cache_{args.num_layers}l_{args.input_len}" if args.model_path is None
         else f"prefix_cache_cpu_{args.input_len}", record)


if __name__ == "__main__":
    main()
