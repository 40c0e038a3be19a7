"""GET /metrics: Prometheus text with request counts by finish reason, token counters, latency histograms,
the speculative accept length and the queue gauges."""

from __future__ import annotations

import re

import httpx
from fake_engine import FakeEngine


def _samples(text: str) -> dict[str, float]:
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_metrics_series(server_factory) -> None:
    running = server_factory(lambda args: FakeEngine(tokens_per_step=2))
    with httpx.Client(base_url=running.url) as client:
        for n in (5, 7):
            assert client.post(
                "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": n}}
            ).is_success
        client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 9, "stop": "zzz"})
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    samples = _samples(text)
    assert samples['baton:num_requests_total{finish_reason="length"}'] == 3
    assert samples["baton:prompt_tokens_total"] == 9  # 3 x (BOS + "hi")
    assert samples["baton:generation_tokens_total"] == 21
    for hist in (
        "time_to_first_token_seconds",
        "time_per_output_token_seconds",
        "e2e_request_latency_seconds",
        "queue_time_seconds",
    ):
        assert f"# TYPE baton:{hist} histogram" in text
        assert samples[f"baton:{hist}_count"] == 3
        assert samples[f'baton:{hist}_bucket{{le="+Inf"}}'] == 3
    assert samples["baton:spec_accept_length"] == 2.0
    assert samples["baton:spec_verify_calls_total"] > 0
    assert samples["baton:num_queue_reqs"] == 0
    assert samples["baton:num_running_reqs"] == 0
    assert all(
        re.fullmatch(r"(# (HELP|TYPE) .+|baton:[a-z0-9_]+(\{.*\})? \S+)", line) for line in text.splitlines()
    )


def test_accept_length_absent_without_spec(fake_server) -> None:
    text = httpx.get(fake_server.url + "/metrics").text
    assert "# TYPE baton:spec_accept_length gauge" in text
    assert "\nbaton:spec_accept_length " not in text
