"""Bad requests get a 400 (or 401/404/405/413/500) with an OpenAI-style error body and no traceback, and the
server keeps serving afterwards; engine failures end only their own request."""

from __future__ import annotations

import httpx
import openai
import pytest
from fake_engine import FakeEngine, expected_text
from harness import sse_payloads

OK_CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
OK_COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}

BAD_REQUESTS = [
    # (path, body, expected words in the message, expected param)
    ("/v1/completions", b"{not json", "not valid JSON", None),
    ("/v1/completions", b"", "empty", None),
    ("/v1/completions", b"[1, 2]", "", None),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": "many"}, "max_tokens", "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "temperature": "hot"}, "temperature", "temperature"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": 12}, "prompt", "prompt"),
    ("/v1/completions", {"model": "fake-model"}, "prompt", "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": -1}, "max_tokens", "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "max_tokens": 10**9}, "context length", "max_tokens"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": "x" * 600}, "context length", "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ""}, "empty", "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": []}, "empty", "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": ["a", "b"]}, "one prompt", "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "prompt": [5, -3]}, "token id -3", "prompt"),
    ("/v1/completions", {**OK_COMPLETION, "n": 2}, "n=2", "n"),
    ("/v1/completions", {**OK_COMPLETION, "temperature": -1}, "temperature", None),
    ("/v1/completions", {**OK_COMPLETION, "top_p": 0}, "top_p", None),
    ("/v1/completions", {**OK_COMPLETION, "top_k": 0}, "top_k", None),
    ("/v1/completions", {**OK_COMPLETION, "min_p": 2}, "min_p", None),
    ("/v1/completions", {**OK_COMPLETION, "logprobs": 2}, "logprobs", "logprobs"),
    (
        "/v1/completions",
        {**OK_COMPLETION, "frequency_penalty": 0.5},
        "frequency_penalty",
        "frequency_penalty",
    ),
    ("/v1/completions", {**OK_COMPLETION, "stop": 3}, "stop", "stop"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": []}, "messages", "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": "hi"}, "messages", "messages"),
    ("/v1/chat/completions", {**OK_CHAT, "messages": [{"role": "wizard", "content": "x"}]}, "role", None),
    (
        "/v1/chat/completions",
        {**OK_CHAT, "messages": [{"role": "tool", "content": "x"}]},
        "chat template",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {
            **OK_CHAT,
            "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}],
        },
        "image_url",
        "messages",
    ),
    (
        "/v1/chat/completions",
        {**OK_CHAT, "max_completion_tokens": -5},
        "max_completion_tokens",
        "max_completion_tokens",
    ),
    ("/v1/chat/completions", {**OK_CHAT, "n": 3}, "n=3", "n"),
    ("/v1/chat/completions", {**OK_CHAT, "tools": [{"type": "function"}]}, "tools", "tools"),
    ("/generate", {}, "text or input_ids", "text"),
    ("/generate", {"text": "a", "input_ids": [4]}, "text or input_ids", "text"),
    ("/generate", {"text": ""}, "empty", "text"),
    ("/generate", {"input_ids": []}, "empty", "input_ids"),
    (
        "/generate",
        {"text": "a", "sampling_params": {"max_new_tokens": -1}},
        "max_new_tokens",
        "max_new_tokens",
    ),
    ("/generate", {"text": "a", "sampling_params": {"temperature": 1000}}, "temperature", None),
    ("/generate", {"text": "a", "sampling_params": {"regex": "[a-z]+"}}, "regex", "regex"),
    ("/generate", {"text": "a", "return_logprob": True}, "return_logprob", "return_logprob"),
    ("/generate", {"text": "a", "sampling_params": "hot"}, "sampling_params", "sampling_params"),
    ("/generate", {"text": ["a", "b"], "stream": True}, "single prompt", "stream"),
    ("/generate", {"text": "REJECT me"}, "rejects", None),
    ("/v1/completions", {**OK_COMPLETION, "seed": 2**63}, "[-9223372036854775808, 9223372036854775807]", None),
    ("/v1/chat/completions", {**OK_CHAT, "seed": -(2**63) - 1}, "64-bit signed integer", None),
    ("/generate", {"text": "a", "sampling_params": {"sampling_seed": 2**70}}, "seed must be", None),
]


def _assert_error(r: httpx.Response, status: int, words: str = "") -> dict:
    assert r.status_code == status, r.text
    assert "Traceback" not in r.text
    body = r.json()
    err = body["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status
    assert words.lower() in err["message"].lower(), err["message"]
    return err


@pytest.mark.parametrize("path,body,words,param", BAD_REQUESTS)
def test_bad_request(
    http: httpx.Client, path: str, body: dict | bytes, words: str, param: str | None
) -> None:
    if isinstance(body, bytes):
        r = http.post(path, content=body, headers={"content-type": "application/json"})
    else:
        r = http.post(path, json=body)
    err = _assert_error(r, 400, words)
    assert err["type"] == "invalid_request_error"
    if param is not None:
        assert err["param"] == param


def _assert_error_code(r: httpx.Response, status: int, code: str, words: str = "") -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == code and words.lower() in err["message"].lower(), err
    return err


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**OK_COMPLETION, "model": "gpt-4"}),
    ("/v1/chat/completions", {**OK_CHAT, "model": "nope"}),
    ("/v1/chat/completions", {**OK_CHAT, "model": "nope", "stream": True}),
])
def test_unknown_model_is_404_model_not_found(http: httpx.Client, path: str, body: dict) -> None:
    """OpenAI and vLLM answer 404 with code model_not_found (the openai client raises NotFoundError)."""
    err = _assert_error_code(http.post(path, json=body), 404, "model_not_found", body["model"])
    assert err["param"] == "model"
    _assert_error_code(http.get("/v1/models/gpt-4"), 404, "model_not_found", "gpt-4")


def test_unknown_model_through_the_openai_client(oai: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        oai.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert info.value.code == "model_not_found"


def test_seed_range_is_checked_before_queueing(fake_server, http: httpx.Client) -> None:
    """A seed torch cannot take is a 400 naming the range, and the engine never sees the request."""
    before = len(fake_server.engine.started)
    r = http.post("/v1/completions", json={**OK_COMPLETION, "seed": 2**64, "temperature": 0.7})
    _assert_error(r, 400, "seed must be a 64-bit signed integer")
    assert len(fake_server.engine.started) == before
    for seed in (2**63 - 1, -(2**63), 0):
        ok = http.post("/v1/completions", json={**OK_COMPLETION, "seed": seed, "temperature": 0.7})
        assert ok.status_code == 200, ok.text


def test_bad_stream_request_fails_before_streaming(http: httpx.Client) -> None:
    r = http.post("/v1/chat/completions", json={**OK_CHAT, "stream": True, "max_tokens": -1})
    _assert_error(r, 400, "max_tokens")


def test_unknown_route_and_method(http: httpx.Client) -> None:
    _assert_error(http.get("/v2/nothing"), 404)
    _assert_error(http.get("/generate"), 405)


def test_engine_failure_is_500_and_isolated(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "RAISE now", "sampling_params": {"max_new_tokens": 5}})
    err = _assert_error(r, 500, "fake engine failure")
    assert err["type"] == "server_error"
    r = http.post("/v1/completions", json={**OK_COMPLETION, "prompt": "RAISE", "stream": True})
    _assert_error(r, 500, "fake engine failure")
    ok = http.post("/v1/completions", json=OK_COMPLETION)
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == expected_text("hi", 4)


def test_engine_failure_mid_stream_is_an_sse_error(http: httpx.Client) -> None:
    payload = {"text": "RAISE_LATE", "stream": True, "sampling_params": {"max_new_tokens": 20}}
    with http.stream("POST", "/generate", json=payload) as r:
        assert r.status_code == 200
        events = sse_payloads(r.iter_lines())
    assert events[-1] == "[DONE]"
    assert "fake engine failure mid-stream" in events[-2]["error"]["message"]
    assert [e["meta_info"]["completion_tokens"] for e in events[:-2]] == [1, 2, 3]
    ok = http.post("/generate", json={"text": "fine", "sampling_params": {"max_new_tokens": 3}})
    assert ok.json()["text"] == expected_text("fine", 3)


def test_server_still_serves_after_errors(oai: openai.OpenAI, http: httpx.Client) -> None:
    for path, body, _, _ in BAD_REQUESTS[:8]:
        http.post(path, content=body) if isinstance(body, bytes) else http.post(path, json=body)
    out = oai.chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=6
    )
    assert out.choices[0].message.content == expected_text("<|user|>hi\n<|assistant|>", 6, chat=True)
    with pytest.raises(openai.BadRequestError) as info:
        oai.completions.create(model="fake-model", prompt="hi", max_tokens=-3)
    assert "max_tokens" in str(info.value)


def test_body_size_limit(server_factory) -> None:
    running = server_factory(lambda args: FakeEngine(), max_request_bytes=2048)
    with httpx.Client(base_url=running.url) as client:
        big = {**OK_COMPLETION, "prompt": "x" * 4096}
        _assert_error(client.post("/v1/completions", json=big), 413, "limit")

        def chunks():
            yield b'{"model": "fake-model", "prompt": "'
            for _ in range(8):
                yield b"y" * 512
            yield b'"}'

        r = client.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        _assert_error(r, 413, "limit")

        def small():
            yield b'{"text": "hi", "sampling_params": {"max_new_tokens": 2}}'

        r = client.post("/generate", content=small())
        assert r.status_code == 200 and r.json()["text"] == expected_text("hi", 2)


def test_api_key(server_factory) -> None:
    running = server_factory(lambda args: FakeEngine(), api_key="sekrit")
    with httpx.Client(base_url=running.url) as client:
        assert client.get("/health").status_code == 200
        for path in ("/v1/models", "/model_info", "/server_info", "/metrics"):
            err = _assert_error(client.get(path), 401, "api key")
            assert err["type"] == "authentication_error"
        _assert_error(
            client.post("/generate", json={"text": "hi"}, headers={"Authorization": "Bearer nope"}), 401
        )
        _assert_error(client.get("/v1/models", headers={"Authorization": "sekrit"}), 401)
        assert client.get("/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    good = openai.OpenAI(base_url=running.url + "/v1", api_key="sekrit", max_retries=0)
    assert good.completions.create(model="fake-model", prompt="hi", max_tokens=2).choices[0].text
    bad = openai.OpenAI(base_url=running.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model="fake-model", prompt="hi", max_tokens=2)
