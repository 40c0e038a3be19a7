"""The prefix cache (baton/cache/prefix.py) on CPU in fp32: the radix tree itself, and engines whose greedy output
with a hit equals the output of the same request on an empty cache (plain, NEXTN, DSpark; tiny Ling with KDA
state and tiny Llama), at a snapshot boundary, between boundaries and at the end of a previous request; sampled
requests leave no trace; eviction under a tiny budget."""

from __future__ import annotations

import pytest
import torch

from baton.cache.prefix import PrefixCache
from baton.config import ServerArgs, SpecConfig
from baton.engine.engine import Engine
from baton.types import Request, SamplingParams

STRIDE = 16
PROMPT = [(5 + 7 * i) % 90 + 2 for i in range(40)]  # tokens 2..91: no EOS (1), inside both vocabularies


# ---- the tree ----


def _tree(exact: bool, max_tokens: int = 1000, max_snaps: int = 100, shift: int = 0):
    rows = torch.zeros(64, 2)
    state = torch.zeros(3)
    pc = PrefixCache([(rows, 0), (torch.zeros(64, 1), shift)], [state] if exact else [], exact, max_tokens,
                     max_snaps, STRIDE)
    return pc, rows, state


def _fill(rows: torch.Tensor, tokens: list[int]) -> None:
    rows[: len(tokens), 0] = torch.tensor(tokens, dtype=torch.float32)


def test_tree_rows_split_and_partial_match():
    pc, rows, _ = _tree(exact=False)
    a = [3, 4, 5, 6, 7, 8]
    _fill(rows, a)
    pc.insert(a, None, snapshot=False)
    b = [3, 4, 5, 9, 9]
    _fill(rows, b)
    pc.insert(b, None, snapshot=False)  # splits [3..8] after 3 tokens
    assert pc.total_tokens == 8
    rows.zero_()
    m = pc.match([3, 4, 5, 6, 7, 1])
    assert m.length == 5
    pc.restore(m, 5)
    assert rows[:5, 0].tolist() == [3, 4, 5, 6, 7] and rows[5, 0] == 0
    m = pc.match([3, 4, 5, 9, 9, 9])
    pc.restore(m, m.length)
    assert m.length == 5 and rows[:5, 0].tolist() == [3, 4, 5, 9, 9]


def test_tree_exact_restores_only_at_snapshots():
    pc, rows, state = _tree(exact=True, shift=1)
    a = list(range(10, 30))
    _fill(rows, a)
    state.fill_(16)
    pc.insert(a[:16], torch.ones(1, 4), states=[state.clone()])
    state.fill_(20)
    pc.insert(a, torch.ones(1, 4))
    state.zero_()
    assert pc.match(a[:18] + [99]).length == 16
    m = pc.match(a + [99])
    assert m.length == 20
    pc.restore(m, m.length)
    assert state.tolist() == [20.0] * 3
    assert pc.match(a[:15]).length == 0


def test_tree_lru_eviction_keeps_the_locked_path():
    pc, rows, _ = _tree(exact=True, max_snaps=2)
    for first in (40, 41, 42):
        seq = [first] + list(range(5))
        _fill(rows, seq)
        pc.insert(seq, torch.ones(1, 2))
    assert pc.num_snapshots == 2
    assert pc.match([40, 0, 1, 2, 3, 4]).length == 0  # the oldest went
    assert pc.match([42, 0, 1, 2, 3, 4]).length == 6
    pc.match([41, 0, 1, 2, 3, 4])
    pc.restore(pc.match([41, 0, 1, 2, 3, 4]), 6)  # touched: now the newest
    _fill(rows, [43, 0])
    pc.insert([43, 0], torch.ones(1, 2))
    assert pc.match([42, 0, 1, 2, 3, 4]).length == 0 and pc.match([41, 0, 1, 2, 3, 4]).length == 6


# ---- engines ----


def _spec(mode: str, arch: str, llama_nextn_path: str, draft_paths: dict) -> SpecConfig:
    if mode == "plain":
        return SpecConfig(adaptive=False)
    if mode == "nextn":
        extra = {} if arch == "ling" else {"draft_model_path": llama_nextn_path}
        return SpecConfig(algorithm="NEXTN", num_steps=3, adaptive=False, **extra)
    return SpecConfig(algorithm="DSPARK", draft_model_path=draft_paths[arch], num_draft_tokens=5, adaptive=False)


def _engine(path: str, spec: SpecConfig, **kw) -> Engine:
    return Engine(ServerArgs(model_path=path, device="cpu", context_length=256, prefix_snapshot_stride=STRIDE,
                             spec=spec, **kw))


def _run(engine: Engine, prompt: list[int], max_new_tokens: int = 12, **sp) -> tuple[list[int], int]:
    params = SamplingParams(temperature=sp.pop("temperature", 0.0), max_new_tokens=max_new_tokens, ignore_eos=True,
                            **sp)
    tokens, cached = [], None
    for out in engine.generate(Request(list(prompt), params)):
        tokens.extend(out.token_ids)
        cached = out.cached_tokens if cached is None else cached
    return tokens, cached


def _deepest_key(engine: Engine) -> list[int]:
    """The token key of the most recently recorded leaf (the end of the last request)."""
    pc = engine.prefix_cache
    leaf = max((n for n in pc._nodes() if not n.children), key=lambda n: n.last_used)
    key = []
    while leaf is not pc.root:
        key = leaf.key + key
        leaf = leaf.parent
    return key


MODES = [("ling", "plain"), ("llama", "plain"), ("ling", "nextn"), ("llama", "nextn"), ("ling", "dspark"),
         ("llama", "dspark")]


@pytest.mark.parametrize("arch,mode", MODES)
def test_greedy_with_a_hit_equals_an_empty_cache(arch, mode, ling_path, llama_path, llama_nextn_path, draft_paths):
    path = ling_path if arch == "ling" else llama_path
    spec = _spec(mode, arch, llama_nextn_path, draft_paths)
    cold = _engine(path, spec, disable_radix_cache=True)
    assert cold.prefix_cache is None
    warm = _engine(path, spec)
    exact = warm.prefix_cache.exact
    assert exact == (arch == "ling" or mode == "nextn")

    first, cached = _run(warm, PROMPT)
    assert cached == 0 and first == _run(cold, PROMPT)[0]
    end_key = _deepest_key(warm)
    assert len(end_key) >= len(PROMPT) + len(first) - 1

    cases = {
        "boundary": PROMPT[:32] + [7, 9, 11],  # exact: restores the snapshot at 32
        "between": PROMPT[:24] + [13, 17],  # exact: the snapshot at 16; attention only: 24 rows
        "prompt_end": PROMPT + [19, 23, 29],  # the end-of-prompt snapshot (exact), the prompt's rows
        "request_end": end_key + [31, 37],  # the end of the previous request
        "answer_resent": PROMPT + first + [41, 43],  # the next turn: the prompt, the answer the client saw, more
        "same": PROMPT,  # the whole prompt cached
    }
    expect_cached = {"boundary": 32, "between": 16 if exact else 24, "prompt_end": 40,
                     "request_end": len(end_key), "answer_resent": len(PROMPT) + len(first),
                     "same": 40 if exact else 39}
    for name, prompt in cases.items():
        got, cached = _run(warm, prompt)
        assert cached == expect_cached[name], name
        assert got == _run(cold, prompt)[0], name
    stats = warm.prefix_cache_info()
    assert stats["prefix_cache_hit_rate"] > 0.5 and stats["prefix_cache_hits"] == len(cases)


@pytest.mark.parametrize("arch", ["ling", "llama"])
def test_sampled_requests_leave_no_trace(arch, ling_path, llama_path):
    path = ling_path if arch == "ling" else llama_path
    engine = _engine(path, SpecConfig(algorithm="NEXTN", num_steps=3, adaptive=False) if arch == "ling"
                     else SpecConfig(adaptive=False))
    greedy, _ = _run(engine, PROMPT, max_new_tokens=16)
    for seed in (1, 2):
        _run(engine, PROMPT + [3, 5], max_new_tokens=16, temperature=1.0, seed=seed)
        _run(engine, PROMPT, max_new_tokens=16, temperature=0.8, top_k=5, seed=seed)
    again, cached = _run(engine, PROMPT, max_new_tokens=16)
    assert cached > 0 and again == greedy


def test_eviction_under_a_tiny_budget(ling_path):
    cold = _engine(ling_path, SpecConfig(adaptive=False), disable_radix_cache=True)
    engine = _engine(ling_path, SpecConfig(adaptive=False), max_mamba_cache_size=3, max_total_tokens=120)
    prompts = [[2 + (i * 11 + 3 * j) % 90 for j in range(36)] for i in range(5)]
    for p in prompts:
        out, _ = _run(engine, p)
        pc = engine.prefix_cache
        assert pc.num_snapshots <= 3 and pc.total_tokens <= 120
        assert out == _run(cold, p)[0]
    assert engine.prefix_cache.match(prompts[0] + [5]).length == 0  # the oldest was evicted
    out, cached = _run(engine, prompts[-1] + [5, 6])
    assert cached > 0 and out == _run(cold, prompts[-1] + [5, 6])[0]


def test_flush_cache_forgets_everything(llama_path):
    engine = _engine(llama_path, SpecConfig(adaptive=False))
    _run(engine, PROMPT)
    assert _run(engine, PROMPT)[1] == 39
    engine.flush_cache()
    assert engine.prefix_cache.total_tokens == 0 and engine.prefix_cache_info()["prefix_cache_requests"] == 0
    assert _run(engine, PROMPT)[1] == 0
