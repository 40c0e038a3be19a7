"""Accept length measured the way it is served: an Engine with the draft, greedy, over held-out prompts.

``AcceptLengthEval`` builds the engine once from a draft checkpoint (the untrained draft written at the start
of training), then, at each evaluation, copies the training module's current weights into the engine's draft
module in place (CUDA graphs keep their addresses) and decodes every prompt greedily. The accept length is
SGLang's: (accepted drafts + bonus) / verify steps over all prompts (``engine.spec_stats``).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from tqdm import tqdm

from baton import env
from baton.config import ServerArgs, SpecConfig
from baton.train.common import read_jsonl
from baton.types import Request, SamplingParams

log = logging.getLogger(__name__)


@dataclass
class AcceptResult:
    accept_length: float
    num_verify_steps: int
    num_tokens: int
    outputs: list[list[int]]


def holdout_prompts(path: str, limit: int | None = None) -> list[list[int]]:
    """Distinct prompts (token ids) of a held-out records file, in file order."""
    seen, out = set(), []
    for row in read_jsonl(path):
        key = tuple(row["prompt_ids"])
        if key not in seen:
            seen.add(key)
            out.append(list(key))
    return out[:limit] if limit is not None else out


def spec_args(target_args: ServerArgs, algorithm: str, draft_path: str, num_steps: int | None = None,
              sts_path: str | None = None) -> ServerArgs:
    """``target_args`` with speculative decoding by the draft at ``draft_path``."""
    spec = SpecConfig(algorithm=algorithm, draft_model_path=draft_path,
                      num_steps=num_steps if algorithm.upper() in ("NEXTN", "EAGLE") else None,
                      dspark_confidence_sts_path=sts_path, adaptive=False)  # the drafts at full depth
    return dataclasses.replace(target_args, spec=spec)


def measure_accept_length(engine, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                          desc: str = "accept length") -> AcceptResult:
    """Greedy-decode every prompt (``ignore_eos``: every prompt yields ``max_new_tokens`` tokens) and read the
    engine's spec stats."""
    engine.flush_cache()
    outputs = []
    sp = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    for ids in tqdm(prompts, desc=desc, unit="prompt", disable=env.disable_progress(), leave=False):
        budget = min(max_new_tokens, engine.context_length - len(ids))
        if budget < 1:
            continue
        req = Request(list(ids), dataclasses.replace(sp, max_new_tokens=budget))
        outputs.append([t for out in engine.generate(req) for t in out.token_ids])
    stats = engine.spec_stats
    accept = stats.avg_accept_length if stats.avg_accept_length is not None else 1.0
    return AcceptResult(float(accept), stats.num_verify_steps, sum(len(o) for o in outputs), outputs)


class AcceptLengthEval:
    """Callable(module) -> accept length on ``prompts``, through an Engine built from ``args`` (by ``build``, or
    at the first call)."""

    def __init__(self, args: ServerArgs, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
        self.args, self.prompts, self.max_new_tokens = args, [list(p) for p in prompts], max_new_tokens
        self.engine = None
        self.results: list[AcceptResult] = []

    def _draft_module(self) -> nn.Module:
        drafter = self.engine.drafter
        return drafter.head if hasattr(drafter, "head") else drafter.model

    def build(self) -> None:
        if self.engine is None:
            from baton.engine.engine import Engine

            self.engine = Engine(self.args)

    def __call__(self, module: nn.Module | None = None) -> float:
        self.build()
        if module is not None:
            with torch.no_grad():
                self._draft_module().load_state_dict(module.state_dict())
        result = measure_accept_length(self.engine, self.prompts, self.max_new_tokens)
        self.results.append(result)
        log.info("accept length %.3f over %d verify steps", result.accept_length, result.num_verify_steps)
        return result.accept_length

    def close(self) -> None:
        self.engine = None


__all__ = ["AcceptLengthEval", "AcceptResult", "holdout_prompts", "measure_accept_length", "spec_args"]
