"""A bench_serving-compatible async client: SGLang's ``bench_serving`` for baton (``baton bench``).

Owns the serving benchmark: the datasets (``random``, ``random-ids``, ``gsm8k``, SGLang's
``generated-shared-prefix``, and ``multi-turn``: conversations whose every turn resends the conversation so far,
timed per turn with the server's prefix cache holding the previous turn and again after a /flush_cache), one
request function per backend family (native ``/generate``, OpenAI completions, OpenAI chat), the request schedule
(Poisson or all-at-once arrivals, a concurrency cap, warmup), the metrics (``calculate_metrics``), SGLang's results
table, its JSONL line and an optional PNG. Payloads, timing and metric definitions follow SGLang's client exactly,
so numbers are comparable across baton, SGLang, vLLM and any OpenAI-compatible server. Only the endpoints that
client uses are touched (/v1/models, /model_info, /server_info, /flush_cache and the generation routes), and a
missing /model_info or /server_info is tolerated.

The one planned difference: ``random`` draws token ids uniformly from the tokenizer's vocabulary (special
tokens excluded) instead of from ShareGPT text, so no download is needed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
import traceback
import warnings
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp
import numpy as np

from baton import env
from baton.plotting import have_matplotlib, missing_message

BACKEND_PATHS = {
    "sglang": "/generate",
    "sglang-native": "/generate",
    "sglang-oai": "/v1/completions",
    "sglang-oai-chat": "/v1/chat/completions",
    "vllm": "/v1/completions",
    "vllm-chat": "/v1/chat/completions",
}
DATASETS = ("random", "random-ids", "gsm8k", "generated-shared-prefix", "multi-turn")
NATIVE_BACKENDS = ("sglang", "sglang-native")
CHAT_BACKENDS = ("sglang-oai-chat", "vllm-chat")
# Under speculative decoding an OpenAI chunk carries several tokens; SGLang splits its gap by re-encoding.
RETOKENIZED_ITL_BACKENDS = ("sglang-oai", "sglang-oai-chat")
POST_WARMUP_SLEEP_S = 1.0
WARMUP_MAX_OUTPUT_LEN = 32
_REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=6 * 60 * 60)
_INFO_TIMEOUT = aiohttp.ClientTimeout(total=60)
_READ_BUFSIZE = 10 * 1024**2

Tokenizer = Any
TokenizerLoader = Callable[[str | None], Tokenizer]


class BenchError(RuntimeError):
    """The benchmark cannot run (server not ready, bad arguments, every warmup request failed)."""


@dataclass
class DatasetRow:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


@dataclass
class ClientConfig:
    """What every request of one run shares."""

    backend: str
    api_url: str
    model: str
    headers: dict[str, str] = field(default_factory=dict)
    stream: bool = True
    ignore_eos: bool = True
    temperature: float = 0.0
    top_p: float = 1.0
    extra_body: dict[str, Any] = field(default_factory=dict)


@dataclass
class RequestOutput:
    """One request's outcome; times in seconds, ``start_time`` on the ``perf_counter`` clock."""

    generated_text: str = ""
    success: bool = False
    latency: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    text_chunks: list[str] = field(default_factory=list)
    prompt_len: int = 0
    output_len: int = 0
    error: str = ""
    start_time: float = 0.0
    cached_tokens: int | None = None  # the server's prefix-cache hit (meta_info / usage), when it says
    output_ids: list[int] | None = None  # native backends: the generated token ids


@dataclass
class BenchmarkMetrics:
    completed: int
    total_input: int
    total_input_text: int
    total_input_vision: int
    total_output: int
    total_output_retokenized: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    output_throughput_retokenized: float
    total_throughput: float
    total_throughput_retokenized: float
    mean_ttft_ms: float
    median_ttft_ms: float
    std_ttft_ms: float
    p90_ttft_ms: float
    p95_ttft_ms: float
    p99_ttft_ms: float
    mean_tpot_ms: float
    median_tpot_ms: float
    std_tpot_ms: float
    p90_tpot_ms: float
    p95_tpot_ms: float
    p99_tpot_ms: float
    mean_itl_ms: float
    median_itl_ms: float
    std_itl_ms: float
    p90_itl_ms: float
    p95_itl_ms: float
    p99_itl_ms: float
    max_itl_ms: float
    mean_e2e_latency_ms: float
    median_e2e_latency_ms: float
    std_e2e_latency_ms: float
    p90_e2e_latency_ms: float
    p95_e2e_latency_ms: float
    p99_e2e_latency_ms: float
    concurrency: float
    max_output_tokens_per_s: float = 0.0
    max_concurrent_requests: int = 0


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the bench flags under SGLang's names and defaults (``--port`` defaults by backend)."""
    a = parser.add_argument
    a("--backend", choices=list(BACKEND_PATHS), default="sglang")
    a("--base-url", default=None, help="overrides --host/--port")
    a("--host", default="127.0.0.1")
    a("--port", type=int, default=None, help="default: 30000 for sglang backends, 8000 for vllm")
    a("--model", default=None, help="default: data[0].id of GET /v1/models")
    a("--tokenizer", default=None, help="default: tokenizer_path or model_path of GET /model_info")
    a("--dataset-name", choices=DATASETS, default="random")
    a("--dataset-path", default="", help="GSM8K jsonl for --dataset-name gsm8k")
    a("--num-prompts", type=int, default=1000)
    a("--random-input-len", type=int, default=1024)
    a("--random-output-len", type=int, default=1024)
    a("--random-range-ratio", type=float, default=0.0)
    a("--max-concurrency", type=int, default=None)
    a("--request-rate", type=float, default=float("inf"))
    a("--seed", type=int, default=42)
    a("--output-file", default=None)
    a("--output-details", action="store_true")
    a("--disable-stream", action="store_true")
    a("--disable-ignore-eos", action="store_true")
    a("--temperature", type=float, default=0.0)
    a("--top-p", type=float, default=1.0)
    a("--warmup-requests", type=int, default=1)
    a("--flush-cache", action="store_true", help="POST /flush_cache after warmup")
    a("--extra-request-body", default=None, help="JSON object merged into every payload")
    a("--apply-chat-template", action="store_true")
    a("--tokenize-prompt", action="store_true", help="send input_ids (sglang backends only)")
    a("--ready-check-timeout-sec", type=int, default=60)
    a("--plot", default=None, metavar="FILE.png", help="TPOT and TTFT histograms, output tok/s over time")
    a("--disable-tqdm", action="store_true")
    a("--header", action="append", default=None, metavar="K=V", help="extra HTTP header (repeatable)")
    a("--tag", default=None, help="stored in the JSONL line")
    # generated-shared-prefix (SGLang's names) and multi-turn
    a("--gsp-num-groups", type=int, default=64, help="system prompts (groups)")
    a("--gsp-prompts-per-group", type=int, default=16, help="questions per system prompt")
    a("--gsp-system-prompt-len", type=int, default=2048, help="tokens of each system prompt")
    a("--gsp-question-len", type=int, default=128, help="tokens of each question")
    a("--gsp-output-len", type=int, default=256, help="output tokens of each request")
    a("--multi-turn-num-turns", type=int, default=4,
      help="turns per conversation (--num-prompts conversations; the first turn's prompt has "
           "--random-input-len tokens, each turn --random-output-len output tokens)")
    a("--multi-turn-user-len", type=int, default=100, help="tokens of each follow-up user message")
    return parser


def _with_defaults(args: argparse.Namespace) -> argparse.Namespace:
    """Fill any flag the caller's namespace lacks (e.g. a SimpleNamespace or another CLI's parser)."""
    merged = vars(add_bench_args(argparse.ArgumentParser()).parse_args([]))
    merged.update(vars(args))
    return argparse.Namespace(**merged)


def _validate(args: argparse.Namespace) -> None:
    if args.tokenize_prompt and args.backend not in NATIVE_BACKENDS:
        raise BenchError("--tokenize-prompt only works with --backend sglang")
    if args.dataset_name == "gsm8k" and not args.dataset_path:
        raise BenchError("--dataset-name gsm8k needs --dataset-path (a GSM8K jsonl)")
    if args.num_prompts < 1:
        raise BenchError("--num-prompts must be at least 1")
    _extra_body(args.extra_request_body)


def _extra_body(text: str | None) -> dict[str, Any]:
    try:
        body = json.loads(text) if text else {}
    except json.JSONDecodeError as e:
        raise BenchError(f"--extra-request-body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BenchError("--extra-request-body must be a JSON object")
    return body


def resolve_base_url(args: argparse.Namespace) -> str:
    if args.base_url:
        return args.base_url.rstrip("/")
    port = args.port or (8000 if args.backend.startswith("vllm") else 30000)
    host = f"[{args.host}]" if ":" in args.host and not args.host.startswith("[") else args.host
    return f"http://{host}:{port}"


def request_headers(header_args: Sequence[str] | None = None) -> dict[str, str]:
    """SGLang's auth rule (OPENAI_API_KEY as Bearer, else API_KEY raw) plus ``--header K=V`` pairs."""
    headers: dict[str, str] = {}
    if key := env.openai_api_key():
        headers["Authorization"] = f"Bearer {key}"
    elif key := env.api_key():
        headers["Authorization"] = key
    for item in header_args or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise BenchError(f"--header expects K=V, got {item!r}")
        headers[name.strip()] = value.strip()
    return headers


def compute_random_lens(full_len: int, range_ratio: float, num: int) -> list[int]:
    """SGLang's lengths: uniform integers in ``[max(int(full_len * ratio), 1), full_len]``."""
    if full_len <= 0:
        return [0] * num
    return np.random.randint(max(int(full_len * range_ratio), 1), full_len + 1, size=num).tolist()


def special_token_ids(tokenizer: Tokenizer) -> set[int]:
    """Special ids from whichever interface the tokenizer has (HF, ``tokenizers``, or baton's ``.hf``)."""
    ids: set[int] = set()
    for obj in (tokenizer, getattr(tokenizer, "hf", None)):
        if obj is None:
            continue
        ids.update(int(i) for i in getattr(obj, "all_special_ids", None) or [])
        decoder = getattr(obj, "get_added_tokens_decoder", None)
        added = decoder() if callable(decoder) else getattr(obj, "added_tokens_decoder", None)
        if isinstance(added, dict):
            ids.update(int(i) for i, tok in added.items() if getattr(tok, "special", False))
    return ids


def _decode(tokenizer: Tokenizer, ids: list[int]) -> str:
    """Decode keeping special tokens, as HF's default (and SGLang's client) does."""
    try:
        return tokenizer.decode(ids, skip_special_tokens=False)
    except TypeError:
        return tokenizer.decode(ids)


def _text_prompt_len(tokenizer: Tokenizer, text: str) -> int:
    return len(tokenizer.encode(text, add_special_tokens=False)) + int(tokenizer.num_special_tokens_to_add())


def apply_chat_template(tokenizer: Tokenizer, text: str) -> str:
    """One user turn through the tokenizer's template, less a leading BOS text the server will add."""
    messages = [{"role": "user", "content": text}]
    try:
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except TypeError:
        prompt = tokenizer.apply_chat_template(messages)
    if not isinstance(prompt, str):
        prompt = _decode(tokenizer, list(prompt))
    # Only a leading BOS, and only when encoding adds one: SGLang's replace-all also strips ChatML's
    # <|im_start|> when a tokenizer names it the BOS.
    bos = getattr(tokenizer, "bos_token", None)
    if isinstance(bos, str) and bos and int(tokenizer.num_special_tokens_to_add()) > 0:
        return prompt.removeprefix(bos)
    return prompt


def sample_random_requests(
    input_len: int,
    output_len: int,
    num_prompts: int,
    range_ratio: float,
    tokenizer: Tokenizer,
    random_sample: bool = True,
    return_text: bool = True,
) -> list[DatasetRow]:
    """``random`` (i.i.d. non-special vocabulary ids) or ``random-ids`` (SGLang's consecutive ids)."""
    input_lens = compute_random_lens(input_len, range_ratio, num_prompts)
    output_lens = compute_random_lens(output_len, range_ratio, num_prompts)
    if return_text:
        # The server adds special tokens (BOS) when it encodes text, so leave room for them.
        num_special = int(tokenizer.num_special_tokens_to_add())
        input_lens = [max(n - num_special, 1) for n in input_lens]
    vocab_size = int(tokenizer.vocab_size)
    if random_sample:
        pool = np.array(sorted(set(range(vocab_size)) - special_token_ids(tokenizer)), dtype=np.int64)
        id_lists = [pool[np.random.randint(0, len(pool), size=n)].tolist() for n in input_lens]
    else:
        offsets = np.random.randint(0, vocab_size, size=num_prompts)
        id_lists = [[int((offsets[i] + i + j) % vocab_size) for j in range(n)] for i, n in enumerate(input_lens)]
    rows = [
        DatasetRow(_decode(tokenizer, ids) if return_text else ids, int(n), int(m))
        for ids, n, m in zip(id_lists, input_lens, output_lens, strict=True)
    ]
    print(f"#Input tokens: {sum(input_lens)}")
    print(f"#Output tokens: {sum(output_lens)}")
    return rows


def sample_gsm8k_requests(
    dataset_path: str,
    num_prompts: int,
    output_len: int,
    tokenizer: Tokenizer,
    raw_question: bool = False,
    return_text: bool = True,
) -> list[DatasetRow]:
    """GSM8K questions in file order (cycled when ``num_prompts`` exceeds the file), fixed output length."""
    with open(dataset_path, encoding="utf-8") as f:
        questions = [json.loads(line)["question"] for line in f if line.strip()]
    if not questions:
        raise BenchError(f"no questions in {dataset_path}")
    rows = []
    for i in range(num_prompts):
        question = questions[i % len(questions)]
        text = question if raw_question else f"Question: {question}\nAnswer:"
        if return_text:
            rows.append(DatasetRow(text, _text_prompt_len(tokenizer, text), output_len))
        else:
            ids = list(tokenizer.encode(text, add_special_tokens=False))
            rows.append(DatasetRow(ids, len(ids), output_len))
    return rows


def _random_ids(tokenizer: Tokenizer, n: int) -> list[int]:
    pool = np.array(sorted(set(range(int(tokenizer.vocab_size))) - special_token_ids(tokenizer)), dtype=np.int64)
    return pool[np.random.randint(0, len(pool), size=n)].tolist()


def sample_generated_shared_prefix_requests(args: argparse.Namespace, tokenizer: Tokenizer,
                                            return_text: bool = True) -> list[DatasetRow]:
    """SGLang's ``generated-shared-prefix``: ``--gsp-num-groups`` random system prompts, each followed by
    ``--gsp-prompts-per-group`` random questions (random non-special ids), group by group."""
    rows = []
    for _ in range(args.gsp_num_groups):
        system = _random_ids(tokenizer, args.gsp_system_prompt_len)
        for _ in range(args.gsp_prompts_per_group):
            ids = system + _random_ids(tokenizer, args.gsp_question_len)
            prompt = _decode(tokenizer, ids) if return_text else ids
            n = _text_prompt_len(tokenizer, prompt) if return_text else len(ids)
            rows.append(DatasetRow(prompt, n, args.gsp_output_len))
    print(f"#Input tokens: {sum(r.prompt_len for r in rows)}")
    print(f"#Output tokens: {sum(r.output_len for r in rows)}")
    return rows


def build_dataset(args: argparse.Namespace, tokenizer: Tokenizer) -> list[DatasetRow]:
    return_text = not args.tokenize_prompt
    if args.dataset_name == "generated-shared-prefix":
        rows = sample_generated_shared_prefix_requests(args, tokenizer, return_text)
    elif args.dataset_name == "multi-turn":  # the first turns; the rest are built as the answers come
        rows = sample_random_requests(args.random_input_len, args.random_output_len, args.num_prompts, 1.0,
                                      tokenizer, random_sample=True, return_text=return_text)
    elif args.dataset_name == "gsm8k":
        raw = args.apply_chat_template or args.backend in CHAT_BACKENDS
        rows = sample_gsm8k_requests(
            args.dataset_path, args.num_prompts, args.random_output_len, tokenizer, raw, return_text
        )
    else:
        rows = sample_random_requests(
            args.random_input_len,
            args.random_output_len,
            args.num_prompts,
            args.random_range_ratio,
            tokenizer,
            random_sample=args.dataset_name == "random",
            return_text=return_text,
        )
    if args.apply_chat_template and return_text:
        for row in rows:
            row.prompt = apply_chat_template(tokenizer, str(row.prompt))
            row.prompt_len = _text_prompt_len(tokenizer, row.prompt)
    return rows


def _native_payload(cfg: ClientConfig, row: DatasetRow) -> dict[str, Any]:
    sampling: dict[str, Any] = {
        "temperature": cfg.temperature,
        "max_new_tokens": row.output_len,
        "ignore_eos": cfg.ignore_eos,
    }
    if cfg.top_p < 1.0:
        sampling["top_p"] = cfg.top_p
    return {
        ("text" if isinstance(row.prompt, str) else "input_ids"): row.prompt,
        "sampling_params": sampling,
        "stream": cfg.stream,
        "lora_path": None,
        "return_logprob": False,
        "return_routed_experts": False,
        "logprob_start_len": -1,
        **cfg.extra_body,
    }


def _openai_payload(cfg: ClientConfig, row: DatasetRow) -> dict[str, Any]:
    if cfg.backend in CHAT_BACKENDS:
        payload: dict[str, Any] = {
            "model": cfg.model,
            "messages": [{"role": "user", "content": row.prompt}],
            "max_completion_tokens": row.output_len,
        }
    else:
        payload = {"model": cfg.model, "prompt": row.prompt, "best_of": 1, "max_tokens": row.output_len}
    payload["stream"] = cfg.stream
    payload["temperature"] = cfg.temperature
    payload["ignore_eos"] = cfg.ignore_eos
    if cfg.top_p < 1.0:
        payload["top_p"] = cfg.top_p
    payload.update(cfg.extra_body)
    return payload


class _NativeHandler:
    """Cumulative ``text``; a chunk's gap is split evenly over its new tokens (SGLang's "adjust_itl")."""

    def __init__(self) -> None:
        self.last_t = 0.0
        self.last_len = 0

    def chunk(self, data: dict[str, Any], t: float, out: RequestOutput) -> None:
        _native_extras(data, out)
        text = data.get("text")
        if not text:
            return
        out.generated_text = text
        out.output_len = int((data.get("meta_info") or {}).get("completion_tokens", self.last_len + 1))
        if out.ttft == 0.0:
            out.ttft = t
        else:
            num_new = out.output_len - self.last_len
            if num_new == 0:
                return
            out.itl.extend([(t - self.last_t) / num_new] * num_new)
        self.last_t, self.last_len = t, out.output_len

    def final(self, body: dict[str, Any], out: RequestOutput) -> None:
        _native_extras(body, out)
        out.generated_text = body.get("text") or ""
        out.output_len = int((body.get("meta_info") or {}).get("completion_tokens", out.output_len))


def _native_extras(data: dict[str, Any], out: RequestOutput) -> None:
    meta = data.get("meta_info") or {}
    if "cached_tokens" in meta:
        out.cached_tokens = int(meta["cached_tokens"])
    if isinstance(data.get("output_ids"), list):
        out.output_ids = list(data["output_ids"])


def _openai_cached(data: dict[str, Any], out: RequestOutput) -> None:
    details = (data.get("usage") or {}).get("prompt_tokens_details") or {}
    if details.get("cached_tokens") is not None:
        out.cached_tokens = int(details["cached_tokens"])


class _OpenAIHandler:
    """One ITL entry per non-empty content chunk; ``usage.completion_tokens`` if sent, else the request."""

    def __init__(self, is_chat: bool) -> None:
        self.is_chat = is_chat
        self.last_t = 0.0

    def _text(self, choice: dict[str, Any]) -> str:
        if not self.is_chat:
            return choice.get("text") or ""
        part = choice.get("delta") or choice.get("message") or {}
        reasoning = part.get("reasoning_content") or part.get("reasoning") or ""
        return reasoning + (part.get("content") or "")

    def chunk(self, data: dict[str, Any], t: float, out: RequestOutput) -> None:
        _openai_cached(data, out)
        out.output_len = int((data.get("usage") or {}).get("completion_tokens", out.output_len))
        choices = data.get("choices") or []
        text = self._text(choices[0]) if choices else ""
        if not text:
            return
        if out.ttft == 0.0:
            out.ttft = t
        else:
            out.text_chunks.append(text)
            out.itl.append(t - self.last_t)
        self.last_t = t
        out.generated_text += text

    def final(self, body: dict[str, Any], out: RequestOutput) -> None:
        _openai_cached(body, out)
        choices = body.get("choices") or []
        out.generated_text = self._text(choices[0]) if choices else ""
        out.output_len = int((body.get("usage") or {}).get("completion_tokens", out.output_len))


def _parse_sse_line(line: bytes) -> dict[str, Any] | None:
    """The JSON object a line carries, or None for ``[DONE]``, comments and other SSE fields."""
    if line.startswith(b"data:"):
        line = line[5:].strip()
    elif not line.startswith(b"{"):
        return None
    if line == b"[DONE]":
        return None
    data = json.loads(line)
    return data if isinstance(data, dict) else None


def _stream_error(data: dict[str, Any]) -> str | None:
    if "error" in data and not data.get("choices") and not data.get("text"):
        return json.dumps(data["error"])
    return None


async def _read_stream(resp: aiohttp.ClientResponse, st: float, out: RequestOutput, handler: Any) -> None:
    # Latency moves on every non-empty line, [DONE] included: E2E latency is the last line's arrival.
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        t = time.perf_counter() - st
        out.latency = t
        data = _parse_sse_line(line)
        if data is None:
            continue
        if err := _stream_error(data):
            out.error = err
            return
        handler.chunk(data, t, out)


async def request_once(cfg: ClientConfig, row: DatasetRow) -> RequestOutput:
    """Send one request with ``cfg.backend``'s payload and time it the way SGLang's client does."""
    is_native = cfg.backend in NATIVE_BACKENDS
    payload = _native_payload(cfg, row) if is_native else _openai_payload(cfg, row)
    handler = _NativeHandler() if is_native else _OpenAIHandler(cfg.backend in CHAT_BACKENDS)
    out = RequestOutput(prompt_len=row.prompt_len, output_len=row.output_len)
    try:
        async with aiohttp.ClientSession(timeout=_REQUEST_TIMEOUT, read_bufsize=_READ_BUFSIZE) as session:
            st = out.start_time = time.perf_counter()
            async with session.post(cfg.api_url, json=payload, headers=cfg.headers) as resp:
                if resp.status != 200:
                    out.error = f"{resp.status} {resp.reason or ''}: {await resp.text()}"
                    return out
                if cfg.stream:
                    await _read_stream(resp, st, out, handler)
                else:
                    body = await resp.json(content_type=None)
                    out.latency = out.ttft = time.perf_counter() - st
                    handler.final(body, out)
        out.success = not out.error
    except Exception:
        out.success = False
        out.error = traceback.format_exc()
    return out


def _latency_stats(name: str, values: list[float], with_max: bool = False) -> dict[str, float]:
    """mean/median/std/p90/p95/p99 (and max) in ms; an empty list reads as 0, as in SGLang."""
    arr = values or 0
    stats = {
        f"mean_{name}_ms": float(np.mean(arr) * 1000),
        f"median_{name}_ms": float(np.median(arr) * 1000),
        f"std_{name}_ms": float(np.std(arr) * 1000),
        **{f"p{p}_{name}_ms": float(np.percentile(arr, p) * 1000) for p in (90, 95, 99)},
    }
    if with_max:
        stats[f"max_{name}_ms"] = float(np.max(arr) * 1000)
    return stats


def per_second_bins(outputs: Sequence[RequestOutput]) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens and in-flight requests per fixed 1 s bin, aligned to the earliest request start."""
    ok = [o for o in outputs if o.success]
    if not ok:
        return np.zeros(0), np.zeros(0)
    t0 = min(o.start_time for o in ok)
    num_bins = int(np.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
    tokens, requests = np.zeros(num_bins), np.zeros(num_bins)
    for o in ok:
        token_time = o.start_time + o.ttft
        times = [token_time]
        for gap in o.itl:
            token_time += gap
            times.append(token_time)
        for ts in times:
            b = int(ts - t0)
            if 0 <= b < num_bins:
                tokens[b] += 1
        first, last = int(o.start_time - t0), int(o.start_time + o.latency - t0)
        for b in range(first, min(last + 1, num_bins)):
            requests[b] += 1
    return tokens, requests


def _retokenized_itl(out: RequestOutput, tokenizer: Tokenizer) -> list[float]:
    itls: list[float] = []
    for gap, text in zip(out.itl, out.text_chunks, strict=True):
        # SGLang divides by the raw count; a chunk re-encoding to no token keeps one entry instead of failing.
        num_tokens = max(len(tokenizer.encode(text, add_special_tokens=False)), 1)
        itls.extend([gap / num_tokens] * num_tokens)
    return itls


def request_tpots(outputs: Sequence[RequestOutput]) -> list[float]:
    """Per-request TPOT in seconds: ``(latency - ttft) / (output_len - 1)`` for outputs longer than 1."""
    return [(o.latency - o.ttft) / (o.output_len - 1) for o in outputs if o.success and o.output_len > 1]


def calculate_metrics(
    input_requests: Sequence[DatasetRow],
    outputs: Sequence[RequestOutput],
    dur_s: float,
    tokenizer: Tokenizer,
    backend: str,
    accept_length: float | None = None,
) -> tuple[BenchmarkMetrics, list[int]]:
    """SGLang's ``calculate_metrics``: returns the metrics and per-request output lengths (0 if failed)."""
    use_retokenized_itl = bool(accept_length and accept_length > 0 and backend in RETOKENIZED_ITL_BACKENDS)
    output_lens: list[int] = []
    retokenized_lens: list[int] = []
    total_input = completed = 0
    ttfts: list[float] = []
    itls: list[float] = []
    e2e_latencies: list[float] = []
    for row, out in zip(input_requests, outputs, strict=True):
        if not out.success:
            output_lens.append(0)
            retokenized_lens.append(0)
            continue
        output_lens.append(out.output_len)
        retokenized_lens.append(len(tokenizer.encode(out.generated_text, add_special_tokens=False)))
        total_input += row.prompt_len
        itls.extend(_retokenized_itl(out, tokenizer) if use_retokenized_itl else out.itl)
        ttfts.append(out.ttft)
        e2e_latencies.append(out.latency)
        completed += 1
    if completed == 0:
        warnings.warn("All requests failed: check the benchmark arguments.", stacklevel=2)
    tokens_per_s, requests_per_s = per_second_bins(outputs)
    total_output, total_retokenized = sum(output_lens), sum(retokenized_lens)
    metrics = BenchmarkMetrics(
        completed=completed,
        total_input=total_input,
        total_input_text=total_input,
        total_input_vision=0,
        total_output=total_output,
        total_output_retokenized=total_retokenized,
        request_throughput=completed / dur_s,
        input_throughput=total_input / dur_s,
        output_throughput=total_output / dur_s,
        output_throughput_retokenized=total_retokenized / dur_s,
        total_throughput=(total_input + total_output) / dur_s,
        total_throughput_retokenized=(total_input + total_retokenized) / dur_s,
        **_latency_stats("ttft", ttfts),
        **_latency_stats("tpot", request_tpots(outputs)),
        **_latency_stats("itl", itls, with_max=True),
        **_latency_stats("e2e_latency", e2e_latencies),
        concurrency=float(np.sum(e2e_latencies) / dur_s),
        max_output_tokens_per_s=float(tokens_per_s.max()) if len(tokens_per_s) else 0.0,
        max_concurrent_requests=int(requests_per_s.max()) if len(requests_per_s) else 0,
    )
    return metrics, output_lens


def accept_length_from(server_info: Any) -> float | None:
    """``internal_states[0].avg_spec_accept_length`` of /server_info (``decode[0]`` first in PD mode)."""
    if not isinstance(server_info, dict):
        return None
    if "decode" in server_info:
        server_info = (server_info["decode"] or [{}])[0]
    states = server_info.get("internal_states") or []
    if not states or not isinstance(states[0], dict):
        return None
    return states[0].get("avg_spec_accept_length")


_STAT_LABELS = {"mean": "Mean", "median": "Median", "p90": "P90", "p95": "P95", "p99": "P99"}


def _row(label: str, value: Any, fmt: str = "") -> None:
    print(f"{label:<40} {value:<10{fmt}}")


def print_results(args: argparse.Namespace, m: BenchmarkMetrics, duration: float, accept: float | None) -> None:
    """SGLang's results table, row labels and formats unchanged."""
    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    _row("Backend:", args.backend)
    _row("Traffic request rate:", args.request_rate)
    _row("Max request concurrency:", args.max_concurrency if args.max_concurrency else "not set")
    _row("Successful requests:", m.completed)
    _row("Benchmark duration (s):", duration, ".2f")
    _row("Total input tokens:", m.total_input)
    _row("Total input text tokens:", m.total_input_text)
    _row("Total generated tokens:", m.total_output)
    _row("Total generated tokens (retokenized):", m.total_output_retokenized)
    _row("Request throughput (req/s):", m.request_throughput, ".2f")
    _row("Input token throughput (tok/s):", m.input_throughput, ".2f")
    _row("Output token throughput (tok/s):", m.output_throughput, ".2f")
    _row("Peak output token throughput (tok/s):", m.max_output_tokens_per_s, ".2f")
    _row("Peak concurrent requests:", m.max_concurrent_requests)
    _row("Total token throughput (tok/s):", m.total_throughput, ".2f")
    _row("Concurrency:", m.concurrency, ".2f")
    if accept:
        _row("Accept length:", accept, ".2f")
    sections = [
        ("End-to-End Latency", "e2e_latency", "E2E Latency"),
        ("Time to First Token", "ttft", "TTFT"),
        ("Time per Output Token (excl. 1st token)", "tpot", "TPOT"),
        ("Inter-Token Latency", "itl", "ITL"),
    ]
    for title, key, label in sections:
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat, name in _STAT_LABELS.items():
            _row(f"{name} {label} (ms):", getattr(m, f"{stat}_{key}_ms"), ".2f")
    _row("Max ITL (ms):", m.max_itl_ms, ".2f")
    print("=" * 50)


_RESULT_METRICS = (
    "request_throughput", "input_throughput", "output_throughput", "total_throughput",
    *(f"{s}_{k}_ms" for k in ("e2e_latency", "ttft", "tpot", "itl")
      for s in ("mean", "median", "std", "p90", "p95", "p99")),
)  # fmt: skip


def result_record(
    args: argparse.Namespace, m: BenchmarkMetrics, duration: float, server_info: Any, accept: float | None
) -> dict[str, Any]:
    """The JSONL line, with SGLang's keys in SGLang's order."""
    record: dict[str, Any] = {
        "tag": args.tag,
        "backend": args.backend,
        "dataset_name": args.dataset_name,
        "request_rate": args.request_rate,
        "max_concurrency": args.max_concurrency,
        "sharegpt_output_len": None,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "server_info": server_info,
        "duration": duration,
        "completed": m.completed,
        "total_input_tokens": m.total_input,
        "total_input_text_tokens": m.total_input_text,
        "total_input_vision_tokens": m.total_input_vision,
        "total_output_tokens": m.total_output,
        "total_output_tokens_retokenized": m.total_output_retokenized,
    }
    record.update({key: getattr(m, key) for key in _RESULT_METRICS})
    record.update(
        concurrency=m.concurrency,
        accept_length=accept,
        max_output_tokens_per_s=m.max_output_tokens_per_s,
        max_concurrent_requests=m.max_concurrent_requests,
    )
    return record


def result_details(outputs: Sequence[RequestOutput], output_lens: list[int]) -> dict[str, list[Any]]:
    return {
        "input_lens": [o.prompt_len for o in outputs],
        "output_lens": output_lens,
        "ttfts": [o.ttft for o in outputs],
        "itls": [o.itl for o in outputs],
        "generated_texts": [o.generated_text for o in outputs],
        "errors": [o.error for o in outputs],
    }


def default_output_file(args: argparse.Namespace) -> str:
    now = datetime.now().strftime("%m%d")
    if args.dataset_name.startswith("random"):
        lens = f"{args.random_input_len}_{args.random_output_len}"
        return f"{args.backend}_{now}_{args.num_prompts}_{lens}.jsonl"
    return f"{args.backend}_{now}_{args.num_prompts}_{args.dataset_name}.jsonl"


def plot_results(path: str, outputs: Sequence[RequestOutput]) -> None:
    """Three panels: TPOT histogram, TTFT histogram, output tokens per 1 s bin over the run."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    tpots_ms = [t * 1000 for t in request_tpots(outputs)]
    ttfts_ms = [o.ttft * 1000 for o in outputs if o.success]
    tokens_per_s, _ = per_second_bins(outputs)
    fig = Figure(figsize=(15, 4))
    FigureCanvasAgg(fig)
    ax_tpot, ax_ttft, ax_tput = fig.subplots(1, 3)
    for ax, values, title in ((ax_tpot, tpots_ms, "TPOT"), (ax_ttft, ttfts_ms, "TTFT")):
        ax.hist(values, bins=max(1, min(50, len(values))))
        ax.set(title=f"{title} distribution ({len(values)} requests)", xlabel=f"{title} (ms)")
        ax.set_ylabel("requests")
    ax_tput.bar(np.arange(len(tokens_per_s)), tokens_per_s, width=1.0, align="edge")
    ax_tput.set(title="Output throughput (1 s bins)", xlabel="time since first request (s)", ylabel="tok/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


async def _get_json(url: str, headers: dict[str, str]) -> Any:
    """GET ``url`` and return its JSON, or None on any failure (the endpoint is optional)."""
    try:
        async with aiohttp.ClientSession(timeout=_INFO_TIMEOUT) as session:
            async with session.get(url, headers=headers) as resp:
                return await resp.json(content_type=None) if resp.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def wait_until_ready(base_url: str, headers: dict[str, str], timeout_s: float) -> None:
    """Poll GET /v1/models once a second until it answers 200."""
    url, deadline = f"{base_url}/v1/models", time.perf_counter() + timeout_s
    print(f"Waiting up to {timeout_s}s for {url} to become ready...")
    while True:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
                async with session.get(url, headers=headers) as resp:
                    if resp.status == 200:
                        return
        except (aiohttp.ClientError, asyncio.TimeoutError):
            pass
        if time.perf_counter() >= deadline:
            raise BenchError(f"server at {url} not ready within {timeout_s}s")
        await asyncio.sleep(1.0)


async def _served_model_id(base_url: str, headers: dict[str, str]) -> str:
    models = await _get_json(f"{base_url}/v1/models", headers)
    data = (models or {}).get("data") if isinstance(models, dict) else None
    if not data:
        raise BenchError(f"no model listed at {base_url}/v1/models; pass --model")
    return str(data[0]["id"])


async def _tokenizer_path(args: argparse.Namespace, base_url: str, headers: dict[str, str], model: str) -> str | None:
    if args.tokenizer:
        return args.tokenizer
    info = await _get_json(f"{base_url}/model_info", headers)
    if isinstance(info, dict) and (path := info.get("tokenizer_path") or info.get("model_path")):
        if path == "token-ids" and info.get("vocab_size"):  # baton serving a model without tokenizer files
            return f"token-ids:{int(info['vocab_size'])}"
        return str(path)
    return model


def load_bench_tokenizer(path: str | None) -> Tokenizer:
    """baton's tokenizer (``"embedded"`` or no path: the served model's own), ``token-ids:V`` (a model served
    without tokenizer files, whose text is token ids: baton's IdTokenizer over V ids), else ``AutoTokenizer``."""
    if path is not None and path.startswith("token-ids"):
        vocab = path.partition(":")[2]
        try:
            from baton.tokenizer import IdTokenizer
        except ImportError:
            vocab = ""
        if not vocab.isdigit():
            raise BenchError("--tokenizer token-ids:VOCAB_SIZE (needs baton installed): the served model's "
                             "vocabulary size, for a server whose text is token ids")
        return IdTokenizer(int(vocab))
    try:
        from baton.tokenizer import load_tokenizer
    except ImportError:
        load_tokenizer = None
    if path in (None, "", "embedded"):
        if load_tokenizer is None:
            raise BenchError("the server reports an embedded tokenizer; pass --tokenizer")
        return load_tokenizer()
    if load_tokenizer is not None:
        try:
            return load_tokenizer(path)
        except Exception as e:  # e.g. a hub id baton cannot resolve: transformers may
            print(f"baton could not load tokenizer {path!r} ({e!r}); trying transformers")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


async def _arrivals(rows: Sequence[DatasetRow], request_rate: float) -> AsyncIterator[DatasetRow]:
    """All rows at once for an infinite rate, else exponential gaps (Poisson arrivals)."""
    for row in rows:
        yield row
        if math.isinf(request_rate):
            continue
        await asyncio.sleep(np.random.exponential(1.0 / request_rate))


async def _warmup(cfg: ClientConfig, row: DatasetRow, num_requests: int) -> None:
    if num_requests <= 0:
        return
    print(f"Starting warmup with {num_requests} sequences...")
    warm_row = DatasetRow(row.prompt, row.prompt_len, min(row.output_len, WARMUP_MAX_OUTPUT_LEN))
    outputs = await asyncio.gather(*(request_once(cfg, warm_row) for _ in range(num_requests)))
    if not any(o.success for o in outputs):
        raise BenchError(f"warmup failed; check the benchmark arguments. Error: {outputs[0].error}")
    print(f"Warmup completed with {num_requests} sequences. Starting main benchmark run...")


async def _flush_cache(base_url: str, headers: dict[str, str]) -> None:
    try:
        async with aiohttp.ClientSession(timeout=_INFO_TIMEOUT) as session:
            async with session.post(f"{base_url}/flush_cache", headers=headers) as resp:
                if resp.status != 200:
                    print(f"warning: /flush_cache answered {resp.status}")
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        print(f"warning: /flush_cache failed: {e!r}")


async def _timed_requests(
    cfg: ClientConfig, rows: Sequence[DatasetRow], args: argparse.Namespace
) -> list[RequestOutput]:
    semaphore = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    pbar = None
    if not args.disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(rows))

    async def limited(row: DatasetRow) -> RequestOutput:
        if semaphore is None:
            out = await request_once(cfg, row)
        else:
            async with semaphore:
                out = await request_once(cfg, row)
        if pbar is not None:
            pbar.update(1)
        return out

    tasks = [asyncio.create_task(limited(row)) async for row in _arrivals(rows, args.request_rate)]
    outputs = list(await asyncio.gather(*tasks))
    if pbar is not None:
        pbar.close()
    return outputs


async def _benchmark(
    args: argparse.Namespace, cfg: ClientConfig, rows: list[DatasetRow], tokenizer: Tokenizer, base_url: str
) -> dict[str, Any]:
    await _warmup(cfg, rows[0], args.warmup_requests)
    if args.flush_cache:
        await _flush_cache(base_url, cfg.headers)
    await asyncio.sleep(POST_WARMUP_SLEEP_S)

    start = time.perf_counter()
    outputs = await _timed_requests(cfg, rows, args)
    server_info = None
    if "sglang" in args.backend:
        server_info = await _get_json(f"{base_url}/server_info", cfg.headers)
    accept_length = accept_length_from(server_info)
    duration = time.perf_counter() - start  # includes the /server_info call, as in SGLang

    metrics, output_lens = calculate_metrics(rows, outputs, duration, tokenizer, args.backend, accept_length)
    print_results(args, metrics, duration, accept_length)
    if server_info is None:
        server_info = await _get_json(f"{base_url}/server_info", cfg.headers)
    record = result_record(args, metrics, duration, server_info, accept_length)
    details = result_details(outputs, output_lens)
    with open(args.output_file or default_output_file(args), "a", encoding="utf-8") as f:
        f.write(json.dumps(record | details if args.output_details else record) + "\n")
    if args.plot:
        plot_results(args.plot, outputs)
    return record | details


async def _run(args: argparse.Namespace, tokenizer_loader: TokenizerLoader) -> dict[str, Any]:
    base_url = resolve_base_url(args)
    headers = request_headers(args.header)
    if args.ready_check_timeout_sec > 0:
        await wait_until_ready(base_url, headers, args.ready_check_timeout_sec)
    model = args.model or await _served_model_id(base_url, headers)
    tokenizer = tokenizer_loader(await _tokenizer_path(args, base_url, headers, model))
    rows = build_dataset(args, tokenizer)
    cfg = ClientConfig(
        backend=args.backend,
        api_url=base_url + BACKEND_PATHS[args.backend],
        model=model,
        headers=headers,
        stream=not args.disable_stream,
        ignore_eos=not args.disable_ignore_eos,
        temperature=args.temperature,
        top_p=args.top_p,
        extra_body=_extra_body(args.extra_request_body),
    )
    if args.dataset_name == "multi-turn":
        if cfg.stream and cfg.backend not in NATIVE_BACKENDS:  # the usage chunk carries cached_tokens
            cfg.extra_body.setdefault("stream_options", {"include_usage": True})
        return await _multi_turn(args, cfg, rows, tokenizer, base_url)
    return await _benchmark(args, cfg, rows, tokenizer, base_url)


def _next_turn(row: DatasetRow, out: RequestOutput, tokenizer: Tokenizer, user_len: int) -> DatasetRow:
    """The conversation so far: the previous prompt, its answer and a new random user message."""
    new = _random_ids(tokenizer, user_len)
    if isinstance(row.prompt, list):
        answer = out.output_ids if out.output_ids is not None else \
            list(tokenizer.encode(out.generated_text, add_special_tokens=False))
        ids = row.prompt + answer + new
        return DatasetRow(ids, len(ids), row.output_len)
    text = row.prompt + out.generated_text + _decode(tokenizer, new)
    return DatasetRow(text, _text_prompt_len(tokenizer, text), row.output_len)


async def _multi_turn(args: argparse.Namespace, cfg: ClientConfig, rows: list[DatasetRow], tokenizer: Tokenizer,
                      base_url: str) -> dict[str, Any]:
    """Each conversation turn by turn, one request at a time: first with the cache as the conversation left it
    (the previous turn's prompt and answer: "cached"), then the same prompt again after a /flush_cache ("cold"),
    whose answer the next turn builds on. TTFT per turn, cold and cached, and the server's cached_tokens."""
    await _warmup(cfg, rows[0], args.warmup_requests)
    await asyncio.sleep(POST_WARMUP_SLEEP_S)
    turns: list[dict[str, Any]] = []
    for conv, first in enumerate(rows):
        await _flush_cache(base_url, cfg.headers)
        row = first
        for turn in range(args.multi_turn_num_turns):
            cached = await request_once(cfg, row)
            await _flush_cache(base_url, cfg.headers)
            cold = await request_once(cfg, row)
            for o in (cached, cold):
                if not o.success:
                    raise BenchError(f"multi-turn request failed: {o.error}")
            turns.append({"conversation": conv, "turn": turn, "prompt_len": row.prompt_len,
                          "cached_tokens": cached.cached_tokens, "ttft_cached_ms": 1000 * cached.ttft,
                          "ttft_cold_ms": 1000 * cold.ttft, "ratio": cached.ttft / cold.ttft if cold.ttft else None,
                          "same_output": cached.generated_text == cold.generated_text})
            row = _next_turn(row, cold, tokenizer, args.multi_turn_user_len)
    print(f"{' Multi-turn (TTFT per turn) ':=^78}")
    print(f"{'conv':>4} {'turn':>4} {'prompt':>7} {'cached':>7} {'cold ms':>10} {'cached ms':>10} {'ratio':>7} same")
    for t in turns:
        ratio = f"{t['ratio']:.3f}" if t["ratio"] is not None else "-"
        print(f"{t['conversation']:>4} {t['turn']:>4} {t['prompt_len']:>7} {t['cached_tokens'] or 0:>7} "
              f"{t['ttft_cold_ms']:>10.1f} {t['ttft_cached_ms']:>10.1f} {ratio:>7} {t['same_output']}")
    later = [t for t in turns if t["turn"] > 0]
    summary = {
        "mean_ttft_cold_ms": float(np.mean([t["ttft_cold_ms"] for t in later])) if later else None,
        "mean_ttft_cached_ms": float(np.mean([t["ttft_cached_ms"] for t in later])) if later else None,
    }
    if later:
        summary["mean_ratio"] = summary["mean_ttft_cached_ms"] / summary["mean_ttft_cold_ms"]
        print(f"turns > 0: cold {summary['mean_ttft_cold_ms']:.1f} ms, cached {summary['mean_ttft_cached_ms']:.1f} "
              f"ms, cached / cold {summary['mean_ratio']:.3f}")
    server_info = await _get_json(f"{base_url}/server_info", cfg.headers)
    record = {"tag": args.tag, "backend": args.backend, "dataset_name": "multi-turn",
              "num_conversations": len(rows), "num_turns": args.multi_turn_num_turns,
              "random_input_len": args.random_input_len, "random_output_len": args.random_output_len,
              "multi_turn_user_len": args.multi_turn_user_len, "turns": turns, **summary,
              "server_info": server_info}
    with open(args.output_file or default_output_file(args), "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
    return record


def run_benchmark(args: argparse.Namespace, tokenizer_loader: TokenizerLoader | None = None) -> dict[str, Any]:
    """Run one benchmark; returns the JSONL record merged with the per-request details.

    ``tokenizer_loader(path)`` builds the client-side tokenizer (default: ``load_bench_tokenizer``); it gets
    ``--tokenizer``, else /model_info's tokenizer_path or model_path, else the model id.
    """
    args = _with_defaults(args)
    _validate(args)
    random.seed(args.seed)
    np.random.seed(args.seed)
    return asyncio.run(_run(args, tokenizer_loader or load_bench_tokenizer))


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    """CLI entry: ``argv`` strings, or a namespace another parser already filled with ``add_bench_args``."""
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        parser = argparse.ArgumentParser(prog="baton bench", description="Benchmark online serving, SGLang-style.")
        args = add_bench_args(parser).parse_args(argv)
    try:
        if args.plot and not have_matplotlib():
            raise BenchError(missing_message("--plot"))
        run_benchmark(args)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
