"""The bench_serving-compatible client against an in-process fake SSE server, plus its pure metric code."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import socket
import sys
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from baton.bench import serving
from baton.bench.serving import (
    BenchError,
    DatasetRow,
    RequestOutput,
    accept_length_from,
    add_bench_args,
    build_dataset,
    calculate_metrics,
    compute_random_lens,
    default_output_file,
    request_headers,
    run_benchmark,
    sample_random_requests,
)

GSM8K_TEST = Path("/work/shared/data/gsm8k/test.jsonl")
ACCEPT_LENGTH = 2.5
EOS_AT = 6  # the fake model emits EOS after this many tokens unless ignore_eos is set
SGLANG_KEYS = {
    "tag", "backend", "dataset_name", "request_rate", "max_concurrency", "sharegpt_output_len",
    "random_input_len", "random_output_len", "random_range_ratio", "server_info", "duration", "completed",
    "total_input_tokens", "total_input_text_tokens", "total_input_vision_tokens", "total_output_tokens",
    "total_output_tokens_retokenized", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "concurrency", "accept_length", "max_output_tokens_per_s", "max_concurrent_requests",
    *(f"{s}_{k}_ms" for k in ("e2e_latency", "ttft", "tpot", "itl")
      for s in ("mean", "median", "std", "p90", "p95", "p99")),
}  # fmt: skip
DETAIL_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"}


class TinyTokenizer:
    """Word-level: ``w<id>`` is token ``id``, anything else is token 3; ids 0-2 are special."""

    vocab_size = 64
    all_special_ids = [0, 1, 2]
    bos_token = "w0"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = [int(w[1:]) if re.fullmatch(r"w\d+", w) else 3 for w in text.split()]
        return [0, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(f"w{i}" for i in ids)

    def num_special_tokens_to_add(self) -> int:
        return 1

    def apply_chat_template(self, messages: list[dict[str, str]], **_: Any) -> str:
        return f"w0 w3 {messages[-1]['content']} w4"


def _words(start: int, end: int) -> str:
    return " ".join(f"w{5 + i % 50}" for i in range(start, end))


def _chunk_ends(n: int, per_chunk: int) -> list[int]:
    """Prefill gives one token, then each step several (as under speculative decoding)."""
    return [1, *range(1 + per_chunk, n, per_chunk), n] if n > 1 else [n]


def _sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


class FakeServer:
    """SGLang-shaped endpoints: cumulative native stream, OpenAI deltas, /server_info with accept length."""

    def __init__(self) -> None:
        self.url = ""
        self.reset()

    def reset(self) -> None:
        self.payloads: list[tuple[str, dict[str, Any]]] = []
        self.flushes = 0
        self.fail = False
        self.tokens_per_chunk = 3
        self.delay_s = 0.003

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/flush_cache", self.flush_cache)
        app.router.add_post("/generate", self.generate)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.completions)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": "m", "tokenizer_path": "tok"})

    async def server_info(self, request: web.Request) -> web.Response:
        return web.json_response({"internal_states": [{"avg_spec_accept_length": ACCEPT_LENGTH}], "version": "x"})

    async def flush_cache(self, request: web.Request) -> web.Response:
        self.flushes += 1
        return web.Response(text="Cache flushed.")

    async def _start(self, request: web.Request) -> tuple[dict[str, Any], int] | web.Response:
        body = await request.json()
        self.payloads.append((request.path, body))
        if self.fail:
            return web.json_response({"error": "boom"}, status=500)
        params = body.get("sampling_params", body)
        n = params.get("max_new_tokens") or params.get("max_tokens") or params["max_completion_tokens"]
        return body, (n if params.get("ignore_eos") else min(n, EOS_AT))

    async def _stream(self, request: web.Request, events: list[dict[str, Any]]) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for event in events:
            await asyncio.sleep(self.delay_s)
            await resp.write(_sse(event))
        await resp.write(b"data: [DONE]\n\n")
        return resp

    async def generate(self, request: web.Request) -> web.StreamResponse:
        started = await self._start(request)
        if isinstance(started, web.Response):
            return started
        body, n = started
        if not body.get("stream"):
            return web.json_response({"text": _words(0, n), "meta_info": {"completion_tokens": n}})
        ends = _chunk_ends(n, self.tokens_per_chunk)
        ends = ends[:1] + ends[:1] + ends[1:]  # a repeated count (held-back text) adds no ITL entry
        events = [{"text": _words(0, e), "meta_info": {"completion_tokens": e}} for e in ends]
        return await self._stream(request, events)

    async def completions(self, request: web.Request) -> web.StreamResponse:
        started = await self._start(request)
        if isinstance(started, web.Response):
            return started
        body, n = started
        is_chat = request.path.endswith("chat/completions")
        usage = {"prompt_tokens": 5, "completion_tokens": n}
        if not body.get("stream"):
            choice = {"message": {"content": _words(0, n)}} if is_chat else {"text": _words(0, n)}
            return web.json_response({"choices": [choice], "usage": usage})
        ends = _chunk_ends(n, self.tokens_per_chunk)
        texts = [(" " if s else "") + _words(s, e) for s, e in zip([0, *ends], ends, strict=False)]
        if is_chat:
            events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}]
            events += [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in texts]
            events += [{"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
        else:
            events = [{"choices": [{"index": 0, "text": t}]} for t in texts]
        if (body.get("stream_options") or {}).get("include_usage"):
            events.append({"choices": [], "usage": usage})
        return await self._stream(request, events)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[FakeServer]:
    fake = FakeServer()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    runner = web.AppRunner(fake.app())

    async def start() -> None:
        await runner.setup()
        await web.SockSite(runner, sock).start()

    asyncio.run_coroutine_threadsafe(start(), loop).result(10)
    fake.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    yield fake
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture
def server(fake_server: FakeServer, monkeypatch: pytest.MonkeyPatch) -> FakeServer:
    fake_server.reset()
    monkeypatch.setattr(serving, "POST_WARMUP_SLEEP_S", 0.0)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.delenv("API_KEY", raising=False)
    return fake_server


def _args(server: FakeServer, tmp_path: Path, *extra: str) -> argparse.Namespace:
    argv = ["--base-url", server.url, "--num-prompts", "4", "--random-input-len", "16"]
    argv += ["--random-output-len", "10", "--random-range-ratio", "1", "--disable-tqdm"]
    argv += ["--output-file", str(tmp_path / "out.jsonl"), "--output-details", *extra]
    return add_bench_args(argparse.ArgumentParser()).parse_args(argv)


def _run(args: argparse.Namespace, seen_paths: list[str | None] | None = None) -> dict[str, Any]:
    def loader(path: str | None) -> TinyTokenizer:
        if seen_paths is not None:
            seen_paths.append(path)
        return TinyTokenizer()

    return run_benchmark(args, tokenizer_loader=loader)


def test_native_backend_end_to_end(server: FakeServer, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    plot = tmp_path / "bench.png"
    paths: list[str | None] = []
    result = _run(_args(server, tmp_path, "--flush-cache", "--plot", str(plot)), paths)

    assert paths == ["tok"]
    assert SGLANG_KEYS | DETAIL_KEYS <= set(result)
    assert result["completed"] == 4 and result["total_output_tokens"] == 40
    assert result["total_input_tokens"] == 4 * 15  # 16 minus one BOS the server adds
    assert result["output_lens"] == [10] * 4 and result["total_output_tokens_retokenized"] == 40
    # Chunks of 1, (repeat), 3, 3, 3 tokens: one ITL entry per token after the first, split evenly.
    for itl in result["itls"]:
        assert len(itl) == 9
        assert itl[0] == itl[1] == itl[2] and itl[3] == itl[4] == itl[5]
    assert result["accept_length"] == ACCEPT_LENGTH
    assert result["server_info"]["version"] == "x"
    assert result["mean_tpot_ms"] > 0 and result["mean_itl_ms"] > 0 and result["mean_ttft_ms"] > 0
    assert result["output_throughput"] == pytest.approx(40 / result["duration"])
    assert result["request_throughput"] == pytest.approx(4 / result["duration"])
    assert 1 <= result["max_output_tokens_per_s"] <= 40 and 1 <= result["max_concurrent_requests"] <= 4
    if result["duration"] < 0.9:  # every token and request falls in the first 1 s bin
        assert result["max_output_tokens_per_s"] == 40 and result["max_concurrent_requests"] == 4
    assert server.flushes == 1

    warmup, *timed = [body for path, body in server.payloads if path == "/generate"]
    assert len(timed) == 4 and warmup["text"] == timed[0]["text"]
    assert timed[0]["sampling_params"] == {"temperature": 0.0, "max_new_tokens": 10, "ignore_eos": True}
    assert timed[0]["stream"] is True and timed[0]["lora_path"] is None
    assert timed[0]["logprob_start_len"] == -1 and timed[0]["return_routed_experts"] is False

    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert len(lines) == 1 and set(json.loads(lines[0])) == SGLANG_KEYS | DETAIL_KEYS
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    for label in (
        "Successful requests:",
        "Benchmark duration (s):",
        "Mean TPOT (ms):",
        "P99 ITL (ms):",
        "Peak output token throughput (tok/s):",
        "Accept length:",
        "Mean E2E Latency (ms):",
    ):
        assert label in printed


@pytest.mark.parametrize("backend", ["sglang-oai", "sglang-oai-chat", "vllm", "vllm-chat"])
def test_openai_backends(server: FakeServer, tmp_path: Path, backend: str) -> None:
    result = _run(_args(server, tmp_path, "--backend", backend, "--max-concurrency", "2"))

    assert result["completed"] == 4 and result["errors"] == [""] * 4
    assert result["output_lens"] == [10] * 4  # no usage chunk: the requested length
    assert all(len(itl) == 3 for itl in result["itls"])  # one entry per chunk after the first
    assert all(text == _words(0, 10) for text in result["generated_texts"])
    assert result["total_output_tokens_retokenized"] == 40
    assert result["accept_length"] == (ACCEPT_LENGTH if backend.startswith("sglang") else None)
    assert result["server_info"] is not None
    path, payload = server.payloads[-1]
    assert payload["model"] == "fake-model" and payload["stream"] is True and payload["ignore_eos"] is True
    if "chat" in backend:
        assert path == "/v1/chat/completions" and payload["max_completion_tokens"] == 10
        assert payload["messages"][0]["role"] == "user"
    else:
        assert path == "/v1/completions" and payload["max_tokens"] == 10 and payload["best_of"] == 1


@pytest.mark.parametrize("backend", ["sglang", "vllm", "vllm-chat"])
def test_usage_and_eos(server: FakeServer, tmp_path: Path, backend: str) -> None:
    extra = json.dumps({"stream_options": {"include_usage": True}})
    args = _args(server, tmp_path, "--backend", backend, "--disable-ignore-eos", "--extra-request-body", extra)
    result = _run(args)
    assert result["output_lens"] == [EOS_AT] * 4  # native meta_info, or the OpenAI usage chunk
    assert server.payloads[-1][1]["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize("backend", ["sglang", "vllm-chat"])
def test_disable_stream_ttft_is_latency(server: FakeServer, tmp_path: Path, backend: str) -> None:
    result = _run(_args(server, tmp_path, "--backend", backend, "--disable-stream"))
    assert result["completed"] == 4 and result["output_lens"] == [10] * 4
    assert result["mean_ttft_ms"] == result["mean_e2e_latency_ms"] > 0
    assert result["itls"] == [[]] * 4 and result["mean_itl_ms"] == 0.0
    assert server.payloads[-1][1]["stream"] is False


def test_gsm8k_end_to_end(server: FakeServer, tmp_path: Path) -> None:
    if not GSM8K_TEST.exists():
        pytest.skip("no GSM8K test set")
    args = _args(server, tmp_path, "--backend", "sglang-oai-chat", "--dataset-name", "gsm8k")
    args.dataset_path = str(GSM8K_TEST)
    result = _run(args)
    assert result["completed"] == 4 and result["dataset_name"] == "gsm8k"
    content = server.payloads[-1][1]["messages"][0]["content"]
    assert content.startswith("Janet") or "?" in content


def test_warmup_failure_aborts(server: FakeServer, tmp_path: Path) -> None:
    server.fail = True
    with pytest.raises(BenchError, match="warmup failed"):
        _run(_args(server, tmp_path))
    assert not (tmp_path / "out.jsonl").exists()


def test_main_reports_bad_arguments(capsys: pytest.CaptureFixture) -> None:
    assert serving.main(["--dataset-name", "gsm8k", "--num-prompts", "1"]) == 1
    assert "dataset-path" in capsys.readouterr().err
    namespace = add_bench_args(argparse.ArgumentParser()).parse_args(["--dataset-name", "gsm8k"])
    assert serving.main(namespace) == 1
    assert serving.main(["--extra-request-body", "[1]"]) == 1


def _outputs_by_hand() -> tuple[list[DatasetRow], list[RequestOutput]]:
    rows = [DatasetRow("a", 10, 4), DatasetRow("b", 20, 2), DatasetRow("c", 30, 8)]
    a = RequestOutput("w5 w6 w7 w8", True, latency=0.3, ttft=0.1, itl=[0.05, 0.05, 0.1], output_len=4)
    a.start_time = 100.0
    b = RequestOutput("w5 w6 w7", True, latency=1.5, ttft=0.2, itl=[1.0], output_len=2)
    b.start_time = 100.2
    c = RequestOutput(success=False, error="boom", output_len=8, latency=9.0)
    return rows, [a, b, c]


def test_calculate_metrics_exact() -> None:
    rows, outputs = _outputs_by_hand()
    m, output_lens = calculate_metrics(rows, outputs, 2.0, TinyTokenizer(), "sglang")

    assert output_lens == [4, 2, 0]
    assert (m.completed, m.total_input, m.total_output, m.total_output_retokenized) == (2, 30, 6, 7)
    assert (m.request_throughput, m.input_throughput, m.output_throughput) == (1.0, 15.0, 3.0)
    assert m.total_throughput == 18.0 and m.output_throughput_retokenized == 3.5
    tpots = [(0.3 - 0.1) / 3, (1.5 - 0.2) / 1]
    assert m.mean_tpot_ms == pytest.approx(np.mean(tpots) * 1000, rel=1e-12)
    assert m.p99_tpot_ms == pytest.approx(np.percentile(tpots, 99) * 1000, rel=1e-12)
    assert m.mean_ttft_ms == pytest.approx(150.0) and m.median_ttft_ms == pytest.approx(150.0)
    assert m.std_ttft_ms == pytest.approx(50.0)
    itls = [0.05, 0.05, 0.1, 1.0]
    assert m.mean_itl_ms == pytest.approx(np.mean(itls) * 1000) and m.max_itl_ms == pytest.approx(1000.0)
    assert m.median_itl_ms == pytest.approx(75.0)
    assert m.mean_e2e_latency_ms == pytest.approx(900.0) and m.p90_e2e_latency_ms == pytest.approx(1380.0)
    assert m.concurrency == pytest.approx(1.8 / 2.0)
    # Bins from t=100.0: a's tokens at .1 .15 .2 .3 and b's first at .4 fall in bin 0, b's second at 1.4.
    assert m.max_output_tokens_per_s == 5.0
    assert m.max_concurrent_requests == 2  # b spans bins 0 and 1, a only bin 0


def test_calculate_metrics_retokenized_itl() -> None:
    rows = [DatasetRow("a", 3, 4)]
    out = RequestOutput("w5 w6 w7 w8", True, latency=0.5, ttft=0.2, itl=[0.3], output_len=4)
    out.text_chunks = ["w6 w7 w8"]
    tok = TinyTokenizer()
    m, _ = calculate_metrics(rows, [out], 1.0, tok, "sglang-oai", accept_length=2.0)
    assert m.mean_itl_ms == pytest.approx(100.0) and m.max_itl_ms == pytest.approx(100.0)
    for backend, accept in (("vllm", 2.0), ("sglang-oai", None), ("sglang-oai-chat", 0.0)):
        m, _ = calculate_metrics(rows, [out], 1.0, tok, backend, accept_length=accept)
        assert m.mean_itl_ms == pytest.approx(300.0)


def test_calculate_metrics_all_failed() -> None:
    rows, outputs = _outputs_by_hand()
    with pytest.warns(UserWarning, match="All requests failed"):
        m, output_lens = calculate_metrics(rows[2:], outputs[2:], 1.0, TinyTokenizer(), "sglang")
    assert m.completed == 0 and output_lens == [0] and m.max_output_tokens_per_s == 0.0


def test_accept_length_from_server_info() -> None:
    assert accept_length_from({"internal_states": [{"avg_spec_accept_length": 3.25}]}) == 3.25
    assert accept_length_from({"decode": [{"internal_states": [{"avg_spec_accept_length": 1.5}]}]}) == 1.5
    assert accept_length_from({"internal_states": [{}]}) is None
    assert accept_length_from({"internal_states": []}) is None
    assert accept_length_from(None) is None


@pytest.mark.parametrize("ratio", [0.0, 0.5, 1.0])
def test_random_lengths_follow_range_ratio(ratio: float) -> None:
    np.random.seed(42)
    rows = sample_random_requests(40, 30, 300, ratio, TinyTokenizer())
    inputs, outputs = [r.prompt_len for r in rows], [r.output_len for r in rows]
    lo_in, lo_out = max(int(40 * ratio), 1), max(int(30 * ratio), 1)
    assert min(inputs) >= max(lo_in - 1, 1) and max(inputs) <= 39  # one BOS left for the server
    assert min(outputs) >= lo_out and max(outputs) <= 30
    if ratio == 1.0:
        assert set(inputs) == {39} and set(outputs) == {30}
    if ratio == 0.0:
        assert min(outputs) <= 5 and max(outputs) >= 25  # spans [1, L]
    for row in rows:
        ids = TinyTokenizer().encode(row.prompt)
        assert len(ids) == row.prompt_len and not set(ids) & {0, 1, 2}


def test_random_lengths_match_sglang_draws() -> None:
    np.random.seed(42)
    ours = (compute_random_lens(1024, 0.0, 8), compute_random_lens(1024, 0.0, 8))
    np.random.seed(42)
    expected = (np.random.randint(1, 1025, size=8).tolist(), np.random.randint(1, 1025, size=8).tolist())
    assert ours == expected


def test_random_ids_are_consecutive() -> None:
    tok = TinyTokenizer()
    np.random.seed(7)
    rows = sample_random_requests(20, 5, 10, 1.0, tok, random_sample=False, return_text=False)
    np.random.seed(7)
    np.random.randint(20, 21, size=10), np.random.randint(5, 6, size=10)  # the length draws
    offsets = np.random.randint(0, tok.vocab_size, size=10)
    for i, row in enumerate(rows):
        assert row.prompt_len == 20 and len(row.prompt) == 20  # token ids: no room left for BOS
        assert row.prompt == [int((offsets[i] + i + j) % tok.vocab_size) for j in range(20)]


def test_datasets_are_seeded(tmp_path: Path) -> None:
    args = add_bench_args(argparse.ArgumentParser()).parse_args(["--num-prompts", "5", "--seed", "3"])
    built = []
    for _ in range(2):
        np.random.seed(args.seed)
        built.append(build_dataset(args, TinyTokenizer()))
    assert built[0] == built[1]


def test_gsm8k_dataset() -> None:
    if not GSM8K_TEST.exists():
        pytest.skip("no GSM8K test set")
    argv = ["--dataset-name", "gsm8k", "--dataset-path", str(GSM8K_TEST), "--num-prompts", "3"]
    args = add_bench_args(argparse.ArgumentParser()).parse_args([*argv, "--random-output-len", "64"])
    tok = TinyTokenizer()
    rows = build_dataset(args, tok)
    first = json.loads(GSM8K_TEST.read_text().splitlines()[0])["question"]
    assert rows[0].prompt == f"Question: {first}\nAnswer:"
    assert all(r.output_len == 64 for r in rows)
    assert all(r.prompt_len == len(tok.encode(str(r.prompt))) + 1 for r in rows)
    args.apply_chat_template = True
    templated = build_dataset(args, tok)
    assert templated[0].prompt == f" w3 {first} w4"  # BOS text stripped: the server adds it


def test_headers_and_urls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    monkeypatch.setenv("API_KEY", "raw")
    assert request_headers(["X-A=1", "X-B = b=c"]) == {"Authorization": "raw", "X-A": "1", "X-B": "b=c"}
    monkeypatch.setenv("OPENAI_API_KEY", "sk")
    assert request_headers() == {"Authorization": "Bearer sk"}
    with pytest.raises(BenchError):
        request_headers(["novalue"])
    parse = add_bench_args(argparse.ArgumentParser()).parse_args
    assert serving.resolve_base_url(parse([])) == "http://127.0.0.1:30000"
    assert serving.resolve_base_url(parse(["--backend", "vllm-chat"])) == "http://127.0.0.1:8000"
    assert serving.resolve_base_url(parse(["--base-url", "http://h:1/"])) == "http://h:1"
    assert re.fullmatch(r"sglang_\d{4}_1000_1024_1024\.jsonl", default_output_file(parse([])))


def test_default_tokenizer_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[Any, ...]] = []
    module = types.ModuleType("baton.tokenizer")
    module.load_tokenizer = lambda *a: calls.append(a) or TinyTokenizer()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "baton.tokenizer", module)
    assert isinstance(serving.load_bench_tokenizer("embedded"), TinyTokenizer)
    assert isinstance(serving.load_bench_tokenizer("/models/x"), TinyTokenizer)
    assert calls == [(), ("/models/x",)]


def test_ready_check_times_out(tmp_path: Path) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    argv = ["--port", str(port), "--ready-check-timeout-sec", "1", "--output-file", str(tmp_path / "o.jsonl")]
    with pytest.raises(BenchError, match="not ready"):
        _run(add_bench_args(argparse.ArgumentParser()).parse_args(argv))


def test_token_ids_tokenizer_for_a_server_without_tokenizer_files(ling_path: str) -> None:
    """A dummy-weight model served without tokenizer files reports ``token-ids`` and its vocabulary in
    /model_info; the bench then counts tokens with baton's IdTokenizer (the TP2 serve + bench runs need it)."""
    from baton.config import ServerArgs
    from baton.engine.engine import Engine
    from baton.tokenizer import IdTokenizer

    info = Engine(ServerArgs(model_path=ling_path, device="cpu", disable_cuda_graph=True)).model_info()
    assert info["tokenizer_path"] == "token-ids" and info["vocab_size"] > 0
    tok = serving.load_bench_tokenizer(f"token-ids:{info['vocab_size']}")
    assert isinstance(tok, IdTokenizer) and tok.encode(tok.decode([5, 17])) == [5, 17]
    with pytest.raises(BenchError, match="token-ids:VOCAB_SIZE"):
        serving.load_bench_tokenizer("token-ids")
