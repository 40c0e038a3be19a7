"""The prefix cache through the server, over the real embedded engine (SmolLM2-135M-Instruct, CPU): a second
chat turn reports ``usage.prompt_tokens_details.cached_tokens`` and the native ``meta_info.cached_tokens``,
``/metrics`` and ``/server_info`` show the hit rate, and a flush during a stream waits for it, leaves its output
intact and empties the cache."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
import openai
import pytest
from harness import RunningServer, sse_payloads

from baton.engine.engine import Engine

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(server_factory: Callable[..., RunningServer]) -> RunningServer:
    return server_factory(Engine, device="cpu", context_length=2048)


def _generate(url: str, ids: list[int], n: int = 16) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}}
    r = httpx.post(url + "/generate", json=body, timeout=120.0)
    r.raise_for_status()
    return r.json()


def test_second_chat_turn_is_cached(server: RunningServer) -> None:
    httpx.post(server.url + "/flush_cache", timeout=60.0).raise_for_status()
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
    model = client.models.list().data[0].id
    first = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=16, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    turn2 = QUESTION + [{"role": "assistant", "content": first.choices[0].message.content},
                        {"role": "user", "content": "And of Germany?"}]
    second = client.chat.completions.create(model=model, messages=turn2, max_tokens=16, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens <= cached < second.usage.prompt_tokens
    metrics = httpx.get(server.url + "/metrics").text
    rate = [line for line in metrics.splitlines() if line.startswith("baton:cache_hit_rate ")]
    assert rate and float(rate[0].split()[1]) > 0
    info = httpx.get(server.url + "/server_info").json()
    assert info["prefix_cache_enabled"] and info["prefix_cache_hits"] >= 1 and info["prefix_cache_hit_rate"] > 0


def test_native_meta_info_reports_cached_tokens(server: RunningServer) -> None:
    ids = list(range(100, 180))
    httpx.post(server.url + "/reset_prefix_cache", timeout=60.0).raise_for_status()
    cold = _generate(server.url, ids)
    assert cold["meta_info"]["cached_tokens"] == 0
    warm = _generate(server.url, ids + cold["output_ids"] + [200, 201, 202])
    assert warm["meta_info"]["cached_tokens"] >= len(ids) + len(cold["output_ids"])
    again = _generate(server.url, ids)
    assert again["output_ids"] == cold["output_ids"] and again["meta_info"]["cached_tokens"] == len(ids) - 1


def test_flush_during_a_stream(server: RunningServer) -> None:
    ids = list(range(300, 360))
    reference = _generate(server.url, ids, n=48)["output_ids"]
    httpx.post(server.url + "/flush_cache", timeout=60.0).raise_for_status()
    started, chunks = threading.Event(), []

    def stream() -> None:
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True}}
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120.0) as r:
            lines = []
            for line in r.iter_lines():
                lines.append(line)
                started.set()
            chunks.extend(sse_payloads(lines))

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60.0)
    flushed = httpx.post(server.url + "/flush_cache", timeout=120.0)  # waits for the running request
    t.join(120.0)
    assert flushed.status_code == 200
    final = [c for c in chunks if c != "[DONE]"][-1]
    assert final["output_ids"] == reference
    after = _generate(server.url, ids, n=48)
    assert after["meta_info"]["cached_tokens"] == 0 and after["output_ids"] == reference
