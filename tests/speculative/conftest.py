"""Fixtures for speculative-decoding tests: tiny target checkpoints on disk and engines built from them."""

from __future__ import annotations

import json

import pytest

from baton.cli import main as baton_main
from baton.config import ServerArgs, SpecConfig
from baton.engine.engine import Engine


def write_checkpoint(root, name: str, cfg: dict) -> str:
    cfg_path = root / f"{name}.config.json"
    cfg_path.write_text(json.dumps(cfg))
    out = str(root / name)
    assert baton_main(["convert", "random-checkpoint", "--config", str(cfg_path), "--output", out]) == 0
    return out


def make_engine(model_path: str, **spec) -> Engine:
    return Engine(ServerArgs(model_path=model_path, device="cpu", context_length=512,
                             spec=SpecConfig(**{"adaptive": False, **spec})))


@pytest.fixture(scope="module")
def plain(ling_path, llama_path) -> dict[str, list[int]]:
    """Plain greedy decoding of ``test_spec_core.PROMPT`` on the tiny Ling and Llama targets: what every greedy
    speculative run must reproduce."""
    from tests.speculative.test_spec_core import run  # (that module imports this one)

    return {name: run(make_engine(path))[0] for name, path in (("ling", ling_path), ("llama", llama_path))}
