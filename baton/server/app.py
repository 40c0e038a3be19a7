"""The HTTP server: FastAPI routes for SGLang's native API and the OpenAI API, SSE streaming, auth, limits.

Owns ``create_app(engine, server_args)`` and ``run_server(server_args, engine_factory)``. Routes parse and
validate on the event loop, hand a ``Request`` to the single engine thread (``worker.py``) and stream its
``StepOutput``s back. The server talks to the engine only through the contract in
``docs/engine-api.md``; it never imports models or ops.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import asynccontextmanager
from dataclasses import asdict
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from baton import __version__
from baton.config import ServerArgs
from baton.engine.api import EngineAPI
from baton.server.protocol import (
    Accumulated,
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerateRequest,
    NativeSamplingParams,
    NativeStreamEncoder,
    chat_chunk,
    chat_response,
    completion_chunk,
    completion_response,
    error_body,
    model_not_found,
    usage_chunk,
    validation_message,
)
from baton.server.worker import EngineError, EngineWorker, Job
from baton.types import Request as EngineRequest
from baton.types import SamplingParams, StepOutput

logger = logging.getLogger(__name__)

T = TypeVar("T", bound=BaseModel)

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
_DONE = "data: [DONE]\n\n"
_INLINE_ENCODE_CHARS = 16384  # longer prompts are tokenized off the event loop


class ServerState:
    """What the routes share: the engine, its worker thread and the names the API reports."""

    def __init__(self, engine: EngineAPI, server_args: ServerArgs) -> None:
        self.engine = engine
        self.args = server_args
        self.worker = EngineWorker(engine)
        self.tokenizer = engine.tokenizer
        self.context_length: int = engine.context_length
        self.model_path = server_args.model_path or engine.model_path or "embedded"
        self.model_name: str = engine.served_model_name or server_args.served_model_name or self.model_path
        self.accepted_model_names = {self.model_name, "default", self.model_path}
        self.vocab_size: int | None = engine.vocab_size


def _state(request: Request) -> ServerState:
    return request.app.state.baton


def _json(obj: Any, status: int = 200) -> Response:
    body = json.dumps(obj, ensure_ascii=False, default=str)
    return Response(content=body, status_code=status, media_type="application/json")


def _error(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> Response:
    return _json(error_body(message, status, param, code), status)


# ---- request parsing and validation ----
async def _parse(request: Request, model: type[T]) -> T:
    body = await request.body()
    if not body.strip():
        raise ApiError("request body is empty; send a JSON object")
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        message, param = validation_message(e)
        raise ApiError(message, param=param) from e


async def _encode(st: ServerState, text: str, param: str, add_special_tokens: bool) -> list[int]:
    """Raw prompts get the tokenizer's special tokens (BOS), as SGLang does; chat-template text has them."""
    if not text:
        raise ApiError("the prompt is empty", param=param)
    if len(text) > _INLINE_ENCODE_CHARS:
        return list(await asyncio.to_thread(st.tokenizer.encode, text, add_special_tokens))
    return list(st.tokenizer.encode(text, add_special_tokens=add_special_tokens))


def _check_ids(st: ServerState, ids: list[int], param: str) -> list[int]:
    if not ids:
        raise ApiError("the prompt is empty", param=param)
    bad = [t for t in ids if t < 0 or (st.vocab_size is not None and t >= st.vocab_size)]
    if bad:
        raise ApiError(f"token id {bad[0]} is outside the vocabulary (size {st.vocab_size})", param=param)
    return ids


async def _prompt_ids(st: ServerState, prompt: str | list[int], param: str) -> list[int]:
    ids = await _encode(st, prompt, param, True) if isinstance(prompt, str) else prompt
    return _check_ids(st, ids, param)


def _max_new_tokens(st: ServerState, value: int | None, param: str, prompt_len: int) -> int:
    if value is None:
        return max(st.context_length - prompt_len, 0)
    if value < 0:
        raise ApiError(f"{param} must be >= 0, got {value}", param=param)
    if value > st.context_length:
        raise ApiError(f"{param}={value} exceeds the context length {st.context_length}", param=param)
    return value


def _check_model(st: ServerState, model: str | None) -> None:
    if model is not None and model not in st.accepted_model_names:
        raise model_not_found(model, st.model_name)


def _engine_request(
    st: ServerState, ids: list[int], sampling: SamplingParams, rid: str | None, arrival: float
) -> EngineRequest:
    req = EngineRequest(input_ids=ids, sampling=sampling, rid=rid or uuid.uuid4().hex, arrival_time=arrival)
    try:
        st.engine.validate_request(req)
    except ValueError as e:
        raise ApiError(str(e), param="prompt") from e
    return req


# ---- running requests ----
async def _abort_on_disconnect(request: Request, jobs: Iterable[Job]) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for job in jobs:
        job.abort()


async def _run_to_end(request: Request, st: ServerState, reqs: list[EngineRequest]) -> list[Accumulated]:
    """Run requests to completion (non-streaming); a client that leaves aborts them."""
    jobs = [st.worker.submit(r) for r in reqs]
    watcher = asyncio.create_task(_abort_on_disconnect(request, jobs))
    try:
        results = []
        for job in jobs:
            acc = Accumulated(job.req.rid, len(job.req.input_ids), job.req.arrival_time)
            while True:
                out = await job.get()
                acc.add(out)
                if out.finished:
                    break
            results.append(acc)
        return results
    except EngineError as e:
        raise ApiError(e.message, e.status) from e
    finally:
        watcher.cancel()
        for job in jobs:
            job.abort()  # no-op for finished jobs; frees the others when this handler fails


class _StreamFormat:
    """Turns a request's StepOutputs into SSE payloads (JSON strings) for one API flavour."""

    def start(self, acc: Accumulated) -> list[str]:
        return []

    def step(self, out: StepOutput, acc: Accumulated) -> list[str]:
        raise NotImplementedError

    def end(self, acc: Accumulated) -> list[str]:
        return []


class _NativeFormat(_StreamFormat):
    def __init__(self) -> None:
        self.encoder = NativeStreamEncoder()

    def step(self, out: StepOutput, acc: Accumulated) -> list[str]:
        return [self.encoder.chunk(out, acc)] if out.token_ids or out.finished else []


class _CompletionFormat(_StreamFormat):
    def __init__(self, model: str, include_usage: bool, continuous_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.continuous_usage = continuous_usage

    def step(self, out: StepOutput, acc: Accumulated) -> list[str]:
        if not (out.text or out.finished):
            return []
        chunk = completion_chunk(acc, self.model, out.text, out.finished)
        if self.continuous_usage:
            chunk["usage"] = acc.usage()
        return [json.dumps(chunk, ensure_ascii=False)]

    def end(self, acc: Accumulated) -> list[str]:
        if not self.include_usage:
            return []
        return [json.dumps(usage_chunk(acc, self.model, "text_completion"), ensure_ascii=False)]


class _ChatFormat(_CompletionFormat):
    def start(self, acc: Accumulated) -> list[str]:
        return [self._dump(chat_chunk(acc, self.model, {"role": "assistant", "content": ""}, False), acc)]

    def step(self, out: StepOutput, acc: Accumulated) -> list[str]:
        payloads = []
        if out.text:
            payloads.append(self._dump(chat_chunk(acc, self.model, {"content": out.text}, False), acc))
        if out.finished:
            payloads.append(self._dump(chat_chunk(acc, self.model, {}, True), acc))
        return payloads

    def end(self, acc: Accumulated) -> list[str]:
        if not self.include_usage:
            return []
        return [json.dumps(usage_chunk(acc, self.model, "chat.completion.chunk"), ensure_ascii=False)]

    def _dump(self, chunk: dict[str, Any], acc: Accumulated) -> str:
        if self.continuous_usage:
            chunk["usage"] = acc.usage()
        return json.dumps(chunk, ensure_ascii=False)


def _sse(payloads: list[str], done: bool = False) -> bytes:
    text = "".join(f"data: {p}\n\n" for p in payloads)
    return (text + _DONE if done else text).encode()


async def _events(job: Job, first: StepOutput, acc: Accumulated, fmt: _StreamFormat) -> AsyncIterator[bytes]:
    """The SSE body; closing or cancelling it (client gone) aborts the request."""
    try:
        payloads = fmt.start(acc)
        out = first
        while True:
            acc.add(out)
            payloads += fmt.step(out, acc)
            if out.finished:
                yield _sse(payloads + fmt.end(acc), done=True)
                return
            if payloads:
                yield _sse(payloads)
                payloads = []
            out = await job.get()
    except EngineError as e:
        yield _sse([json.dumps(error_body(e.message, e.status))], done=True)
    finally:
        job.abort()


async def _stream(request: Request, st: ServerState, req: EngineRequest, fmt: _StreamFormat) -> Response:
    """Start a streaming response once the first output is in, so an engine error before any token is
    still an HTTP error status."""
    job = st.worker.submit(req)
    watcher = asyncio.create_task(_abort_on_disconnect(request, [job]))
    try:
        first = await job.get()
    except EngineError as e:
        raise ApiError(e.message, e.status) from e
    except BaseException:
        job.abort()
        raise
    finally:
        watcher.cancel()
    acc = Accumulated(req.rid, len(req.input_ids), req.arrival_time)
    return StreamingResponse(
        _events(job, first, acc, fmt), media_type="text/event-stream", headers=_SSE_HEADERS
    )


# ---- native API ----
def _as_batch(value: Any, size: int, name: str) -> list[Any]:
    if not isinstance(value, list):
        return [value] * size
    if len(value) != size:
        raise ApiError(f"{name} has {len(value)} entries for a batch of {size} prompts", param=name)
    return value


async def _native_prompts(st: ServerState, body: GenerateRequest) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the request is a batch (list input)."""
    if (body.text is None) == (body.input_ids is None):
        raise ApiError("give exactly one of text or input_ids", param="text")
    if body.text is not None:
        texts = body.text if isinstance(body.text, list) else [body.text]
        if not texts:
            raise ApiError("the prompt is empty", param="text")
        return [await _prompt_ids(st, t, "text") for t in texts], isinstance(body.text, list)
    ids = body.input_ids
    is_batch = bool(ids) and isinstance(ids[0], list)
    batch = ids if is_batch else [ids]
    return [_check_ids(st, list(p), "input_ids") for p in batch], is_batch


async def generate(request: Request) -> Response:
    arrival = time.perf_counter()
    st = _state(request)
    body = await _parse(request, GenerateRequest)
    body.check_supported()
    prompts, is_batch = await _native_prompts(st, body)
    params = _as_batch(body.sampling_params or NativeSamplingParams(), len(prompts), "sampling_params")
    rids = _as_batch(body.rid, len(prompts), "rid")
    if is_batch and body.stream:
        raise ApiError("streaming is supported for a single prompt only", param="stream")
    reqs = []
    for ids, p, rid in zip(prompts, params, rids, strict=True):
        max_new = _max_new_tokens(st, p.max_new_tokens, "max_new_tokens", len(ids))
        reqs.append(_engine_request(st, ids, p.to_sampling(max_new), rid, arrival))
    if body.stream:
        return await _stream(request, st, reqs[0], _NativeFormat())
    results = [acc.native_response() for acc in await _run_to_end(request, st, reqs)]
    return _json(results if is_batch else results[0])


# ---- OpenAI API ----
async def _chat_prompt_ids(st: ServerState, body: ChatCompletionRequest) -> list[int]:
    if not body.messages:
        raise ApiError("messages is empty", param="messages")
    conversation = [m.to_template() for m in body.messages]
    try:
        text = st.tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, **(body.chat_template_kwargs or {})
        )
    except Exception as e:  # no template, or one that rejects the conversation (roles, missing fields)
        raise ApiError(f"cannot apply the chat template: {e}", param="messages") from e
    ids = await _encode(st, text, "messages", False) if isinstance(text, str) else list(text)
    return _check_ids(st, ids, "messages")


async def completions(request: Request) -> Response:
    arrival = time.perf_counter()
    st = _state(request)
    body = await _parse(request, CompletionRequest)
    _check_model(st, body.model)
    body.check_supported()
    ids = await _prompt_ids(st, body.single_prompt(), "prompt")
    max_new = _max_new_tokens(st, body.max_tokens, "max_tokens", len(ids))
    req = _engine_request(st, ids, body.to_sampling(max_new), body.rid, arrival)
    if body.stream:
        fmt = _CompletionFormat(st.model_name, body.include_usage, body.continuous_usage)
        return await _stream(request, st, req, fmt)
    acc = (await _run_to_end(request, st, [req]))[0]
    return _json(completion_response(acc, st.model_name))


async def chat_completions(request: Request) -> Response:
    arrival = time.perf_counter()
    st = _state(request)
    body = await _parse(request, ChatCompletionRequest)
    _check_model(st, body.model)
    body.check_supported()
    ids = await _chat_prompt_ids(st, body)
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_new = _max_new_tokens(st, body.requested_max_tokens, param, len(ids))
    req = _engine_request(st, ids, body.to_sampling(max_new), body.rid, arrival)
    if body.stream:
        return await _stream(
            request, st, req, _ChatFormat(st.model_name, body.include_usage, body.continuous_usage)
        )
    acc = (await _run_to_end(request, st, [req]))[0]
    return _json(chat_response(acc, st.model_name))


def _model_card(st: ServerState) -> dict[str, Any]:
    return {
        "id": st.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "baton",
        "root": st.model_path,
        "max_model_len": st.context_length,
    }


async def list_models(request: Request) -> Response:
    return _json({"object": "list", "data": [_model_card(_state(request))]})


async def retrieve_model(request: Request) -> Response:
    st = _state(request)
    model = request.path_params["model"]
    if model not in st.accepted_model_names:
        raise model_not_found(model, st.model_name)
    return _json(_model_card(st))


# ---- info, control and metrics ----
async def health(request: Request) -> Response:
    if not _state(request).worker.is_alive:
        return PlainTextResponse("engine thread is not running", status_code=503)
    return PlainTextResponse("ok")


async def model_info(request: Request) -> Response:
    st = _state(request)
    info: dict[str, Any] = {
        "model_path": st.model_path,
        "tokenizer_path": st.args.tokenizer_path or st.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": None,
        "architectures": None,
    }
    info.update(st.engine.model_info())
    return _json(info)


def _flat_server_args(args: ServerArgs) -> dict[str, Any]:
    """ServerArgs as SGLang lays them out: spec fields as ``speculative_*``; the API key is never shown."""
    flat = asdict(args)
    spec = flat.pop("spec")
    flat.update({f"speculative_{k}": v for k, v in spec.items()})
    return flat


def _internal_state(engine: EngineAPI) -> dict[str, Any]:
    stats = engine.spec_stats
    hist = stats.accept_histogram
    state: dict[str, Any] = {
        "spec_num_verify_steps": stats.num_verify_steps,
        "spec_accept_histogram": [hist.get(k, 0) for k in range(max(hist, default=-1) + 1)],
    }
    if stats.avg_accept_length is not None:
        state["avg_spec_accept_length"] = stats.avg_accept_length
    return state


async def server_info(request: Request) -> Response:
    st = _state(request)
    info = _flat_server_args(st.args)
    info.update(st.engine.server_info())
    info.pop("api_key", None)
    info["internal_states"] = [_internal_state(st.engine)]
    info["version"] = __version__
    return _json(info)


async def flush_cache(request: Request) -> Response:
    st = _state(request)
    raw_timeout = request.query_params.get("timeout")
    try:
        timeout = float(raw_timeout) if raw_timeout else None
    except ValueError:
        return _error(f"timeout must be a number of seconds, got {raw_timeout!r}", param="timeout")
    try:
        await asyncio.wait_for(st.worker.call(st.engine.flush_cache), timeout)
    except asyncio.TimeoutError:
        return PlainTextResponse("Cache not flushed: requests were still running.\n", status_code=400)
    return PlainTextResponse("Cache flushed.\n")


async def metrics(request: Request) -> Response:
    st = _state(request)
    stats = st.engine.spec_stats
    extra = [
        ("num_queue_reqs", "gauge", "Requests waiting for the engine", st.worker.num_waiting),
        ("num_running_reqs", "gauge", "Requests the engine is running (0 or 1)", st.worker.num_running),
        (
            "spec_accept_length",
            "gauge",
            "Mean accepted tokens (drafts + 1) per verify step since start or the last flush_cache",
            stats.avg_accept_length,
        ),
        (
            "spec_verify_calls_total",
            "counter",
            "Verify steps since start or the last flush_cache",
            stats.num_verify_steps,
        ),
    ]
    info = st.engine.prefix_cache_info()  # zeros with the cache off (--disable-radix-cache), as SGLang reports
    if info:
        extra += [
            ("cache_hit_rate", "gauge", "Prefix cache: cached / prompt tokens since start or the last flush_cache",
             info.get("prefix_cache_hit_rate", 0.0)),
            ("cached_tokens_total", "counter", "Prompt tokens restored from the prefix cache",
             info.get("prefix_cache_cached_tokens", 0)),
            ("prefix_cache_tokens", "gauge", "Tokens whose attention rows the prefix cache holds",
             info.get("prefix_cache_tokens", 0)),
            ("prefix_cache_snapshots", "gauge", "Recurrent-state snapshots the prefix cache holds",
             info.get("prefix_cache_snapshots", 0)),
            ("prefix_cache_bytes", "gauge", "Bytes the prefix cache holds", info.get("prefix_cache_bytes", 0)),
        ]
    text = st.worker.metrics.render(extra)
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4; charset=utf-8")


async def start_profile(request: Request) -> Response:
    return PlainTextResponse(
        "baton: /start_profile is a no-op; profile the engine with nsys or torch.profiler.\n"
    )


async def stop_profile(request: Request) -> Response:
    return PlainTextResponse("baton: /stop_profile is a no-op.\n")


class _AbortRequest(BaseModel):
    rid: str | None = None
    abort_all: bool = False


async def abort_request(request: Request) -> Response:
    body = await _parse(request, _AbortRequest)
    if body.rid is None and not body.abort_all:
        raise ApiError("give rid or abort_all", param="rid")
    count = _state(request).worker.abort(None if body.abort_all else body.rid)
    return _json({"aborted": count})


_ROUTES: list[tuple[str, Callable[[Request], Awaitable[Response]], list[str]]] = [
    ("/health", health, ["GET"]),
    ("/health_generate", health, ["GET"]),
    ("/v1/models", list_models, ["GET"]),
    ("/v1/models/{model:path}", retrieve_model, ["GET"]),
    ("/model_info", model_info, ["GET"]),
    ("/get_model_info", model_info, ["GET"]),
    ("/server_info", server_info, ["GET"]),
    ("/get_server_info", server_info, ["GET"]),
    ("/generate", generate, ["POST", "PUT"]),
    ("/v1/completions", completions, ["POST"]),
    ("/v1/chat/completions", chat_completions, ["POST"]),
    ("/flush_cache", flush_cache, ["GET", "POST"]),
    ("/reset_prefix_cache", flush_cache, ["GET", "POST"]),  # vLLM's name for the same
    ("/metrics", metrics, ["GET"]),
    ("/start_profile", start_profile, ["GET", "POST"]),
    ("/stop_profile", stop_profile, ["GET", "POST"]),
    ("/abort_request", abort_request, ["POST"]),
]


# ---- errors, auth and limits ----
def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return _error(exc.message, exc.status, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> Response:
        return _error("invalid request: " + "; ".join(str(e.get("msg")) for e in exc.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return _error(str(exc.detail), exc.status_code)

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return _error(f"internal server error: {type(exc).__name__}", 500)


async def _send_error(send: Send, status: int, message: str, close: bool = False) -> None:
    body = json.dumps(error_body(message, status)).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class GuardMiddleware:
    """Pure ASGI middleware (no per-chunk overhead on streams): the API key check, and the request body read
    here, whole, before any route runs: at most ``max_request_bytes`` (413) within ``read_timeout`` seconds
    (408, and the connection is closed). A client that leaves mid-body costs one log line."""

    def __init__(self, app: ASGIApp, api_key: str | None, max_request_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.expected_auth = f"Bearer {api_key}".encode() if api_key else None
        self.max_request_bytes = max_request_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        if self.expected_auth and not scope["path"].startswith("/health"):
            if not hmac.compare_digest(headers.get(b"authorization", b""), self.expected_auth):
                await _send_error(send, 401, "missing or invalid API key: send 'Authorization: Bearer <key>'")
                return
        length = headers.get(b"content-length")
        if length is not None:
            if not length.isdigit():
                await _send_error(send, 400, "invalid Content-Length header")
                return
            if int(length) > self.max_request_bytes:
                await _send_error(send, 413, self._too_large(), close=True)
                return
        if (length is not None and int(length) > 0) or b"chunked" in headers.get(b"transfer-encoding", b""):
            body = await self._read_body(scope, receive, send)
            if body is None:
                return
            receive = _replay([{"type": "http.request", "body": body, "more_body": False}], receive)
        await self.app(scope, receive, send)

    def _too_large(self) -> str:
        return f"request body exceeds the limit of {self.max_request_bytes} bytes (--max-request-bytes)"

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
        """The whole body, or None when this has already answered (413, 408) or the client has gone."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        chunks, size = [], 0
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                logger.info("%s: the request body did not arrive within %.0f s (--read-timeout); closing",
                            _client(scope), self.read_timeout)
                await _send_error(send, 408, f"the request body did not arrive within {self.read_timeout:g} s",
                                  close=True)
                return None
            if message["type"] == "http.disconnect":
                logger.info("%s: the client disconnected while sending the request body", _client(scope))
                return None
            size += len(message.get("body", b""))
            if size > self.max_request_bytes:
                await _send_error(send, 413, self._too_large(), close=True)
                return None
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                return b"".join(chunks)


def _client(scope: Scope) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "a client"


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


def create_app(engine: EngineAPI, server_args: ServerArgs) -> FastAPI:
    """The FastAPI app serving ``engine``; its lifespan starts and stops the engine thread."""
    state = ServerState(engine, server_args)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.worker.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.worker.stop)

    app = FastAPI(
        title="baton", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None
    )
    app.state.baton = state
    for path, endpoint, methods in _ROUTES:
        app.add_api_route(path, endpoint, methods=methods)
    _add_error_handlers(app)
    app.add_middleware(
        GuardMiddleware, api_key=server_args.api_key, max_request_bytes=server_args.max_request_bytes,
        read_timeout=server_args.read_timeout,
    )
    return app


# ---- running ----
def _spec_summary(args: ServerArgs) -> str:
    spec = args.spec
    if not spec.enabled:
        return "spec off"
    return f"spec {spec.algorithm} steps={spec.num_steps} draft_tokens={spec.num_draft_tokens}"


def timed_http_protocol(read_timeout: float) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol (the one it would pick) with a deadline on a request's head: a connection that
    sends nothing, or trickles its headers, is closed ``read_timeout`` seconds after it opened or after its
    first byte following a response (between requests, uvicorn's keep-alive timeout closes an idle one).
    The body has its own deadline in GuardMiddleware."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class TimedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: Any) -> None:
            super().connection_made(transport)
            self._arm_head_timer()

        def data_received(self, data: bytes) -> None:
            if self._head_timer is None and not self._in_request():
                self._arm_head_timer()  # the first byte of the next request on a kept-alive connection
            super().data_received(data)
            if self._in_request():
                self._cancel_head_timer()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_head_timer()
            super().connection_lost(exc)

        def _in_request(self) -> bool:
            cycle = getattr(self, "cycle", None)
            return cycle is not None and not cycle.response_complete

        def _arm_head_timer(self) -> None:
            self._cancel_head_timer()
            self._head_timer = self.loop.call_later(read_timeout, self._head_timeout)

        def _cancel_head_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _head_timeout(self) -> None:
            self._head_timer = None
            if not self._in_request() and not self.transport.is_closing():
                client = getattr(self, "client", None)
                logger.info("%s: no complete request head within %g s (--read-timeout); closing",
                            f"{client[0]}:{client[1]}" if client else "a client", read_timeout)
                self.transport.close()

    return TimedHTTPProtocol


class BatonServer(uvicorn.Server):
    """uvicorn.Server with the shutdown operators expect, and one ready line once its sockets listen.

    The first SIGTERM / SIGINT stops accepting (uvicorn closes the listening sockets and idle connections) and
    gives running requests ``shutdown_timeout`` seconds; then every request left is aborted: queued ones get a
    503, a running stream a final error chunk and ``[DONE]``. A second signal aborts at once, a third stops
    waiting for connections. Nothing is re-raised: ``run`` returns and the caller shuts the engine down.
    """

    def __init__(self, config: uvicorn.Config, state: ServerState, shutdown_timeout: float, spec: str) -> None:
        super().__init__(config)
        self.state = state
        self.shutdown_timeout = shutdown_timeout
        self.spec = spec
        self.num_signals = 0
        self.abort_now = False

    async def startup(self, sockets: Any = None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            port = self.servers[0].sockets[0].getsockname()[1] if self.servers else self.config.port
            print(
                f"baton ready: http://{self.config.host}:{port} (model {self.state.model_name}, {self.spec})",
                flush=True,
            )

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.num_signals += 1
        if self.num_signals == 1:
            self.should_exit = True
        elif self.num_signals == 2:
            self.abort_now = True
        else:
            self.force_exit = True

    async def shutdown(self, sockets: Any = None) -> None:
        worker = self.state.worker
        worker.begin_shutdown("server is shutting down")
        if worker.busy:
            logger.info("shutting down: running requests get %g s (--shutdown-timeout); a second signal aborts them "
                        "now", self.shutdown_timeout)
        drain = asyncio.create_task(self._drain())
        try:
            await super().shutdown(sockets=sockets)
        finally:
            drain.cancel()

    async def _drain(self) -> None:
        """Abort what is still queued or running once the grace period is over (or at a second signal)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.shutdown_timeout
        while self.state.worker.busy and not self.abort_now and loop.time() < deadline:
            await asyncio.sleep(0.02)
        why = "a second signal" if self.abort_now else f"the {self.shutdown_timeout:g} s grace period"
        count = self.state.worker.abort_all(f"server is shutting down: request aborted after {why}")
        if count:
            logger.warning("shutdown: aborted %d request(s) after %s", count, why)


# Past the grace period the aborted requests still need their engine step to end (one forward pass; a long
# prefill on a CPU takes seconds) before their handlers can answer; uvicorn cancels what is left after this.
_ABORT_MARGIN_S = 30.0


def run_server(server_args: ServerArgs, engine_factory: Callable[[ServerArgs], EngineAPI]) -> None:
    """Build the engine, then serve it with uvicorn on ``server_args.host:port`` until SIGTERM / SIGINT; shut
    down as BatonServer says (bounded by ``--shutdown-timeout``), stop the engine thread and return."""
    level = server_args.log_level.lower()
    logging.basicConfig(
        level=level.upper() if level != "trace" else "DEBUG",
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    engine = engine_factory(server_args)
    if not server_args.skip_server_warmup:
        t0 = time.perf_counter()
        engine.warm_up()
        logger.info("warm-up requests done in %.1f s (--skip-server-warmup skips them)", time.perf_counter() - t0)
    app = create_app(engine, server_args)
    config = uvicorn.Config(
        app,
        host=server_args.host,
        port=server_args.port,
        log_level=level,
        access_log=level in ("debug", "trace"),
        http=timed_http_protocol(server_args.read_timeout),
        timeout_keep_alive=server_args.timeout_keep_alive,
        timeout_graceful_shutdown=server_args.shutdown_timeout + _ABORT_MARGIN_S,
    )
    state: ServerState = app.state.baton
    server = BatonServer(config, state, server_args.shutdown_timeout, _spec_summary(server_args))
    try:
        server.run()
    except KeyboardInterrupt:  # a signal before uvicorn installed its handlers (still starting up)
        pass
    finally:
        state.worker.stop()  # a no-op after the lifespan's own stop; needed when a forced exit skipped it
