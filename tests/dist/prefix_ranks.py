"""What rank 0 runs in the prefix-cache tensor-parallel test (module level, so that it pickles)."""

from __future__ import annotations

from baton.types import Request, SamplingParams


def generate_cached(engine, requests: list[tuple[list[int], dict]]) -> list[tuple[list[int], int]]:
    """Each (prompt ids, SamplingParams kwargs) in turn, the cache kept between them: (tokens, cached tokens)."""
    out = []
    for ids, kwargs in requests:
        tokens, cached = [], None
        for o in engine.generate(Request(list(ids), SamplingParams(**kwargs))):
            tokens += o.token_ids
            cached = o.cached_tokens if cached is None else cached
        out.append((tokens, cached))
    engine.flush_cache()
    return out
