"""The engine as its users see it: what ``baton serve``, ``baton generate`` and the tools may call.

``Engine`` (one process), ``TPEngine`` (rank 0 of a tensor-parallel run, mirroring every request on the other
ranks) and the server tests' ``FakeEngine`` all implement ``EngineAPI``; the server reads nothing else of an
engine. ``RequestTrace`` is what an engine reports when a request ends, to the observers added with
``add_observer`` (tests check committed tokens and cache positions through it).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from baton.config import ServerArgs
from baton.types import Request, SpecStats, StepOutput


class TextTokenizer(Protocol):
    """The part of a tokenizer the server uses (baton.tokenizer.Tokenizer, IdTokenizer, test tokenizers)."""

    eos_token_ids: Iterable[int]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class RequestTrace:
    """A finished (or aborted) request as the engine ran it: ``sequence`` is the prompt and every token its steps
    produced (a step's tokens past max_new_tokens or a stop included: the caches hold them); ``committed`` the
    step program's position when the request ended, the number of leading tokens whose states the caches hold."""

    rid: str
    sequence: list[int]
    committed: int


@runtime_checkable
class EngineAPI(Protocol):
    server_args: ServerArgs
    tokenizer: TextTokenizer
    model_path: str  # what /v1/models reports as the root: a directory, a .gguf path, or "embedded"
    served_model_name: str
    context_length: int  # prompt + max_new_tokens may not exceed it
    vocab_size: int | None  # the model's (None: unknown, e.g. a fake engine)
    spec_stats: SpecStats

    def validate_request(self, req: Request) -> None:
        """Raise ValueError (the client's fault, HTTP 400) if ``req`` cannot run; nothing else happens."""

    def generate(self, req: Request, should_abort: Callable[[], bool] | None = None) -> Iterator[StepOutput]:
        """Run one request, yielding its tokens as they are committed; ``should_abort`` is polled per step."""

    def flush_cache(self) -> None:
        """Forget every cached state and the speculative statistics."""

    def model_info(self) -> dict[str, Any]:
        """/get_model_info's fields (model_path, tokenizer_path, model_type, ...)."""

    def server_info(self) -> dict[str, Any]:
        """/get_server_info's engine fields (device, dtype, acceptance, ...)."""

    def prefix_cache_info(self) -> dict[str, Any]:
        """The prefix cache's counters for /metrics (``prefix_cache_enabled``, ``prefix_cache_hit_rate``, cached and
        prompt tokens, tokens / snapshots / bytes held)."""

    def add_observer(self, fn: Callable[[RequestTrace], None]) -> None:
        """Call ``fn`` with a RequestTrace when each request ends (on the engine thread)."""

    def warm_up(self) -> None:
        """Run the warm-up requests (``warm_up_requests``), then forget them (flush_cache)."""


def warm_up_requests(vocab_size: int, context_length: int, long_prompt: bool) -> list[Request]:
    """What ``baton serve`` runs before it listens: a short greedy request (the decode and verify programs'
    kernels), and with ``long_prompt`` (a GPU) one of up to 8192 tokens, whose prefill compiles and tunes the
    prefill kernels at the lengths users send (a first 8192-token prompt otherwise pays ~11 s of compilation on
    the H200). Token ids are a fixed arithmetic sequence inside the vocabulary."""
    from baton.types import SamplingParams

    def prompt(n: int) -> list[int]:
        return [(7 + 31 * i) % vocab_size for i in range(n)]

    out = [Request(prompt(16), SamplingParams(max_new_tokens=8, ignore_eos=True), rid="warmup-short")]
    n = min(8192, context_length - 16)
    if long_prompt and n > 16:
        out.append(Request(prompt(n), SamplingParams(max_new_tokens=4, ignore_eos=True), rid="warmup-long"))
    return out


def run_warm_up(engine: EngineAPI, long_prompt: bool) -> None:
    """``warm_up`` for any EngineAPI: the requests through its own ``generate`` (under tensor parallelism, mirrored
    on every rank), then ``flush_cache``."""
    for req in warm_up_requests(engine.vocab_size or 256, engine.context_length, long_prompt):
        for _ in engine.generate(req):
            pass
    engine.flush_cache()
