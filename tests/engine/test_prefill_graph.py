"""The padded short prefill of baton/engine/prefill_graph.py on the CPU in fp32 (the forward a captured graph
replays, run eagerly): its rows and every cache and state after it equal the unpadded prefill's, at position 0
and after a prefix, for the tiny Ling (KDA state and conv window, MLA latent, MoE with padding rows routed to no
expert) and the tiny Llama; engines that take it for their short prefills give the same greedy tokens as engines
that do not (plain, NEXTN, DSpark, with prefix-cache hits). The captured form is tests/engine/test_cuda_graphs.py's
``test_prefill_graph_equals_eager`` (GPU)."""

from __future__ import annotations

import pytest
import torch

from baton.config import ServerArgs, SpecConfig
from baton.engine.engine import Engine
from baton.engine.prefill_graph import PrefillGraphs, prefill_buckets
from baton.types import ForwardMode, Request, SamplingParams

PROMPT = [(3 + 11 * i) % 90 + 2 for i in range(37)]  # tokens 2..91: no EOS, inside both vocabularies


def test_buckets():
    assert prefill_buckets(256) == (16, 32, 64, 96, 128, 192, 256)
    assert prefill_buckets(100) == (16, 32, 64, 96, 100)
    assert prefill_buckets(96) == (16, 32, 64, 96)
    assert prefill_buckets(16) == (16,)
    assert prefill_buckets(10) == (10,)
    assert prefill_buckets(0) == ()


def _engine(path: str, spec: SpecConfig | None = None, **kw) -> Engine:
    return Engine(ServerArgs(model_path=path, device="cpu", context_length=128, spec=spec or SpecConfig(adaptive=False),
                             **kw))


def _snapshot(engine: Engine, rows: int) -> list[torch.Tensor]:
    cache = engine.runner.cache
    return [t.clone() for t in cache.state_buffers()] + [t[:rows].clone() for t in cache.row_buffers()]


def _eager(engine: Engine, tokens: torch.Tensor, start: int, capture=()) -> tuple[torch.Tensor, list]:
    ctx = engine.runner.context(ForwardMode.PREFILL, start, tokens.shape[0], capture)
    return engine.model(tokens, ctx), ctx.captured


@pytest.mark.parametrize("arch", ["ling", "llama"])
@pytest.mark.parametrize("prefix,rest,bucket", [(0, 11, 16), (0, 16, 16), (20, 11, 16), (20, 17, 32)])
def test_padded_prefill_equals_unpadded(arch, prefix, rest, bucket, ling_path, llama_path):
    engine = _engine(ling_path if arch == "ling" else llama_path)
    model = engine.model
    cfg = engine.model_config
    capture = (0, cfg.num_hidden_layers - 1)
    tokens = torch.tensor(PROMPT[: prefix + rest])
    graphs = PrefillGraphs(model, engine.runner.cache, engine.device, (16, 32), capture, capture=False)
    assert graphs.bucket(prefix, rest) == bucket
    with torch.inference_mode():
        results = []
        for padded in (False, True):
            engine.runner.cache.reset()
            if prefix:
                _eager(engine, tokens[:prefix], 0)
            graphs.tokens.fill_(7)  # padding rows hold some other token
            if padded:
                hidden, caps = graphs.run(tokens[prefix:], prefix)
            else:
                hidden, caps = _eager(engine, tokens[prefix:], prefix, capture)
            state = _snapshot(engine, prefix + rest)
            # one decode step after it sees the same caches
            ctx = engine.runner.context(ForwardMode.DECODE, prefix + rest, 1)
            after = model(torch.tensor([5]), ctx)
            results.append((hidden, caps, state, after))
    (h0, c0, s0, a0), (h1, c1, s1, a1) = results
    assert h1.shape == h0.shape and len(c1) == len(c0) == 2
    torch.testing.assert_close(h1, h0, rtol=1e-5, atol=1e-5)
    for x, y in zip(c1, c0, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    assert len(s1) == len(s0) and (arch == "llama" or len(engine.runner.cache.state_buffers()) > 0)
    for x, y in zip(s1, s0, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a1, a0, rtol=1e-5, atol=1e-5)


def test_padding_past_the_cache_falls_back(ling_path):
    engine = _engine(ling_path)
    graphs = PrefillGraphs(engine.model, engine.runner.cache, engine.device, (16, 32), capture=False)
    top = engine.runner.cache.max_len
    assert graphs.bucket(top - 16, 10) == 16
    assert graphs.bucket(top - 15, 10) is None  # its 16 rows would run past the cache
    assert graphs.bucket(0, 33) is None  # longer than the largest bucket
    with pytest.raises(ValueError, match="no prefill bucket"):
        graphs.run(torch.tensor(PROMPT[:33]), 0)
    with pytest.raises(ValueError, match="exceeds the cache"):
        PrefillGraphs(engine.model, engine.runner.cache, engine.device, (top + 1,), capture=False)


def _run(engine: Engine, prompt: list[int], max_new_tokens: int = 10) -> tuple[list[int], int]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, ignore_eos=True)
    tokens, cached = [], None
    for out in engine.generate(Request(list(prompt), params)):
        tokens.extend(out.token_ids)
        cached = out.cached_tokens if cached is None else cached
    return tokens, cached


def _with_graphs(engine: Engine, buckets=(16, 32)) -> Engine:
    capture = engine.drafter.capture_layer_ids if engine.drafter else ()
    engine.prefill_graphs = PrefillGraphs(engine.model, engine.runner.cache, engine.device, buckets, capture,
                                          capture=False)
    return engine


@pytest.mark.parametrize("arch,mode", [("ling", "plain"), ("llama", "plain"), ("ling", "nextn"), ("ling", "dspark"),
                                       ("llama", "dspark")])
def test_engine_greedy_with_padded_prefills(arch, mode, ling_path, llama_path, draft_paths):
    path = ling_path if arch == "ling" else llama_path
    spec = {"plain": SpecConfig(adaptive=False),
            "nextn": SpecConfig(algorithm="NEXTN", num_steps=3, adaptive=False),
            "dspark": SpecConfig(algorithm="DSPARK", draft_model_path=draft_paths[arch], num_draft_tokens=5,
                                 adaptive=False)}[mode]
    plain = _engine(path, spec, prefix_snapshot_stride=16)
    graphed = _with_graphs(_engine(path, spec, prefix_snapshot_stride=16))
    assert plain.prefill_graphs is None  # the CPU never captures; the tests install the eager form
    calls = []
    run = graphed.prefill_graphs.run
    graphed.prefill_graphs.run = lambda tokens, start: calls.append((start, tokens.shape[0])) or run(tokens, start)
    # a cold prompt (Ling: cut at the snapshot stride, 16 rows then 7 padded to 16; Llama: 23 padded to 32), a
    # longer one that hits its end, then follow-ups whose uncached rest is short
    first, _ = _run(graphed, PROMPT[:23])
    assert first == _run(plain, PROMPT[:23])[0]
    for prompt in (PROMPT, PROMPT + [5, 9, 13], PROMPT[:30] + [17] * 5):
        got, cached = _run(graphed, prompt)
        want, cached_plain = _run(plain, prompt)
        assert got == want and cached == cached_plain, prompt
    expect = [(0, 16), (16, 7)] if arch == "ling" else [(0, 23)]
    assert calls[: len(expect)] == expect and any(start >= 23 for start, _ in calls)
