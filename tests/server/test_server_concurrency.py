"""Concurrency: one engine thread serves queued clients in order; clients that leave abort their request,
whether it is running or still queued, and later requests are unaffected."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from fake_engine import FakeEngine, expected_text

CHAT_TEMPLATE = "<|user|>{}\n<|assistant|>"


def _wait_for(predicate, timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def _native_stream(client: httpx.AsyncClient, prompt: str, n: int) -> str:
    body = {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": n, "temperature": 0}}
    text, counts = "", []
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text = chunk["text"]
                counts.append(chunk["meta_info"]["completion_tokens"])
    assert counts == list(range(1, n + 1))
    return text


async def _chat_stream(client: httpx.AsyncClient, prompt: str, n: int) -> str:
    body = {
        "model": "fake-model",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": n,
        "stream": True,
    }
    text = ""
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                text += chunk["choices"][0]["delta"].get("content") or ""
    return text


def test_16_concurrent_streams(fake_server) -> None:
    async def main() -> list[str]:
        limits = httpx.Limits(max_connections=32)
        async with httpx.AsyncClient(base_url=fake_server.url, timeout=30, limits=limits) as client:
            jobs = [
                _native_stream(client, f"prompt {i}", 20)
                if i % 2
                else _chat_stream(client, f"prompt {i}", 20)
                for i in range(16)
            ]
            return await asyncio.gather(*jobs)

    engine = fake_server.engine
    started_before = len(engine.started)
    texts = asyncio.run(main())
    for i, text in enumerate(texts):
        prompt = f"prompt {i}" if i % 2 else CHAT_TEMPLATE.format(f"prompt {i}")
        assert text == expected_text(prompt, 20, chat=i % 2 == 0)
    assert len(engine.started) - started_before == 16
    assert engine.max_active == 1
    assert len(engine.thread_ids) == 1


@pytest.fixture()
def slow_server(server_factory):
    return server_factory(lambda args: FakeEngine(step_delay=0.005))


def test_client_killed_mid_stream_aborts(slow_server) -> None:
    engine = slow_server.engine
    body = {"text": "long one", "rid": "killed", "stream": True, "sampling_params": {"max_new_tokens": 400}}
    with httpx.Client(base_url=slow_server.url, timeout=10) as client:
        with client.stream("POST", "/generate", json=body) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    _wait_for(lambda: "killed" in engine.aborted)
    assert engine.finished["killed"] == "abort"
    with httpx.Client(base_url=slow_server.url, timeout=10) as client:
        out = client.post("/generate", json={"text": "next", "sampling_params": {"max_new_tokens": 8}}).json()
    assert out["text"] == expected_text("next", 8)


def test_openai_stream_closed_aborts(slow_server) -> None:
    engine = slow_server.engine
    client = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "go"}], max_tokens=400, stream=True
    )
    aborted_before = len(engine.aborted)
    for i, _ in enumerate(stream):
        if i == 2:
            break
    stream.close()
    client.close()
    _wait_for(lambda: len(engine.aborted) > aborted_before)
    out = openai.OpenAI(base_url=slow_server.url + "/v1", api_key="x", max_retries=0).completions.create(
        model="fake-model", prompt="after", max_tokens=5
    )
    assert out.choices[0].text == expected_text("after", 5)


def test_non_stream_client_timeout_aborts_running_request(slow_server) -> None:
    engine = slow_server.engine
    body = {"text": "slow", "rid": "gave-up", "sampling_params": {"max_new_tokens": 400}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/generate", json=body, timeout=0.2)
    _wait_for(lambda: "gave-up" in engine.aborted)


def test_queued_request_of_vanished_client_is_skipped(slow_server) -> None:
    engine = slow_server.engine
    result: dict = {}

    def long_request() -> None:
        body = {"text": "first", "rid": "running", "sampling_params": {"max_new_tokens": 100}}
        result["out"] = httpx.post(slow_server.url + "/generate", json=body, timeout=10).json()

    thread = threading.Thread(target=long_request)
    thread.start()
    _wait_for(lambda: "running" in engine.started)
    body = {"text": "second", "rid": "vanished", "sampling_params": {"max_new_tokens": 5}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_server.url + "/generate", json=body, timeout=0.1)
    thread.join()
    assert result["out"]["text"] == expected_text("first", 100)
    with httpx.Client(base_url=slow_server.url) as client:
        third = {"text": "third", "sampling_params": {"max_new_tokens": 2}}
        assert client.post("/generate", json=third).status_code == 200
        assert "vanished" not in engine.started
        metrics = client.get("/metrics").text
    assert 'baton:num_requests_total{finish_reason="abort"}' in metrics
