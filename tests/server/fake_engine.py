"""A deterministic stand-in for ``baton.engine.Engine`` (docs/engine-api.md) for server tests.

``CharTokenizer`` maps each UTF-8 byte to one token (plus BOS when asked for special tokens).
``FakeEngine.generate`` emits the letters of ``continuation(input_ids)`` one token per step
(``tokens_per_step`` per verify step after the first, to imitate speculative decoding), sleeping
``step_delay`` per step, and honours max_new_tokens, stop strings (held back while they may still match,
cut when they do), stop_token_ids, EOS (``eos_after``), ignore_eos and should_abort. Prompts containing
``RAISE`` / ``RAISE_LATE`` / ``REJECT`` make it fail on purpose. It records what it ran so tests can check
ordering, aborts and that only one request ran at a time.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from baton.config import ServerArgs
from baton.engine.api import RequestTrace
from baton.types import Request, SpecStats, StepOutput

LETTERS = "abcdefghijklmnopqrstuvwxyz"


class CharTokenizer:
    """Byte-level tokenizer with the methods of baton.tokenizer.Tokenizer the server uses."""

    PAD, BOS, EOS = 0, 1, 2
    OFFSET = 3
    vocab_size = 256 + OFFSET
    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [self.BOS] * add_special_tokens + [b + self.OFFSET for b in text.encode()]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i - self.OFFSET for i in ids if i >= self.OFFSET).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> str:
        text = "".join(f"<|{k}={v}|>" for k, v in kwargs.items())
        for m in messages:
            if m["role"] == "tool" and "tool_call_id" not in m:
                raise ValueError("tool messages need a tool_call_id")
            text += f"<|{m['role']}|>{m['content']}\n"
        return text + ("<|assistant|>" if add_generation_prompt else "")


def continuation(input_ids: list[int], num_tokens: int) -> str:
    """The text FakeEngine generates for a prompt, ignoring stops: letters from a prompt-dependent start."""
    start = sum(input_ids) % len(LETTERS)
    return "".join(LETTERS[(start + i) % len(LETTERS)] for i in range(num_tokens))


def expected_text(prompt: str, num_tokens: int, stop: list[str] | None = None, chat: bool = False) -> str:
    """What the server should return for a raw prompt (tokenized with BOS) or a rendered chat prompt."""
    text = continuation(CharTokenizer().encode(prompt, add_special_tokens=not chat), num_tokens)
    cuts = [text.find(s) for s in stop or [] if s in text]
    return text[: min(cuts)] if cuts else text


class FakeEngine:
    def __init__(
        self,
        context_length: int = 512,
        step_delay: float = 0.001,
        tokens_per_step: int = 1,
        eos_after: int | None = None,
        served_model_name: str = "fake-model",
    ) -> None:
        self.server_args = ServerArgs(model_path="fake-model", served_model_name=served_model_name)
        self.tokenizer = CharTokenizer()
        self.context_length = context_length
        self.spec_stats = SpecStats()
        self.vocab_size: int | None = None
        self.model_path = "fake-model"
        self.served_model_name = served_model_name
        self.step_delay = step_delay
        self.tokens_per_step = tokens_per_step
        self.eos_after = eos_after
        self.started: list[str] = []
        self.finished: dict[str, str] = {}  # rid -> finish type
        self.aborted: list[str] = []
        self.flush_count = 0
        self.max_active = 0
        self.thread_ids: set[int] = set()
        self.observers: list[Callable[[RequestTrace], None]] = []
        self.warm_ups = 0
        self._active = 0

    # ---- contract ----
    def validate_request(self, req: Request) -> None:
        req.sampling.validate()
        if not req.input_ids:
            raise ValueError("the prompt is empty")
        if len(req.input_ids) >= self.context_length:
            raise ValueError(
                f"the prompt has {len(req.input_ids)} tokens; the context length is {self.context_length}"
            )

    def generate(self, req: Request, should_abort: Callable[[], bool] | None = None) -> Iterator[StepOutput]:
        self.thread_ids.add(threading.get_ident())
        self.started.append(req.rid)
        self._active += 1
        self.max_active = max(self.max_active, self._active)
        self._output: list[int] = []
        try:
            yield from self._generate(req, should_abort or (lambda: False))
        finally:
            self._active -= 1
            sequence = list(req.input_ids) + self._output
            for fn in self.observers:
                fn(RequestTrace(req.rid, sequence, len(sequence)))

    def flush_cache(self) -> None:
        self.flush_count += 1
        self.spec_stats.reset()

    def add_observer(self, fn: Callable[[RequestTrace], None]) -> None:
        self.observers.append(fn)

    def warm_up(self) -> None:
        self.warm_ups += 1

    def model_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True}

    def server_info(self) -> dict[str, Any]:
        return {"model_path": self.model_path, "avg_spec_accept_length": self.spec_stats.avg_accept_length}

    def prefix_cache_info(self) -> dict[str, Any]:
        return {"prefix_cache_enabled": False, "prefix_cache_hit_rate": 0.0}

    # ---- the fake decode loop ----
    def _generate(self, req: Request, should_abort: Callable[[], bool]) -> Iterator[StepOutput]:
        prompt = self.tokenizer.decode(req.input_ids)
        if "REJECT" in prompt:
            raise ValueError("the fake engine rejects this prompt")
        if "RAISE" in prompt and "RAISE_LATE" not in prompt:
            raise RuntimeError("fake engine failure")
        state = _DecodeState(req, self)
        self._output = state.output_ids
        if state.finish is not None:  # max_new_tokens == 0
            self.finished[req.rid] = "length"
            yield StepOutput([], "", True, state.finish)
            return
        step = 0
        while True:
            if should_abort():
                self.aborted.append(req.rid)
                self.finished[req.rid] = "abort"
                yield StepOutput(
                    [], "", True, {"type": "abort", "message": "aborted"}, state.num_verify_steps
                )
                return
            if "RAISE_LATE" in prompt and step == 3:
                raise RuntimeError("fake engine failure mid-stream")
            time.sleep(self.step_delay)
            out = state.step(1 if step == 0 else self.tokens_per_step, is_verify=step > 0)
            if out.finished:
                self.finished[req.rid] = out.finish_reason["type"]
            yield out
            if out.finished:
                return
            step += 1


class _DecodeState:
    def __init__(self, req: Request, engine: FakeEngine) -> None:
        self.req = req
        self.engine = engine
        self.sampling = req.sampling
        self.letters = continuation(req.input_ids, req.sampling.max_new_tokens + engine.context_length)
        self.output_ids: list[int] = []
        self.text = ""
        self.emitted = 0
        self.num_verify_steps = 0
        self.holdback = max((len(s) for s in self.sampling.stop), default=1) - 1
        self.finish: dict | None = None
        if self.sampling.max_new_tokens == 0:
            self.finish = {"type": "length", "length": 0}

    def step(self, num_tokens: int, is_verify: bool) -> StepOutput:
        new_ids: list[int] = []
        for _ in range(num_tokens):
            new_ids.append(self._next_token())
            if self.finish is not None:
                break
        if is_verify and self.engine.tokens_per_step > 1:
            self.num_verify_steps += 1
            self.engine.spec_stats.record(len(new_ids) - 1)
        safe = len(self.text) if self.finish is not None else len(self.text) - self.holdback
        new_text = self.text[self.emitted : max(safe, self.emitted)]
        self.emitted = max(safe, self.emitted)
        return StepOutput(new_ids, new_text, self.finish is not None, self.finish, self.num_verify_steps)

    def _next_token(self) -> int:
        tok_eos = CharTokenizer.EOS
        pos = len(self.output_ids)
        if (
            self.engine.eos_after is not None
            and pos == self.engine.eos_after
            and not self.sampling.ignore_eos
        ):
            self.output_ids.append(tok_eos)
            self.finish = {"type": "stop", "matched": tok_eos}
            return tok_eos
        char = self.letters[pos]
        tok = CharTokenizer().encode(char)[0]
        self.output_ids.append(tok)
        self.text += char
        if tok in self.sampling.stop_token_ids:
            self.finish = {"type": "stop", "matched": tok}
        for s in self.sampling.stop:
            idx = self.text.find(s)
            if idx >= 0:
                self.text = self.text[:idx]
                self.finish = {"type": "stop", "matched": s}
                break
        if self.finish is None and len(self.output_ids) >= self.sampling.max_new_tokens:
            self.finish = {"type": "length", "length": self.sampling.max_new_tokens}
        return tok
