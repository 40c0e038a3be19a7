"""The prefix cache on CUDA with the step program captured as CUDA graphs: a hit writes the cached rows and
states into the very buffers the graphs read, so greedy output with a hit equals the output on an empty cache."""

from __future__ import annotations

import pytest

from baton.config import ServerArgs, SpecConfig
from baton.engine.engine import Engine
from tests.engine.test_prefix_cache import PROMPT, STRIDE, _deepest_key, _run, _spec

pytestmark = pytest.mark.gpu


def _cuda_engine(path: str, spec: SpecConfig, **kw) -> Engine:
    return Engine(ServerArgs(model_path=path, device="cuda", dtype="float32", context_length=256,
                             prefix_snapshot_stride=STRIDE, spec=spec, **kw))


@pytest.mark.parametrize("mode", ["plain", "nextn", "dspark"])
def test_graphed_hits_equal_an_empty_cache_ling(ling_path, llama_nextn_path, draft_paths, mode):
    spec = _spec(mode, "ling", llama_nextn_path, draft_paths)
    cold = _cuda_engine(ling_path, spec, disable_radix_cache=True)
    warm = _cuda_engine(ling_path, spec)
    assert warm.program.capture
    first, _ = _run(warm, PROMPT)
    assert first == _run(cold, PROMPT)[0]
    end_key = _deepest_key(warm)
    cases = ((PROMPT[:32] + [7, 9], 32), (PROMPT + [19, 23], 40), (end_key + [31, 37], len(end_key)),
             (PROMPT + first + [41, 43], len(PROMPT) + len(first)), (PROMPT, 40))
    for prompt, cached in cases:
        got, hit = _run(warm, prompt)
        assert hit == cached
        assert got == _run(cold, prompt)[0]
