"""The embedded SmolLM2-135M-Instruct on the CPU: baton plain, baton with its default drafter, and llama.cpp
(llama-cpp-python) on the same GGUF file, prompt and token count, in one run.

    python -m benchmarks.bench_cpu [--new-tokens 128] [--ttft-prompt-len 512] [--repeats 3] [--dtype auto]
        [--configs plain,default,dspark,llama.cpp] [--threads N | --default-threads] [--json PATH]
    python -m benchmarks.bench_cpu --profile 32 [--dtype auto|float32]   # the per-op profile of decode steps

Threads: ``--threads N`` gives both engines N (llama.cpp's decode and batch threads); without it baton takes
``baton.env.num_threads()`` (the cores of its affinity mask) and llama.cpp the same; ``--default-threads`` leaves
each engine its own default (llama-cpp-python: ``cpu_count() // 2`` decode threads, ``cpu_count()`` batch threads).

Every config gets one warm-up request (baton's C kernels load, or build on the machine's first run; llama.cpp maps
its file), then ``--repeats`` timed ones, interleaved config by config, so a machine whose load drifts shifts every
config alike; medians are reported. Decode tok/s excludes the first token (bench_serving's TPOT); TTFT is measured
on the chat-formatted prompt and on a ``--ttft-prompt-len``-token prompt. Greedy, EOS ignored, the same token ids
for both engines (baton's tokenizer of the GGUF). llama-cpp-python is optional: without it the llama.cpp rows are
skipped (``pip install llama-cpp-python``; the CPU build compiles llama.cpp, ~6 min on 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from benchmarks.common import env_card, save

STORY = "Write a short story about a robot who learns to paint."


def baton_engine(config: str, dtype: str, context: int):
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine
    from baton.speculative.shipped import with_shipped_drafts

    # default: what `baton generate` runs on a CPU (defaults.json's by_device entry); dspark: the shipped drafter
    requested = {"default": None, "dspark": "DSPARK"}.get(config, "none")
    spec = with_shipped_drafts(SpecConfig(algorithm="DSPARK" if config == "dspark" else None), embedded=True,
                               requested=requested, device="cpu")
    return Engine(ServerArgs(device="cpu", dtype=dtype, context_length=context, spec=spec))


def baton_run(engine, ids: list[int], new_tokens: int) -> dict:
    from baton.types import Request, SamplingParams

    sp = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, ignore_eos=True)
    engine.flush_cache()  # every request prefills in full (llama.cpp's context is reset before each one too)
    t0 = time.perf_counter()
    ttft, tokens, verify = None, [], 0
    for out in engine.generate(Request(list(ids), sp)):
        if ttft is None and out.token_ids:
            ttft = time.perf_counter() - t0
        tokens += out.token_ids
        verify = out.num_verify_steps
    total = time.perf_counter() - t0
    return _record(ttft, total, tokens, verify)


def _record(ttft: float, total: float, tokens: list[int], verify: int = 0) -> dict:
    n = len(tokens)
    return {"ttft_ms": 1e3 * ttft, "decode_tok_s": (n - 1) / (total - ttft) if n > 1 else None,
            "output_tokens": n, "accept_length": n / verify if verify else None, "tokens": tokens}


def llama_cpp_model(path: str, threads: int | None, context: int, extra_bufts: bool = False):
    """``extra_bufts`` False: llama.cpp's plain CPU path (its Q4_1 x Q8_1 dot kernels). Its extra weight buffers
    (the AMX repack on this Sapphire Rapids VM) crashed in ggml_backend_amx_mul_mat on 2026-12-01 (0.3.36)."""
    import llama_cpp
    from llama_cpp import Llama

    if not extra_bufts:
        default = llama_cpp.llama_model_default_params

        def params():
            p = default()
            p.use_extra_bufts = False
            return p

        llama_cpp.llama_model_default_params = params
        llama_cpp.llama.llama_cpp.llama_model_default_params = params
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=context, n_batch=512,
                verbose=False, logits_all=False)  # threads None: llama-cpp-python's defaults
    return llm


def llama_cpp_run(llm, ids: list[int], new_tokens: int) -> dict:
    """``reset()`` first: llama-cpp-python reuses the KV of the longest prefix the previous request shares (the
    GSM8K prompts' 5-shot prefix, say), which baton does not; every request here prefills its whole prompt."""
    llm.reset()
    t0 = time.perf_counter()
    ttft, tokens = None, []
    for tok in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        if ttft is None:
            ttft = time.perf_counter() - t0
        tokens.append(int(tok))
        if len(tokens) == new_tokens:
            break
    return _record(ttft, time.perf_counter() - t0, tokens)


def profile_decode(dtype: str, steps: int, rows: int = 25) -> str:
    """The per-op profile of ``steps`` plain decode steps of the embedded model after a 40-token prefill (and 8
    warm-up steps): torch.profiler's table (self CPU time; the C kernels appear as quant_cpu::* ranges) and, on the
    quantized path, the kernels' own per-phase wall times (torch.profiler does not see inside a ctypes call)."""
    from torch.profiler import ProfilerActivity, profile

    from baton.ops.quant_cpu import native
    from baton.types import ForwardMode

    engine = baton_engine("plain", dtype, 256)
    model, runner = engine.model, engine.runner
    ids = torch.arange(100, 140)
    with torch.inference_mode():
        tok = model.greedy_tokens(model(ids, runner.context(ForwardMode.PREFILL, 0, len(ids)))[-1:])
        pos = len(ids)

        def step(tok, pos):
            return model.greedy_tokens(model(tok, runner.context(ForwardMode.DECODE, pos, 1))), pos + 1

        for _ in range(8):
            tok, pos = step(tok, pos)
        t0 = time.perf_counter()
        for _ in range(steps):
            tok, pos = step(tok, pos)
        plain = (time.perf_counter() - t0) / steps
        native.profile(True)  # the kernels' phases alone (cheap: a clock read per phase)
        for _ in range(steps):
            tok, pos = step(tok, pos)
        phases = native.profile(False)
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                tok, pos = step(tok, pos)
        wall = (time.perf_counter() - t0) / steps
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows, max_name_column_width=60)
    out = [f"dtype {dtype}, {torch.get_num_threads()} thread(s), load {os.getloadavg()[0]:.2f}: "
           f"{1e3 * plain:.2f} ms per decode step ({steps} steps), {1e3 * wall:.2f} ms under torch.profiler", table]
    if any(calls for _, _, calls in phases):
        out.append("C kernel phases (wall time on the calling thread, per decode step):")
        out.append("| phase | ms / step | calls / step |")
        out.append("| --- | --- | --- |")
        for name, ms, calls in phases:
            if calls:
                out.append(f"| {name} | {ms / steps:.3f} | {calls / steps:.0f} |")
    return "\n".join(out)


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", default=STORY)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--ttft-prompt-len", type=int, default=512, help="0 skips the long-prompt TTFT")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="auto", help="baton's --dtype: auto (the GGUF's quantized weights) or float32")
    ap.add_argument("--configs", default="plain,default,llama.cpp",
                    help="comma list of plain, default (what `baton generate` runs on this CPU), dspark (the shipped "
                         "DSpark drafter at its shipped depth) and llama.cpp")
    ap.add_argument("--threads", type=int, default=None, help="both engines' threads (default: env.num_threads())")
    ap.add_argument("--default-threads", action="store_true",
                    help="each engine its own default threads (baton: env.num_threads(); llama-cpp-python: its own)")
    ap.add_argument("--llama-extra-bufts", action="store_true", help="let llama.cpp repack weights into its extra "
                                                                      "buffer types (AMX here: it crashed)")
    ap.add_argument("--json", default=None, help="write the record here (default: benchmarks/results/bench_cpu.json "
                                                  "or $OUT/bench_cpu.json)")
    ap.add_argument("--gsm8k", type=int, default=0, metavar="N",
                    help="also decode the first N GSM8K test questions in the eval's format (5-shot prefix from "
                         "train.jsonl, baton.bench.gsm8k.build_prompt), --new-tokens each, once per config")
    ap.add_argument("--gsm8k-path", default=os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                                                         "gsm8k"), help="the directory of test.jsonl / train.jsonl")
    ap.add_argument("--profile", type=int, default=0, metavar="STEPS",
                    help="instead: print the per-op profile of STEPS plain decode steps (at --dtype)")
    args = ap.parse_args(argv)

    from baton import env
    from baton.models.gguf import find_embedded_gguf

    threads = args.threads or env.num_threads()
    llama_threads = None if args.default_threads else threads
    torch.set_num_threads(threads)
    load_start = os.getloadavg()
    if args.profile:
        print(profile_decode(args.dtype, args.profile))
        return {}
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    context = max(args.ttft_prompt_len, 64, 1536 if args.gsm8k else 0) + args.new_tokens + 64
    runners, skipped = {}, {}
    tokenizer = None
    for config in configs:
        if config == "llama.cpp":
            try:
                llm = llama_cpp_model(find_embedded_gguf(), llama_threads, context, args.llama_extra_bufts)
            except ImportError as e:
                skipped[config] = f"llama-cpp-python not installed ({e})"
                continue
            runners[config] = (lambda ids, n, llm=llm: llama_cpp_run(llm, ids, n))
        else:
            engine = baton_engine(config, args.dtype, context)
            tokenizer = tokenizer or engine.tokenizer
            runners[config] = (lambda ids, n, engine=engine: baton_run(engine, ids, n))
    torch.set_num_threads(threads)  # again: loading the quantized GGUF sets baton.env.num_threads()
    if tokenizer is None:
        from baton.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(gguf_path=find_embedded_gguf())
    story = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}]))
    filler = tokenizer.encode(" The quick brown fox jumps over the lazy dog while the robot paints the sunset.")
    long_prompt = (story[:-8] + filler * (args.ttft_prompt_len // len(filler) + 1))[: args.ttft_prompt_len - 8] + \
        story[-8:] if args.ttft_prompt_len else []

    for run in runners.values():  # warm-up: compile / map everything both prompts touch
        run(story, 8)
        if long_prompt:
            run(long_prompt, 2)
    runs = {c: [] for c in runners}
    long_runs = {c: [] for c in runners}
    for rep in range(args.repeats):
        for config, run in runners.items():
            r = run(story, args.new_tokens)
            runs[config].append(r)
            print(f"[{rep}] {config:10s} decode {r['decode_tok_s']:6.1f} tok/s  TTFT {r['ttft_ms']:7.1f} ms"
                  + (f"  accept {r['accept_length']:.2f}" if r["accept_length"] else ""), flush=True)
            if long_prompt:
                lr = run(long_prompt, 2)
                long_runs[config].append(lr)
                print(f"[{rep}] {config:10s} TTFT {len(long_prompt)}-token prompt {lr['ttft_ms']:7.1f} ms", flush=True)

    gsm8k = {}
    if args.gsm8k:
        from baton.bench.gsm8k import build_prompt, few_shot_prefix, read_jsonl

        test = read_jsonl(os.path.join(args.gsm8k_path, "test.jsonl"))[: args.gsm8k]
        prefix = few_shot_prefix(read_jsonl(os.path.join(args.gsm8k_path, "train.jsonl")), 5)
        prompts = [tokenizer.encode(build_prompt(prefix, ex["question"])) for ex in test]
        for config, run in runners.items():
            rs = [run(ids, args.new_tokens) for ids in prompts]
            decode_s = sum((r["output_tokens"] - 1) / r["decode_tok_s"] for r in rs if r["decode_tok_s"])
            tokens = sum(r["output_tokens"] - 1 for r in rs)
            verify = [r["accept_length"] for r in rs if r["accept_length"]]
            gsm8k[config] = {"decode_tok_s": tokens / decode_s, "ttft_ms": statistics.median(r["ttft_ms"] for r in rs),
                             "accept_length": statistics.mean(verify) if verify else None,
                             "prompt_tokens": statistics.median(len(p) for p in prompts)}
            print(f"[gsm8k] {config:10s} decode {gsm8k[config]['decode_tok_s']:6.1f} tok/s over {len(rs)} questions"
                  + (f"  accept {gsm8k[config]['accept_length']:.2f}" if verify else ""), flush=True)

    def med(rs, key):
        vals = [r[key] for r in rs if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    summary = {}
    for config in runners:
        summary[config] = {"decode_tok_s": med(runs[config], "decode_tok_s"), "ttft_ms": med(runs[config], "ttft_ms"),
                           "ttft_long_ms": med(long_runs[config], "ttft_ms"),
                           "accept_length": med(runs[config], "accept_length")}
    ratios = {}
    peer = summary.get("llama.cpp")
    if peer:
        for config in runners:
            if config == "llama.cpp":
                continue
            s = summary[config]
            ratios[config] = {"decode_vs_llama_cpp": s["decode_tok_s"] / peer["decode_tok_s"],
                              "ttft_vs_llama_cpp": s["ttft_ms"] / peer["ttft_ms"],
                              "ttft_long_vs_llama_cpp": (s["ttft_long_ms"] / peer["ttft_long_ms"]
                                                         if s["ttft_long_ms"] and peer["ttft_long_ms"] else None),
                              "first_token_difference": first_difference(runs[config][-1]["tokens"],
                                                                         runs["llama.cpp"][-1]["tokens"])}
    print()
    print(f"| config | decode tok/s | TTFT (story, {len(story)} tok) | TTFT ({len(long_prompt)} tok) | accept "
          "| decode / llama.cpp | TTFT-{len(long_prompt)} / llama.cpp |".replace("{len(long_prompt)}",
                                                                                   str(len(long_prompt))))
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for config, s in summary.items():
        r = ratios.get(config, {})
        fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
        print(f"| {config} | {fmt(s['decode_tok_s'], '.1f')} | {fmt(s['ttft_ms'], '.0f')} ms | "
              f"{fmt(s['ttft_long_ms'], '.0f')} ms | {fmt(s['accept_length'], '.2f')} | "
              f"{fmt(r.get('decode_vs_llama_cpp'), '.2f')} | {fmt(r.get('ttft_long_vs_llama_cpp'), '.2f')} |")
    llama_cfg = {}
    if "llama.cpp" in runners:
        import multiprocessing

        n = multiprocessing.cpu_count()
        llama_cfg = {"n_threads": llama_threads or max(n // 2, 1), "n_threads_batch": llama_threads or n}
    print(f"\nbaton threads {threads}; llama.cpp {llama_cfg}; load average at the start {load_start[0]:.2f}, "
          f"at the end {os.getloadavg()[0]:.2f}")
    if gsm8k:
        peer_g = gsm8k.get("llama.cpp")
        print(f"\nGSM8K test questions (eval format, 5-shot, median prompt "
              f"{next(iter(gsm8k.values()))['prompt_tokens']:.0f} tokens), {args.new_tokens} new tokens each:\n")
        print("| config | decode tok/s | TTFT | accept | decode / llama.cpp |")
        print("| --- | --- | --- | --- | --- |")
        for config, g in gsm8k.items():
            ratio = g["decode_tok_s"] / peer_g["decode_tok_s"] if peer_g and config != "llama.cpp" else None
            acc = "-" if g["accept_length"] is None else f"{g['accept_length']:.2f}"
            print(f"| {config} | {g['decode_tok_s']:.1f} | {g['ttft_ms']:.0f} ms | {acc} | "
                  f"{'-' if ratio is None else format(ratio, '.2f')} |")
            if ratio is not None:
                g["decode_vs_llama_cpp"] = ratio
    record = {"env": env_card(), "threads": threads, "llama_cpp_threads": llama_cfg, "loadavg_start": load_start,
              "gsm8k": gsm8k, "dtype": args.dtype, "prompt": args.prompt,
              "prompt_tokens": len(story), "long_prompt_tokens": len(long_prompt), "new_tokens": args.new_tokens,
              "repeats": args.repeats, "summary": summary, "ratios": ratios, "skipped": skipped,
              "runs": {c: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for c, rs in runs.items()},
              "long_runs": {c: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                            for c, rs in long_runs.items()}}
    record["loadavg_end"] = os.getloadavg()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2, default=str)
    else:
        save("bench_cpu", record)
    return record


if __name__ == "__main__":
    main()
