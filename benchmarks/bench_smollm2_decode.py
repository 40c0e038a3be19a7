"""SmolLM2-135M-Instruct, plain greedy decode at batch 1 on one GPU: baton (CUDA graphs) against Hugging Face
transformers ``generate`` in the same run (eager, and with a StaticCache + torch.compile(mode="reduce-overhead")),
with the floor.

    python benchmarks/bench_smollm2_decode.py [--prompt-len 512] [--new-tokens 256] [--hf-new-tokens 64]

Floor: the bytes one token must read (every weight once in bf16, the tied lm_head counted once, the KV
cache at the mean context) over 4.2 TB/s, and separately kernels-per-step x the ~1 µs graph launch gap.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

import torch

from benchmarks.common import env_card, save, summarize, timed_request


def bytes_per_token(engine, context: int) -> int:
    weights = sum(p.nbytes for p in engine.model.parameters())
    kv = sum(c.k[0].nbytes + c.v[0].nbytes for c in engine.runner.cache.layers.values()) * context
    return weights + kv


def hf_generate(engine, prompt_ids: list[int], new_tokens: int, compiled: bool = False) -> dict:
    """transformers LlamaForCausalLM with the same weights, greedy ``generate`` in bf16: eager, or (``compiled``)
    with a StaticCache and ``torch.compile(mode="reduce-overhead")`` (CUDA graphs), transformers' own fast path.
    Per-token time = (time of ``new_tokens`` - time of 1) / (new_tokens - 1), each after a warm-up generate."""
    from baton.models.hf_export import to_hf_llama

    model = to_hf_llama(engine.model, engine.device, torch.bfloat16)
    # compiled: generate itself compiles the decoding forward when the cache is static (its CompileConfig,
    # torch.compile with mode "reduce-overhead"); wrapping model.forward by hand breaks its cudagraph trees
    kwargs = {"cache_implementation": "static"} if compiled else {}
    ids = torch.tensor([prompt_ids], device=engine.device)
    times = {}
    for n in (1, new_tokens):
        with torch.inference_mode():
            for _ in range(2 if compiled else 1):  # warm (compiled: the compile, then the graph capture)
                model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kwargs)
            torch.cuda.synchronize()
            times[n] = time.perf_counter() - t0
    per_token = (times[new_tokens] - times[1]) / (new_tokens - 1)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"ms_per_token": 1e3 * per_token, "tok_s": 1.0 / per_token, "new_tokens": new_tokens,
            "mode": "StaticCache + torch.compile(reduce-overhead)" if compiled else "eager generate"}


def measure(args, prompt: list[int], fused: bool):
    """A fresh engine with BATON_FUSED_ATTENTION = ``fused`` (read while its graphs are captured): one warm-up
    request, ``--repeats`` timed ones; (engine, runs, the last request's tokens)."""
    from baton.config import ServerArgs
    from baton.engine.engine import Engine

    os.environ["BATON_FUSED_ATTENTION"] = "1" if fused else "0"
    engine = Engine(ServerArgs(model_path=args.model_path, load_format=args.load_format, device="cuda",
                               dtype="bfloat16",
                               context_length=args.prompt_len + args.new_tokens + 64))
    timed_request(engine, prompt, 32)  # warm
    runs = [timed_request(engine, prompt, args.new_tokens) for _ in range(args.repeats)]
    return engine, runs, list(engine.last_sequence)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--new-tokens", type=int, default=256)
    p.add_argument("--hf-new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model-path", default=None,
                   help="default: the embedded GGUF; with --load-format dummy, "
                        "benchmarks/configs/smollm2-135m-instruct times the same shapes without the GGUF")
    p.add_argument("--load-format", default="auto", help="dummy: random weights at the SmolLM2 config")
    p.add_argument("--skip-hf", action="store_true", help="skip HF's eager generate")
    p.add_argument("--skip-hf-compile", action="store_true",
                   help="skip the in-run peer: HF generate, StaticCache, torch.compile(mode='reduce-overhead')")
    p.add_argument("--fused-attention", choices=["off", "on", "ab"], default="off",
                   help="BATON_FUSED_ATTENTION for the measured engine; ab: one engine each way in this run, "
                        "the ratio and whether their greedy tokens agree (the headline figures are 'off')")
    args = p.parse_args()

    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (args.prompt_len,), generator=gen).tolist()
    ways = {"off": [False], "on": [True], "ab": [False, True]}[args.fused_attention]
    measured = {fused: measure(args, prompt, fused) for fused in ways}
    engine, runs, _ = measured[ways[0]]
    tok_s = summarize(runs, "decode_tok_s")
    step_bytes = bytes_per_token(engine, args.prompt_len + args.new_tokens // 2)
    record = {"benchmark": "smollm2_decode", "env": env_card(), "prompt_len": args.prompt_len,
              "new_tokens": args.new_tokens, "baton_decode_tok_s": tok_s,
              "baton_ms_per_token": 1e3 / tok_s["median"], "bytes_per_token": step_bytes,
              "floor_bandwidth_ms": step_bytes / 4.2e12 * 1e3, "runs": runs}
    if not args.skip_hf:
        record["hf_generate"] = hf_generate(engine, prompt, args.hf_new_tokens)
        record["speedup_vs_hf_generate"] = tok_s["median"] / record["hf_generate"]["tok_s"]
    if len(ways) == 2:
        (_, runs_off, tokens_off), (_, runs_on, tokens_on) = measured[False], measured[True]
        off, on = summarize(runs_off, "decode_tok_s")["median"], summarize(runs_on, "decode_tok_s")["median"]
        record["fused_attention_ab"] = {"off_tok_s": off, "on_tok_s": on, "on_over_off": on / off,
                                        "same_tokens": tokens_off == tokens_on, "runs_on": runs_on}
        print(f"fused attention: off {off:.0f} tok/s, on {on:.0f} tok/s (x{on / off:.3f}), "
              f"same tokens: {tokens_off == tokens_on}")
    if not args.skip_hf_compile:  # the peer measured in this run (it was a constant, 1.54 ms, before 2026-12-01)
        try:
            peer = hf_generate(engine, prompt, args.hf_new_tokens, compiled=True)
        except Exception as e:  # the peer's failure is recorded; baton's figures are still saved
            record["hf_static_compile"] = {"error": f"{type(e).__name__}: {e}"[:2000]}
        else:
            record["hf_static_compile"] = peer
            record["speedup_vs_hf_static_compile"] = peer["ms_per_token"] / record["baton_ms_per_token"]
            print(f"HF StaticCache + torch.compile: {peer['ms_per_token']:.3f} ms/token; baton "
                  f"{record['baton_ms_per_token']:.3f} ms/token (x{record['speedup_vs_hf_static_compile']:.2f})")
    save("smollm2_decode", record)


if __name__ == "__main__":
    main()
