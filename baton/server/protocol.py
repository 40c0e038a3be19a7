"""HTTP request and response schemas: SGLang's native ``/generate`` and the OpenAI completions and chat APIs.

Owns the pydantic request models (field names exactly as SGLang and OpenAI spell them), the conversion of
their sampling fields into ``baton.types.SamplingParams``, the error body every endpoint returns, and the
JSON shapes of responses and stream chunks. Request models ignore fields they do not know, so SGLang's
bench payloads (``lora_path``, ``return_routed_experts``, ...) pass; fields that would change the output
and that baton does not implement are rejected with a 400 rather than silently ignored.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from baton.types import SamplingParams, StepOutput

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    500: "server_error",
    503: "server_error",
}


class ApiError(Exception):
    """A request the server refuses; becomes an OpenAI-style error body with this status."""

    def __init__(self, message: str, status: int = 400, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code


def error_body(message: str, status: int = 400, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape. ``code`` is OpenAI's string code where it has one (``model_not_found``), else the
    HTTP status as vLLM and SGLang give it."""
    err = {"message": message, "type": ERROR_TYPES.get(status, "invalid_request_error"), "param": param}
    return {"object": "error", "error": {**err, "code": code if code is not None else status}}


def model_not_found(model: str, served: str) -> ApiError:
    """404 ``model_not_found``, as OpenAI and vLLM answer for a model they do not serve."""
    return ApiError(f"The model `{model}` does not exist; this server serves `{served}`", 404, "model",
                    code="model_not_found")


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list\[.*\]|dict\[.*\]|[A-Z]\w*|function-.*)$")


def validation_message(exc: ValidationError) -> tuple[str, str | None]:
    """A one-line message and the offending parameter from a pydantic error (never a traceback)."""
    errors = exc.errors(include_url=False, include_context=False, include_input=False)
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first["type"] == "json_invalid":
        return "request body is not valid JSON", None
    param = ".".join(str(p) for p in first["loc"] if not _TYPE_TAG.match(str(p)))
    msg = f"{param}: {first['msg']}" if param else first["msg"]
    if len(errors) > 1:
        msg += f" (and {len(errors) - 1} more error(s))"
    return msg, param or None


class _Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore")


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _check_unsupported(params: BaseModel, defaults: dict[str, Any]) -> None:
    for name, default in defaults.items():
        value = getattr(params, name, default)
        if value is not None and value != default and value != [] and value != {}:
            raise ApiError(f"{name}={value!r} is not supported by baton", param=name)


_NATIVE_UNSUPPORTED = {
    "n": 1,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "structural_tag": None,
    "stop_regex": None,
    "logit_bias": None,
    "no_stop_trim": False,
}


class NativeSamplingParams(_Lenient):
    """``sampling_params`` of ``/generate``, SGLang's names and defaults; None means the default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    max_new_tokens: int | None = 128
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    seed: int | None = None
    sampling_seed: int | None = None
    skip_special_tokens: bool | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_new_tokens: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    stop_regex: str | list[str] | None = None
    logit_bias: dict[str, float] | None = None
    no_stop_trim: bool | None = None

    def to_sampling(self, max_new_tokens: int) -> SamplingParams:
        _check_unsupported(self, _NATIVE_UNSUPPORTED)
        return make_sampling(
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            max_new_tokens,
            self.stop,
            self.stop_token_ids,
            self.ignore_eos,
            self.seed if self.seed is not None else self.sampling_seed,
            self.skip_special_tokens,
        )


def make_sampling(
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    max_new_tokens: int,
    stop: str | list[str] | None,
    stop_token_ids: list[int] | None,
    ignore_eos: bool | None,
    seed: int | None,
    skip_special_tokens: bool | None,
) -> SamplingParams:
    """SamplingParams from request fields where None means "the default"; raises ApiError when invalid."""
    params = SamplingParams(
        temperature=1.0 if temperature is None else temperature,
        top_p=1.0 if top_p is None else top_p,
        top_k=-1 if top_k is None else top_k,
        min_p=0.0 if min_p is None else min_p,
        max_new_tokens=max_new_tokens,
        stop=[s for s in _stop_list(stop) if s],
        stop_token_ids=list(stop_token_ids or []),
        ignore_eos=bool(ignore_eos),
        seed=seed,
        skip_special_tokens=True if skip_special_tokens is None else skip_special_tokens,
    )
    try:
        params.validate()
    except ValueError as e:
        raise ApiError(str(e)) from e
    return params


class GenerateRequest(_Lenient):
    """Body of SGLang's native ``POST /generate``. A list prompt is a batch (non-streaming only)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    stream: bool = False
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = False
    input_embeds: Any = None
    image_data: Any = None
    return_hidden_states: bool | None = False

    def check_supported(self) -> None:
        if any(_as_list(self.return_logprob)):
            raise ApiError("return_logprob is not supported by baton", param="return_logprob")
        if self.input_embeds is not None:
            raise ApiError("input_embeds is not supported by baton", param="input_embeds")
        if self.image_data is not None:
            raise ApiError("image_data is not supported by baton (text-only models)", param="image_data")
        if self.return_hidden_states:
            raise ApiError("return_hidden_states is not supported by baton", param="return_hidden_states")


def _as_list(value: Any) -> list[Any]:
    return value if isinstance(value, list) else [value]


_OPENAI_UNSUPPORTED = {
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_tokens": 0,
    "logit_bias": None,
    "regex": None,
    "json_schema": None,
    "ebnf": None,
    "no_stop_trim": False,
    "tools": None,
}


class StreamOptions(_Lenient):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _OpenAIRequest(_Lenient):
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    n: int | None = 1
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    no_stop_trim: bool | None = None
    tools: list[Any] | None = None
    rid: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def check_supported(self) -> None:
        if self.n is not None and self.n != 1:
            raise ApiError(f"n={self.n} is not supported: baton returns one choice per request", param="n")
        _check_unsupported(self, _OPENAI_UNSUPPORTED)

    def to_sampling(self, max_new_tokens: int) -> SamplingParams:
        return make_sampling(
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            max_new_tokens,
            self.stop,
            self.stop_token_ids,
            self.ignore_eos,
            self.seed,
            self.skip_special_tokens,
        )


class CompletionRequest(_OpenAIRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise ApiError("echo is not supported by baton", param="echo")
        if self.logprobs is not None:
            raise ApiError("logprobs is not supported by baton", param="logprobs")
        if self.best_of not in (None, 1):
            raise ApiError(f"best_of={self.best_of} is not supported", param="best_of")
        if self.suffix:
            raise ApiError("suffix is not supported by baton", param="suffix")

    def single_prompt(self) -> str | list[int]:
        """The one prompt of this request: a string or token ids."""
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], str | list):
            if len(p) != 1:
                raise ApiError(
                    "a list of several prompts is a batch; send one prompt per request", param="prompt"
                )
            p = p[0]
        return p


class ContentPart(_Lenient):
    type: str
    text: str | None = None


class ChatMessage(_Lenient):
    role: Literal["system", "user", "assistant", "tool", "developer", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[Any] | None = None

    def to_template(self) -> dict[str, Any]:
        """The message as a chat template sees it: content flattened to one string."""
        msg = self.model_dump(exclude_none=True)
        msg["content"] = self._flat_content()
        return msg

    def _flat_content(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.type != "text" or part.text is None:
                raise ApiError(
                    f"content part of type {part.type!r} is not supported (text only)", param="messages"
                )
            parts.append(part.text)
        return "\n".join(parts)


class ChatCompletionRequest(_OpenAIRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs:
            raise ApiError("logprobs is not supported by baton", param="logprobs")
        if self.response_format and self.response_format.get("type", "text") != "text":
            raise ApiError("response_format other than text is not supported", param="response_format")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def openai_finish_reason(finish_reason: dict | None) -> str | None:
    if finish_reason is None:
        return None
    kind = finish_reason.get("type")
    return kind if kind in ("length", "abort") else "stop"


def matched_stop(finish_reason: dict | None) -> int | str | None:
    if finish_reason is None or finish_reason.get("type") != "stop":
        return None
    return finish_reason.get("matched")


class Accumulated:
    """Everything one request produced so far, folded from its StepOutputs."""

    def __init__(self, rid: str, prompt_tokens: int, start_time: float) -> None:
        self.rid = rid
        self.prompt_tokens = prompt_tokens
        self.start_time = start_time
        self.created = int(time.time())
        self.output_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: dict | None = None
        self.num_verify_steps = 0
        self.cached_tokens = 0  # prompt tokens the engine restored from its prefix cache

    def add(self, out: StepOutput) -> None:
        self.output_ids.extend(out.token_ids)
        self.cached_tokens = max(self.cached_tokens, getattr(out, "cached_tokens", 0))
        if out.text:
            self.text_parts.append(out.text)
        self.num_verify_steps = max(self.num_verify_steps, out.num_verify_steps)
        if out.finished:
            self.finish_reason = out.finish_reason

    @property
    def text(self) -> str:
        if len(self.text_parts) > 1:
            self.text_parts = ["".join(self.text_parts)]
        return self.text_parts[0] if self.text_parts else ""

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)

    def usage(self) -> dict[str, int]:
        n = self.completion_tokens
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": n,
            "total_tokens": self.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }

    def meta_info(self, final: bool) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }
        if final:
            meta["spec_verify_ct"] = self.num_verify_steps
            if self.num_verify_steps > 0:
                meta["spec_accept_length"] = self.completion_tokens / self.num_verify_steps
            meta["e2e_latency"] = time.perf_counter() - self.start_time
        return meta

    def native_response(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info(final=True)}


class NativeStreamEncoder:
    """Encodes native stream chunks with cumulative ``text`` and ``output_ids`` without re-serialising the
    whole output each step: JSON escaping is per character, so escaped pieces concatenate."""

    def __init__(self) -> None:
        self._text_json = ""
        self._ids_json = ""

    def chunk(self, out: StepOutput, acc: Accumulated) -> str:
        if out.text:
            self._text_json += json.dumps(out.text, ensure_ascii=False)[1:-1]
        if out.token_ids:
            new_ids = ",".join(map(str, out.token_ids))
            self._ids_json = f"{self._ids_json},{new_ids}" if self._ids_json else new_ids
        meta = json.dumps(acc.meta_info(final=out.finished), ensure_ascii=False)
        return f'{{"text":"{self._text_json}","output_ids":[{self._ids_json}],"meta_info":{meta}}}'


def _envelope(acc: Accumulated, model: str, obj: str, choice: dict[str, Any] | None, usage: bool) -> dict[str, Any]:
    """The OpenAI response / chunk object around one choice (none for a usage-only chunk)."""
    out = {"id": acc.rid, "object": obj, "created": acc.created, "model": model,
           "choices": [] if choice is None else [choice]}
    if usage:
        out["usage"] = acc.usage()
    return out


def _choice(acc: Accumulated, finished: bool, **content: Any) -> dict[str, Any]:
    return {"index": 0, **content, "logprobs": None,
            "finish_reason": openai_finish_reason(acc.finish_reason) if finished else None,
            "matched_stop": matched_stop(acc.finish_reason) if finished else None}


def completion_response(acc: Accumulated, model: str) -> dict[str, Any]:
    return _envelope(acc, model, "text_completion", _choice(acc, True, text=acc.text), usage=True)


def completion_chunk(acc: Accumulated, model: str, text: str, finished: bool) -> dict[str, Any]:
    return _envelope(acc, model, "text_completion", _choice(acc, finished, text=text), usage=False)


def chat_response(acc: Accumulated, model: str) -> dict[str, Any]:
    message = {"role": "assistant", "content": acc.text, "reasoning_content": None, "tool_calls": None}
    return _envelope(acc, model, "chat.completion", _choice(acc, True, message=message), usage=True)


def chat_chunk(acc: Accumulated, model: str, delta: dict[str, Any], finished: bool) -> dict[str, Any]:
    return _envelope(acc, model, "chat.completion.chunk", _choice(acc, finished, delta=delta), usage=False)


def usage_chunk(acc: Accumulated, model: str, obj: str) -> dict[str, Any]:
    return _envelope(acc, model, obj, None, usage=True)
