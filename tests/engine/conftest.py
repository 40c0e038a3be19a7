"""Fixtures of the engine tests: random DSpark drafts for the tiny Ling and Llama (the prefix-cache tests, CPU and
GPU)."""

from __future__ import annotations

import pytest

from baton.config import load_model_config
from baton.models.dspark_checkpoint import write_random_dspark_draft


@pytest.fixture(scope="module")
def draft_paths(tmp_path_factory, ling_path, llama_path) -> dict[str, str]:
    root = tmp_path_factory.mktemp("prefix_drafts")
    out = {}
    for arch, path in (("ling", ling_path), ("llama", llama_path)):
        out[arch] = str(root / arch)
        write_random_dspark_draft(load_model_config(path), out[arch], seed=1, block_size=4, num_layers=2,
                                  markov_rank=16)
    return out
