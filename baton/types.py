"""Plain dataclasses passed between the server, the engine and the tools."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field


class ForwardMode(enum.Enum):
    PREFILL = "prefill"  # the prompt, parallel (chunked) KDA, writes caches
    DECODE = "decode"  # one token, recurrent KDA, writes caches
    VERIFY = "verify"  # T tokens of [anchor, drafts]; KDA states staged per position, not committed
    DRAFT = "draft"  # a draft model's forward
    EXTEND = "extend"  # a draft model replays the accepted prefix with the target's hidden states


SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1  # the seeds a request may give (vLLM's range; torch takes them all)


@dataclass
class SamplingParams:
    """Per-request sampling, with SGLang's field names. ``temperature == 0`` is greedy."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    max_new_tokens: int = 128
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    seed: int | None = None
    skip_special_tokens: bool = True

    @property
    def is_greedy(self) -> bool:
        return self.temperature <= 1e-6 or self.top_k == 1

    def validate(self) -> None:
        """Raise ValueError with a message a client can read."""
        if not (0.0 <= self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k == 0 or self.top_k < -1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k}")
        if not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {self.max_new_tokens}")
        if self.seed is not None and not (SEED_MIN <= self.seed <= SEED_MAX):
            raise ValueError(f"seed must be a 64-bit signed integer, in [{SEED_MIN}, {SEED_MAX}]; got {self.seed}")


@dataclass
class Request:
    input_ids: list[int]
    sampling: SamplingParams
    rid: str = ""
    arrival_time: float = field(default_factory=time.perf_counter)


@dataclass
class StepOutput:
    """What one engine step hands to the caller: the newly committed tokens and the request's state."""

    token_ids: list[int]  # new tokens since the previous StepOutput of this request
    text: str = ""  # new text since the previous StepOutput, already cut at a matched stop string
    finished: bool = False
    finish_reason: dict | None = None  # SGLang style: {"type": "stop"|"length"|"abort", "matched": ...}
    num_verify_steps: int = 0  # spec_verify_ct so far
    simulated: bool = False  # accepted counts were forced by --speculative-simulate-accept-len
    cached_tokens: int = 0  # prompt tokens restored from the prefix cache (set on the request's first output)


@dataclass
class SpecStats:
    """Server-wide speculative statistics, SGLang semantics: accept length = (accepted drafts + 1) / verify."""

    num_verify_steps: int = 0
    num_accepted_tokens: int = 0  # accepted drafts + bonus, summed over verify steps
    accept_histogram: dict[int, int] = field(default_factory=dict)  # accepted drafts -> count

    def record(self, num_accepted_drafts: int) -> None:
        self.num_verify_steps += 1
        self.num_accepted_tokens += num_accepted_drafts + 1
        self.accept_histogram[num_accepted_drafts] = self.accept_histogram.get(num_accepted_drafts, 0) + 1

    @property
    def avg_accept_length(self) -> float | None:
        if self.num_verify_steps == 0:
            return None
        return self.num_accepted_tokens / self.num_verify_steps

    def reset(self) -> None:
        self.num_verify_steps = 0
        self.num_accepted_tokens = 0
        self.accept_histogram.clear()
