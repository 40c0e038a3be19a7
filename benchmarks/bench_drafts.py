"""Trained drafts of the embedded SmolLM2-135M-Instruct on GSM8K: accept length, output tok/s and speedup over
plain decoding, accuracy; one engine per speculative config, the few-shot protocol of ``baton eval gsm8k``.

    python benchmarks/bench_drafts.py --nextn runs/smollm2/nextn --dspark runs/smollm2/dspark
    python benchmarks/bench_drafts.py --nextn N --dspark D --temperatures 0 --nextn-steps 3 --dspark-gammas 7

Per temperature: plain decoding, NEXTN (s steps, topk 1, s+1 verify tokens) for each --nextn-steps, DSPARK
(gamma drafts, gamma+1 verify tokens) for each --dspark-gammas; a gamma above the draft's trained block size
is skipped (baton refuses it), a smaller one is served with the first gamma slots. The DSpark draft's
``sts.json``, when present, is its STS file. Every question of a run is one request (batch 1) with the
prompt "<first --num-shots TRAIN examples>Question: q\\nAnswer:", SGLang's stop strings, and at T > 0 the
seed --seed + question index (the same seeds for every config).

Accept length is completion tokens / verify steps over the run (``run_gsm8k``, SGLang's spec_verify_ct);
tok/s is completion tokens / the run's wall time (prefill included); TPOT excludes the first token
(bench_serving's definition), averaged over requests. Speedup is tok/s over plain's at the same temperature.
One JSON (``save``: $OUT or benchmarks/results) and the markdown table beside it.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a file: make the repository root importable (benchmarks.common)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_card, save  # noqa: E402


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


# ---- an engine behind run_gsm8k: per-request timing, fixed seeds ----


class TimedEngine:
    """The engine as ``EngineClient`` sees it, recording each request's TTFT, TPOT and token count."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.requests: list[dict[str, Any]] = []

    def __getattr__(self, name: str) -> Any:  # tokenizer, spec_stats, flush_cache, ...
        if name == "engine":
            raise AttributeError(name)
        return getattr(self.engine, name)

    def generate(self, req: Any, should_abort: Any = None):
        t0 = time.perf_counter()
        ttft, n = None, 0
        for out in self.engine.generate(req, should_abort):
            if ttft is None and out.token_ids:
                ttft = time.perf_counter() - t0
            n += len(out.token_ids)
            yield out
        latency = time.perf_counter() - t0
        tpot = (latency - ttft) / (n - 1) if ttft is not None and n > 1 else None
        self.requests.append({"ttft_ms": None if ttft is None else 1e3 * ttft,
                              "tpot_ms": None if tpot is None else 1e3 * tpot, "latency_s": latency,
                              "output_tokens": n})


class SeededClient:
    """``run_gsm8k``'s client with the seed ``seed + i`` on its i-th request, so sampled runs repeat."""

    def __init__(self, client: Any, seed: int) -> None:
        self.client, self.seed, self.count = client, seed, 0
        self.name = client.name

    def generate(self, prompt: str, sampling: dict[str, Any]) -> Any:
        sampling = {**sampling, "seed": self.seed + self.count}
        self.count += 1
        return self.client.generate(prompt, sampling)

    def server_accept_length(self) -> float | None:
        return self.client.server_accept_length()

    def close(self) -> None:
        self.client.close()


# ---- configs ----


def spec_configs(args: argparse.Namespace) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """(label, SpecConfig kwargs) of every run, and the configs skipped with the reason."""
    configs: list[tuple[str, dict[str, Any]]] = [("plain", {})]
    skipped: list[dict[str, Any]] = []
    if args.nextn:
        for s in _ints(args.nextn_steps):
            configs.append((f"NEXTN ({s},1,{s + 1})", {"algorithm": "NEXTN", "draft_model_path": args.nextn,
                                                      "num_steps": s, "eagle_topk": 1, "num_draft_tokens": s + 1}))
    if args.dspark:
        from baton.models.dspark_checkpoint import read_dspark_config

        block_size = read_dspark_config(args.dspark).block_size
        sts = os.path.join(args.dspark, "sts.json")
        for g in _ints(args.dspark_gammas):
            label = f"DSPARK gamma={g}"
            if g > block_size:
                skipped.append({"config": label, "reason": f"gamma {g} > the draft's block size {block_size}"})
                continue
            configs.append((label, {"algorithm": "DSPARK", "draft_model_path": args.dspark, "num_draft_tokens": g + 1,
                                    "dspark_confidence_sts_path": sts if os.path.isfile(sts) else None,
                                    "dspark_sps_table_path": args.dspark_sps_table}))
    return configs, skipped


def _mean(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.fmean(vals) if vals else None


def run_config(args: argparse.Namespace, label: str, spec: dict[str, Any], test: list[dict], train: list[dict],
               temperatures: list[float]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """One engine for ``spec``; the GSM8K run at every temperature. Returns the rows and the per-question runs."""
    from baton.bench.gate import EngineClient
    from baton.bench.gsm8k import DEFAULT_STOP, build_prompt, few_shot_prefix, run_gsm8k
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine

    server_args = ServerArgs(device=args.device, dtype=args.dtype, disable_cuda_graph=args.disable_cuda_graph,
                             disable_radix_cache=True,  # TTFTs comparable with the runs before the prefix cache
                             context_length=args.context_length, seed=args.seed, spec=SpecConfig(**spec))
    t0 = time.perf_counter()
    engine = TimedEngine(Engine(server_args))
    if args.fp8_target:  # the target's MLP (or every dense) weights through fp8 (in place: graphs see the new values)
        from baton.layers.fake_quant import (
            fake_quantize_activations_fp8,
            fake_quantize_dense_fp8,
            fake_quantize_mlp_fp8,
        )

        model = engine.engine.model
        (fake_quantize_mlp_fp8 if args.fp8_target == "mlp" else fake_quantize_dense_fp8)(model)
        if args.fp8_target == "dense-w8a8":
            fake_quantize_activations_fp8(model)
        label += {"mlp": " [fp8 target]", "dense": " [fp8 dense target]",
                  "dense-w8a8": " [fp8 dense w8a8 target]"}[args.fp8_target]
    load_s = time.perf_counter() - t0
    client = EngineClient(engine, label)
    rows, runs = [], {}
    warm_prompt = build_prompt(few_shot_prefix(train, args.num_shots), test[0]["question"])
    try:
        for temp in temperatures:
            for i in range(args.warmup):
                client.generate(warm_prompt, {"temperature": temp, "max_new_tokens": min(16, args.max_new_tokens),
                                              "seed": args.seed + 10_000 + i})
            engine.flush_cache()  # spec_stats of the measured run only
            engine.requests.clear()
            result = run_gsm8k(SeededClient(client, args.seed), test, train, args.num_shots, args.max_new_tokens,
                               1, DEFAULT_STOP, temp)
            stats = engine.spec_stats
            timing = engine.requests
            row = {"config": label, "fp8_target": args.fp8_target or False, "algorithm": spec.get("algorithm"),
                   "num_steps": spec.get("num_steps"),
                   "num_draft_tokens": spec.get("num_draft_tokens"), "temperature": temp,
                   "accuracy": result.accuracy, "invalid": result.invalid, "accept_length": result.accept_length,
                   "output_tok_s": result.output_throughput, "mean_tpot_ms": _mean([r["tpot_ms"] for r in timing]),
                   "mean_ttft_ms": _mean([r["ttft_ms"] for r in timing]), "latency_s": result.latency,
                   "completion_tokens": sum(d.completion_tokens for d in result.details),
                   "verify_steps": stats.num_verify_steps,
                   "accept_histogram": dict(sorted(stats.accept_histogram.items())),
                   "num_questions": result.num_questions, "engine_load_s": load_s,
                   "sts_path": spec.get("dspark_confidence_sts_path")}
            rows.append(row)
            runs[f"{label} T={temp:g}"] = [{**asdict(d), **t} for d, t in zip(result.details, timing, strict=True)]
            print(f"{label} T={temp:g}: accept {_fmt(row['accept_length'])}, {row['output_tok_s']:.1f} tok/s, "
                  f"TPOT {_fmt(row['mean_tpot_ms'])} ms, accuracy {row['accuracy']:.3f}", flush=True)
    finally:
        client.engine = None
        engine.engine = None
        del client, engine
    return rows, runs


def release(device: str) -> None:
    gc.collect()
    if device.startswith("cuda") and torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


# ---- report ----


def _fmt(x: float | None, spec: str = ".2f", unit: str = "") -> str:
    return "-" if x is None else format(x, spec) + unit


def add_speedups(rows: list[dict[str, Any]]) -> None:
    plain = {r["temperature"]: r["output_tok_s"] for r in rows
             if r.get("algorithm") is None and "error" not in r and r["config"].startswith("plain")}
    for r in rows:
        base = plain.get(r["temperature"])
        r["speedup"] = r["output_tok_s"] / base if base and r.get("output_tok_s") is not None else None


def markdown_table(rows: list[dict[str, Any]], skipped: list[dict[str, Any]] | None = None) -> str:
    lines = ["| config | temperature | accept length | tok/s | TPOT ms | speedup | accuracy |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in sorted(rows, key=lambda r: r["temperature"]):  # stable: config order within a temperature
        if "error" in r:
            lines.append(f"| {r['config']} | {r['temperature']:g} | error: {r['error'][:60]} | | | | |")
            continue
        lines.append(f"| {r['config']} | {r['temperature']:g} | {_fmt(r['accept_length'])} | "
                     f"{r['output_tok_s']:.1f} | {_fmt(r['mean_tpot_ms'])} | {_fmt(r['speedup'], '.2f', 'x')} | "
                     f"{r['accuracy']:.3f} |")
    for s in skipped or []:
        lines.append(f"\nskipped {s['config']}: {s['reason']}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nextn", default=None, metavar="PATH", help="a NEXTN head directory (baton train nextn)")
    p.add_argument("--dspark", default=None, metavar="PATH",
                   help="a DSpark draft directory (baton train dspark); its sts.json, if any, is the STS file")
    p.add_argument("--dspark-sps-table", default=None, metavar="PATH",
                   help="an SPS table for the DSpark prefix rule (default: none, every draft is verified)")
    p.add_argument("--data-path", default="../shared/data/gsm8k", help="GSM8K directory (test.jsonl, train.jsonl)")
    p.add_argument("--num-questions", type=int, default=64, help="first N test questions (default %(default)s)")
    p.add_argument("--num-shots", type=int, default=5, help="few-shot TRAIN examples (default %(default)s)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperatures", default="0,0.7", help="comma-separated (default %(default)s)")
    p.add_argument("--nextn-steps", default="1,2,3,4,5", help="NEXTN num_steps values (default %(default)s)")
    p.add_argument("--dspark-gammas", default="4,8,16", help="DSPARK gamma values (default %(default)s)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--context-length", type=int, default=None, help="default: the model's")
    p.add_argument("--seed", type=int, default=0, help="question i samples with seed + i (default %(default)s)")
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per engine and temperature")
    p.add_argument("--fp8-target", nargs="?", const="mlp", default=None, choices=["mlp", "dense", "dense-w8a8"],
                   help="the target's MLP weights rounded through fp8 e4m3 with 128 x 128 block scales (the dense "
                        "stand-in for fp8 experts): the drafts' accept length against an fp8 target; 'dense': every "
                        "dense projection (attention too; the stand-in for --quantization fp8), lm_head excepted; "
                        "'dense-w8a8': that, and every projection's input rounded through e4m3 per row and 128 "
                        "columns (--fp8-activation-scheme dynamic)")
    p.add_argument("--output-name", default="drafts_gsm8k", help="results file stem (default %(default)s)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> Path:
    from baton.bench.gsm8k import data_files, read_jsonl

    args = parse_args(argv)
    test_path, train_path = data_files(args.data_path)
    test = read_jsonl(test_path)[: args.num_questions]
    train = read_jsonl(train_path)
    temperatures = _floats(args.temperatures)
    configs, skipped = spec_configs(args)
    for s in skipped:
        print(f"skipping {s['config']}: {s['reason']}", file=sys.stderr)
    rows: list[dict[str, Any]] = []
    runs: dict[str, Any] = {}
    for label, spec in configs:
        try:
            config_rows, config_runs = run_config(args, label, spec, test, train, temperatures)
            rows += config_rows
            runs.update(config_runs)
        except Exception as e:  # one broken config must not lose the others' numbers
            traceback.print_exc()
            rows += [{"config": label, "temperature": t, "error": repr(e)} for t in temperatures]
        release(args.device)
    add_speedups(rows)
    table = markdown_table(rows, skipped)
    record = {"benchmark": "drafts_gsm8k", "env": env_card(), "model": "embedded (SmolLM2-135M-Instruct)",
              "args": vars(args), "num_questions": len(test), "rows": rows, "skipped": skipped, "runs": runs}
    if os.environ.get("OUT"):
        Path(os.environ["OUT"]).mkdir(parents=True, exist_ok=True)  # save() writes there but does not create it
    out = save(args.output_name, record)
    md = out.with_suffix(".md")
    head = (f"GSM8K, {len(test)} questions, {args.num_shots}-shot, max {args.max_new_tokens} new tokens, "
            f"{args.device} {args.dtype}{', no CUDA graphs' if args.disable_cuda_graph else ''}"
            f"{', target MLP weights through fp8' if args.fp8_target == 'mlp' else ''}"
            f"{', every dense target weight through fp8' if args.fp8_target == 'dense' else ''}"
            f"{', every dense target weight and its input through fp8' if args.fp8_target == 'dense-w8a8' else ''}; "
            f"commit {record['env']['commit']}\n\n")
    md.write_text(head + table)
    print(table)
    print(f"wrote {out} and {md}")
    return out


if __name__ == "__main__":
    main()
