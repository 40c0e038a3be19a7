"""The prefix cache under tensor parallelism on CPU (two gloo ranks): each rank restores its own shards, every
rank takes the same decisions (they depend on token ids only), so TP=2 gives the TP=1 tokens and hits, and a hit
gives the tokens of an empty cache."""

from __future__ import annotations

import pytest

from baton.config import ServerArgs, SpecConfig
from baton.engine.engine import Engine
from baton.engine.tp import run_tp
from tests.dist.prefix_ranks import generate_cached

A = [(5 + 7 * i) % 90 + 2 for i in range(40)]
GREEDY = dict(temperature=0.0, max_new_tokens=12, ignore_eos=True)
SAMPLED = dict(temperature=0.9, seed=3, max_new_tokens=12, ignore_eos=True)
REQUESTS = [(A, GREEDY), (A[:32] + [7, 9], GREEDY), (A + [3, 4], SAMPLED), (A[:20] + [11], GREEDY), (A, GREEDY)]


def _args(path: str, tp: int, spec: dict, **kw) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", context_length=256, tp_size=tp, prefix_snapshot_stride=16,
                      spec=SpecConfig(adaptive=False, **spec), **kw)


def _copy(requests):
    return [(list(ids), dict(kw)) for ids, kw in requests]


@pytest.mark.parametrize("spec", [{}, {"algorithm": "NEXTN", "num_steps": 3}])
def test_ling_tp2_prefix_cache_equals_tp1_and_cold(ling_path, spec):
    want = generate_cached(Engine(_args(ling_path, 1, spec)), _copy(REQUESTS))
    got = run_tp(_args(ling_path, 2, spec), generate_cached, (_copy(REQUESTS),), rank0_in_caller=False,
                 timeout_s=120)
    assert got == want
    assert [c for _, c in got] == [0, 32, 40, 16, 40]
    cold = generate_cached(Engine(_args(ling_path, 1, spec, disable_radix_cache=True)), _copy(REQUESTS))
    assert [t for t, _ in got] == [t for t, _ in cold]
