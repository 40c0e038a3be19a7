"""What the spawned ranks of the tensor-parallel tests run: module-level functions, so that they pickle."""

from __future__ import annotations

import time

import torch

from baton import dist
from baton.types import Request, SamplingParams


def generate_all(engine, requests: list[tuple[list[int], dict]]) -> list[tuple[list[int], str, int]]:
    """Rank 0's leader: run each (prompt ids, SamplingParams kwargs); (tokens, finish type, verify steps) each."""
    out = []
    for ids, kwargs in requests:
        abort_after = kwargs.pop("abort_after", None)
        should_abort = None if abort_after is None else _abort_after(abort_after)
        tokens, reason, verify = [], "", 0
        for o in engine.generate(Request(list(ids), SamplingParams(**kwargs)), should_abort):
            tokens += o.token_ids
            verify = o.num_verify_steps
            if o.finished:
                reason = (o.finish_reason or {}).get("type", "")
        out.append((tokens, reason, verify))
    engine.flush_cache()
    return out


def generate_all_fused(engine, requests: list[tuple[list[int], dict]]) -> list[tuple[list[int], str, int]]:
    """``generate_all`` on a TPEngine whose ranks all stack the shared expert with the routed ones in their MoE
    layers, the target's and the NEXTN head's (shared experts fusion; a rank without it fails the run)."""
    assert engine.call_all(assert_shared_fused) == dist.tp_size()
    return generate_all(engine, requests)


def assert_shared_fused(engine) -> int:
    """Every rank (through TPEngine.call_all): its MoE layers hold a fused shared expert; the all-reduced count of
    the ranks that checked."""
    assert engine.model.model.layers[1].mlp.shared_id is not None
    assert engine.drafter is None or engine.drafter.head.body.mlp.shared_id is not None
    return int(dist.all_reduce(torch.tensor([1.0]))[0])


def rank_sum_plus(engine, x: float) -> float:
    """Every rank (through TPEngine.call_all): all-reduce of rank + x, so rank 0's answer proves all ran it."""
    return float(dist.all_reduce(torch.tensor([dist.tp_rank() + x]))[0])


def call_on_all(engine, x: float) -> tuple[float, list]:
    """Rank 0's leader: ``call_all`` once, then a greedy request (the ranks still agree after it)."""
    total = engine.call_all(rank_sum_plus, x)
    return total, generate_all(engine, [([3, 5, 7], dict(temperature=0.0, max_new_tokens=4, ignore_eos=True))])


def _abort_after(n: int):
    """A should_abort that says yes from its (n+1)-th call on."""
    calls = iter(range(10**9))
    return lambda: next(calls) >= n


def sum_ranks(steps: int) -> float:
    """Every rank: ``steps`` all-reduces of its rank + 1, counting progress like an engine inside a request."""
    dist.set_busy(True)
    total = 0.0
    for _ in range(steps):
        dist.progress()
        total = float(dist.all_reduce(torch.tensor([dist.tp_rank() + 1.0]))[0])
    dist.set_busy(False)
    return total


def fail_on(rank: int, how: str, at_step: int = 2) -> None:
    """Every rank runs a loop of all-reduces; ``rank`` raises, hangs, or dies by a signal at ``at_step``."""
    dist.set_busy(True)
    for step in range(10):
        if dist.tp_rank() == rank and step == at_step:
            if how == "raise":
                raise ValueError(f"boom on rank {rank}")
            if how == "hang":
                time.sleep(3600)
            if how == "exit":
                import os

                os._exit(3)
        dist.progress()
        dist.all_reduce(torch.ones(4))
    dist.set_busy(False)
