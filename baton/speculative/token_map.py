"""The drafts' hot vocabulary (``--speculative-token-map``, SGLang's flag; the idea is FR-Spec's): the token ids a
drafter may propose. A NEXTN (or DFlash) draft is an argmax over the lm_head, the largest read of a draft step
(SmolLM2: 49,152 rows of 576, against one decoder layer of ~4 M weights); over a few thousand frequent tokens it
reads a fraction of that. The verify keeps the whole vocabulary, so greedy output is the same token for token;
a draft outside the map is simply never proposed.

A map is a file of token ids: ``.pt`` (``torch.save`` of a list or 1-D tensor, SGLang's format) or ``.json`` (a
list, or an object with ``"token_ids"``). ``baton train token-map`` makes one from the target's own responses
(the draft training data, ``baton train data``): the ``--size`` most frequent response tokens, then the lowest
ids (the tokenizer's specials and its first merges) until the size is reached.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

import torch

from baton.config import ConfigError


def load_token_map(path: str) -> torch.Tensor:
    """The ids of a token-map file, int64 [N] (order as stored; the model sorts and deduplicates)."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"--speculative-token-map {path}: no such file")
    try:
        if p.suffix == ".json":
            data = json.loads(p.read_text())
            if isinstance(data, dict):
                data = data["token_ids"]
        else:
            data = torch.load(p, map_location="cpu", weights_only=True)
        ids = torch.as_tensor(data, dtype=torch.int64).reshape(-1)
    except (ValueError, KeyError, TypeError, RuntimeError, json.JSONDecodeError) as e:
        raise ConfigError(f"--speculative-token-map {path}: not a list of token ids ({type(e).__name__}: {e}); "
                          "write one with `baton train token-map`") from e
    if ids.numel() == 0:
        raise ConfigError(f"--speculative-token-map {path}: no token ids")
    return ids


def build_token_map(responses: Iterable[Iterable[int]], size: int, vocab_size: int) -> tuple[list[int], float]:
    """The ``size`` most frequent ids over ``responses`` (ties: the lower id), filled up with the lowest ids not
    yet in it; and the share of the response tokens the map covers."""
    counts: Counter[int] = Counter()
    for ids in responses:
        counts.update(int(i) for i in ids)
    size = min(size, vocab_size)
    top = [i for i, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if 0 <= i < vocab_size][:size]
    chosen = set(top)
    fill = (i for i in range(vocab_size) if i not in chosen)
    while len(chosen) < size:
        chosen.add(next(fill))
    total = sum(counts.values())
    covered = sum(c for i, c in counts.items() if i in chosen)
    return sorted(chosen), (covered / total if total else 1.0)


def save_token_map(ids: list[int], path: str) -> None:
    if path.endswith(".json"):
        Path(path).write_text(json.dumps(ids))
    else:
        torch.save(torch.tensor(ids, dtype=torch.int64), path)


__all__ = ["build_token_map", "load_token_map", "save_token_map"]
