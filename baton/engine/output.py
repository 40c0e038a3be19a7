"""Host-side output handling for one request: EOS / stop-token / max-token checks on committed tokens,
incremental detokenization, and stop strings (text after a matched stop string is never emitted; text
that could still become a stop string is held back until it cannot)."""

from __future__ import annotations

from dataclasses import dataclass

from baton.tokenizer import IncrementalDetokenizer, Tokenizer
from baton.types import SamplingParams


@dataclass
class Emitted:
    token_ids: list[int]
    text: str
    finish_reason: dict | None


class OutputTracker:
    def __init__(self, tokenizer: Tokenizer, sampling: SamplingParams, eos_token_ids: set[int]) -> None:
        self.sampling = sampling
        self.stop_ids = set(sampling.stop_token_ids) | (set() if sampling.ignore_eos else set(eos_token_ids))
        self.detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=sampling.skip_special_tokens)
        self.stops = [s for s in sampling.stop if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.num_tokens = 0
        self.output_ids: list[int] = []
        self.emitted_chars = 0
        self.finish_reason: dict | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token_ids: list[int]) -> Emitted:
        """Take the tokens one step committed; return what the client should see now."""
        kept: list[int] = []
        for tok in token_ids:
            kept.append(tok)
            self.num_tokens += 1
            if tok in self.stop_ids:
                self.finish_reason = {"type": "stop", "matched": tok}
                break
            if self.num_tokens >= self.sampling.max_new_tokens:
                self.finish_reason = {"type": "length", "length": self.num_tokens}
                break
        self.output_ids.extend(kept)
        text_ids = [t for t in kept if not (self.finish_reason and t == self.finish_reason.get("matched"))]
        self.detok.add(text_ids)
        return Emitted(kept, self._new_text(), self.finish_reason)

    def abort(self) -> Emitted:
        self.finish_reason = {"type": "abort", "message": "request aborted"}
        return Emitted([], self._new_text(), self.finish_reason)

    def _new_text(self) -> str:
        text = self.detok.text
        if self.finished:
            text = text + self.detok.flush() if self.finish_reason["type"] != "abort" else text
        if self.stops:
            start = max(0, self.emitted_chars - self.hold)
            hits = [(i, s) for s in self.stops if (i := text.find(s, start)) >= 0]
            if hits:
                idx, matched = min(hits)
                self.finish_reason = {"type": "stop", "matched": matched}
                return self._take(text, idx)
        end = len(text) if self.finished else len(text) - self.hold
        return self._take(text, max(end, self.emitted_chars))

    def _take(self, text: str, end: int) -> str:
        out = text[self.emitted_chars : end]
        self.emitted_chars = end
        return out
