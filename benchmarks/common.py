"""Shared pieces of the benchmark scripts: the environment card, TPOT as bench_serving defines it, JSON out."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def commit() -> str:
    """BATON_COMMIT when set (the GPU machine's copy of the tree carries a stale .git: its rev-parse named the
    previous session's commit on 2026-11-30), else git's HEAD."""
    if os.environ.get("BATON_COMMIT"):
        return os.environ["BATON_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True,
                                       cwd=Path(__file__).parent, stderr=subprocess.DEVNULL).strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BATON_COMMIT", "unknown")


def env_card() -> dict:
    card = {"python": platform.python_version(), "torch": torch.__version__, "commit": commit(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import triton

        card["triton"] = triton.__version__
    except ImportError:
        card["triton"] = None
    if torch.cuda.is_available():
        card["gpu"] = torch.cuda.get_device_name()
        card["driver"] = torch.version.cuda
    return card


def timed_request(engine, prompt_ids: list[int], max_new_tokens: int, ignore_eos: bool = True,
                  cold: bool = True) -> dict:
    """One greedy request through Engine.generate: TTFT, TPOT excluding the first token (bench_serving's
    definition: timed to the last token, so the engine's work after it, e.g. recording the request in the prefix
    cache, is not counted), tokens, verify steps, the prompt tokens the prefix cache restored. ``ignore_eos=False``
    ends it at EOS, as a user's request would. ``cold`` (default): the engine's caches are flushed first, so a
    repeated prompt prefills in full (benchmarks/bench_prefix_cache.py times the cached case with cold=False)."""
    from baton.types import Request, SamplingParams

    if cold:
        engine.flush_cache()
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    t0 = time.perf_counter()
    ttft = last = None
    n, verify, cached = 0, 0, 0
    for out in engine.generate(Request(list(prompt_ids), sp)):
        last = time.perf_counter()
        if ttft is None and out.token_ids:
            ttft = last - t0
            cached = out.cached_tokens
        n += len(out.token_ids)
        verify = out.num_verify_steps
    latency = last - t0
    tpot = (latency - ttft) / (n - 1) if n > 1 else float("nan")
    return {"ttft_ms": 1e3 * ttft, "tpot_ms": 1e3 * tpot, "latency_s": latency, "output_tokens": n,
            "verify_steps": verify, "accept_length": n / verify if verify else None,
            "decode_tok_s": (n - 1) / (latency - ttft) if n > 1 else None, "cached_tokens": cached}


def summarize(runs: list[dict], key: str) -> dict:
    vals = [r[key] for r in runs if r.get(key) is not None]
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals), "n": len(vals)} if vals else {}


def save(name: str, record: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = Path(os.environ.get("OUT", RESULTS)) / f"{name}.json"
    out.write_text(json.dumps(record, indent=2, default=str))
    print(json.dumps({k: v for k, v in record.items() if k not in ("runs",)}, default=str))
    return out
