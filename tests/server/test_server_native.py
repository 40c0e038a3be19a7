"""SGLang's native API: /generate (streaming cumulative text, completion_tokens per chunk, spec fields,
bench payloads, batches), /model_info, /server_info, /flush_cache, /health and the profile no-ops."""

from __future__ import annotations

import httpx
import pytest
from fake_engine import CharTokenizer, FakeEngine, expected_text
from harness import sse_payloads

PROMPT = "The capital of France is"

# What SGLang's bench_serving sends with --backend sglang.
BENCH_PAYLOAD = {
    "text": PROMPT,
    "sampling_params": {"temperature": 0.0, "max_new_tokens": 16, "ignore_eos": True},
    "stream": True,
    "lora_path": None,
    "return_logprob": False,
    "return_routed_experts": False,
    "logprob_start_len": -1,
}


def _stream(client: httpx.Client, payload: dict) -> list:
    with client.stream("POST", "/generate", json=payload) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_payloads(r.iter_lines())


def test_generate(http: httpx.Client) -> None:
    body = {"text": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 10}, "rid": "r-1"}
    r = http.post("/generate", json=body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["text"] == expected_text(PROMPT, 10)
    assert len(out["output_ids"]) == 10
    meta = out["meta_info"]
    assert meta["id"] == "r-1"
    assert meta["prompt_tokens"] == len(PROMPT.encode()) + 1  # BOS
    assert meta["completion_tokens"] == 10
    assert meta["finish_reason"] == {"type": "length", "length": 10}
    assert meta["spec_verify_ct"] == 0 and "spec_accept_length" not in meta
    assert 0 < meta["e2e_latency"] < 5


def test_generate_put_input_ids_and_stop(http: httpx.Client) -> None:
    full = expected_text(PROMPT, 30)
    body = {
        "input_ids": CharTokenizer().encode(PROMPT, add_special_tokens=True),
        "sampling_params": {
            "max_new_tokens": 30,
            "stop": full[20:23],
            "top_k": 5,
            "min_p": 0.1,
            "seed": 3,
            "skip_special_tokens": True,
            "stop_token_ids": [0],
        },
    }
    out = http.put("/generate", json=body).json()
    assert out["text"] == full[:20]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": full[20:23]}


def test_generate_stream_cumulative(http: httpx.Client) -> None:
    events = _stream(http, BENCH_PAYLOAD)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    full = expected_text(PROMPT, 16)
    for i, chunk in enumerate(chunks):
        assert chunk["meta_info"]["completion_tokens"] == i + 1
        assert chunk["text"] == full[: i + 1]  # cumulative, as SGLang streams by default
        assert len(chunk["output_ids"]) == i + 1
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert "e2e_latency" in chunks[-1]["meta_info"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_generate_stream_holds_back_stop_prefix(http: httpx.Client) -> None:
    full = expected_text(PROMPT, 30)
    payload = {
        "text": PROMPT,
        "stream": True,
        "sampling_params": {"max_new_tokens": 30, "stop": [full[8:12]]},
    }
    chunks = _stream(http, payload)[:-1]
    assert all(full[8:12] not in c["text"] for c in chunks)
    assert chunks[-1]["text"] == full[:8]
    assert chunks[-1]["meta_info"]["completion_tokens"] == 12


def test_generate_batch(http: httpx.Client) -> None:
    body = {"text": [PROMPT, "other"], "sampling_params": [{"max_new_tokens": 3}, {"max_new_tokens": 4}]}
    out = http.post("/generate", json=body).json()
    assert [o["text"] for o in out] == [expected_text(PROMPT, 3), expected_text("other", 4)]


def test_generate_zero_tokens_precache(http: httpx.Client) -> None:
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": {"max_new_tokens": 0}}).json()
    assert out["text"] == "" and out["meta_info"]["completion_tokens"] == 0


def test_frontend_style_sampling_params(http: httpx.Client) -> None:
    # sglang.lang's RuntimeEndpoint sends every field, most at their defaults.
    params = {
        "max_new_tokens": 5,
        "min_new_tokens": 0,
        "n": 1,
        "stop": ["Question"],
        "stop_token_ids": None,
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
        "ignore_eos": False,
        "regex": None,
        "json_schema": None,
    }
    out = http.post("/generate", json={"text": PROMPT, "sampling_params": params})
    assert out.status_code == 200, out.text
    assert out.json()["text"] == expected_text(PROMPT, 5)


def test_spec_fields(server_factory) -> None:
    running = server_factory(lambda args: FakeEngine(tokens_per_step=3))
    with httpx.Client(base_url=running.url) as client:
        client.post("/flush_cache")
        events = _stream(client, {**BENCH_PAYLOAD, "sampling_params": {"max_new_tokens": 10}})[:-1]
        counts = [e["meta_info"]["completion_tokens"] for e in events]
        assert counts == [1, 4, 7, 10]  # prefill token, then 3 per verify step
        assert events[-1]["text"] == expected_text(PROMPT, 10)
        meta = events[-1]["meta_info"]
        assert meta["spec_verify_ct"] == 3
        assert meta["spec_accept_length"] == pytest.approx(10 / 3)
        state = client.get("/server_info").json()["internal_states"][0]
        assert state["avg_spec_accept_length"] == pytest.approx(3.0)
        assert state["spec_accept_histogram"] == [0, 0, 3]
        assert client.post("/flush_cache").status_code == 200
        state = client.get("/get_server_info").json()["internal_states"][0]
        assert "avg_spec_accept_length" not in state


def test_model_info(http: httpx.Client) -> None:
    for path in ("/model_info", "/get_model_info"):
        info = http.get(path).json()
        assert info["model_path"] == "fake-model"
        assert info["tokenizer_path"] == "fake-model"
        assert info["is_generation"] is True


def test_server_info(http: httpx.Client) -> None:
    info = http.get("/server_info").json()
    assert info["port"] > 0 and info["speculative_algorithm"] is None
    assert "api_key" not in info
    assert isinstance(info["internal_states"], list)
    assert "avg_spec_accept_length" not in info["internal_states"][0]


def test_flush_cache(fake_server, http: httpx.Client) -> None:
    before = fake_server.engine.flush_count
    assert http.get("/flush_cache").status_code == 200
    assert http.post("/flush_cache", params={"timeout": 5}).status_code == 200
    assert fake_server.engine.flush_count == before + 2


def test_health_and_profile(http: httpx.Client) -> None:
    assert http.get("/health").status_code == 200
    assert http.get("/health_generate").status_code == 200
    assert http.post("/start_profile").status_code == 200
    assert http.post("/stop_profile").status_code == 200


def test_reset_prefix_cache_is_flush_cache(fake_server, http: httpx.Client) -> None:
    """vLLM's /reset_prefix_cache clears the same state as SGLang's /flush_cache."""
    before = fake_server.engine.flush_count
    assert http.post("/reset_prefix_cache").status_code == 200
    assert http.get("/reset_prefix_cache").status_code == 200
    assert fake_server.engine.flush_count == before + 2
