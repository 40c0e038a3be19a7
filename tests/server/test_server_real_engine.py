"""The server over the REAL engine (the embedded SmolLM2-135M-Instruct, CPU): the official ``openai`` client
(completions and chat, streaming and not, stop strings, usage) and ``baton bench`` reporting every metric."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import openai
import pytest
from harness import RunningServer

from baton.bench.serving import run_benchmark
from baton.engine.engine import Engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"
SGLANG_KEYS = {
    "tag", "backend", "dataset_name", "request_rate", "max_concurrency", "sharegpt_output_len",
    "random_input_len", "random_output_len", "random_range_ratio", "server_info", "duration", "completed",
    "total_input_tokens", "total_input_text_tokens", "total_input_vision_tokens", "total_output_tokens",
    "total_output_tokens_retokenized", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "accept_length", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{s}_{k}_ms" for k in ("e2e_latency", "ttft", "tpot", "itl")
      for s in ("mean", "median", "std", "p90", "p95", "p99")),
}  # fmt: skip


@pytest.fixture(scope="module")
def real_server(server_factory: Callable[..., RunningServer]) -> RunningServer:
    return server_factory(Engine, device="cpu", context_length=2048)


@pytest.fixture(scope="module")
def client(real_server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_chat_answers_paris(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=_model(client), messages=QUESTION, max_tokens=24, temperature=0)
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason in ("stop", "length")
    assert out.usage.prompt_tokens > 5
    assert 0 < out.usage.completion_tokens <= 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_chat_stream_matches_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(model=_model(client), messages=QUESTION, max_tokens=24, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole and "Paris" in streamed
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices and 0 < usage.completion_tokens <= 24


def test_chat_stop_string(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=_model(client), messages=QUESTION, max_tokens=24, temperature=0,
                                         stop=["Paris"])
    assert "Paris" not in out.choices[0].message.content
    assert out.choices[0].finish_reason == "stop"


def test_completion_stream_and_not(client: openai.OpenAI) -> None:
    kwargs = dict(model=_model(client), prompt=PROMPT, max_tokens=8, temperature=0)
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    assert whole.usage.completion_tokens == 8 and whole.choices[0].finish_reason == "length"
    assert whole.usage.prompt_tokens == whole.usage.total_tokens - 8 > 0
    chunks = list(client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_stop_string(client: openai.OpenAI) -> None:
    kwargs = dict(model=_model(client), prompt=PROMPT, max_tokens=12, temperature=0)
    full = client.completions.create(**kwargs, extra_body={"ignore_eos": True}).choices[0].text
    stop = full.strip().split()[0]
    out = client.completions.create(**kwargs, stop=[stop])
    assert out.choices[0].text == full[: full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_bench_reports_every_metric(real_server: RunningServer, tmp_path: Path) -> None:
    args = argparse.Namespace(base_url=real_server.url, dataset_name="random-ids", num_prompts=4,
                              random_input_len=32, random_output_len=16, output_file=str(tmp_path / "b.jsonl"),
                              disable_tqdm=True)
    record = run_benchmark(args)
    assert SGLANG_KEYS <= set(record)
    assert record["completed"] == 4
    assert record["total_output_tokens"] == sum(record["output_lens"]) > 0
    assert record["output_throughput"] > 0 and record["mean_e2e_latency_ms"] > 0
    assert record["server_info"]["internal_states"][0]["spec_num_verify_steps"] == 0
    assert (tmp_path / "b.jsonl").read_text().count("\n") == 1


def test_model_info_tokenizer_loads_with_auto_tokenizer(real_server: RunningServer) -> None:
    """An outside client (SGLang's bench_serving) loads /model_info's tokenizer_path with AutoTokenizer, so it needs
    no --tokenizer: for the embedded model that is the tokenizer directory baton converted from the GGUF."""
    import httpx
    from transformers import AutoTokenizer

    info = httpx.get(real_server.url + "/model_info", timeout=30).json()
    path = info["tokenizer_path"]
    assert Path(path).is_dir(), info
    assert httpx.get(real_server.url + "/server_info", timeout=30).json()["tokenizer_path"] == path
    hf = AutoTokenizer.from_pretrained(path)
    text = "The capital of France is Paris."
    assert hf.encode(text, add_special_tokens=False) == real_server.engine.tokenizer.encode(text)
