"""Fixtures for speculative-decoding tests: tiny target checkpoints on disk and engines built from them."""

from __future__ import annotations

import json

import pytest

from baton.cli import main as baton_main
from baton.config import ServerArgs, SpecConfig
from baton.engine.engine import Engine
from tests.conftest import TINY_LING, TINY_LLAMA


def write_checkpoint(root, name: str, cfg: dict) -> str:
    cfg_path = root / f"{name}.config.json"
    cfg_path.write_text(json.dumps(cfg))
    out = str(root / name)
    assert baton_main(["convert", "random-checkpoint", "--config", str(cfg_path), "--output", out]) == 0
    return out


@pytest.fixture(scope="session")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("spec_ckpts")


@pytest.fixture(scope="session")
def ling_path(ckpt_root) -> str:
    return write_checkpoint(ckpt_root, "ling", TINY_LING)


@pytest.fixture(scope="session")
def llama_path(ckpt_root) -> str:
    return write_checkpoint(ckpt_root, "llama", TINY_LLAMA)


@pytest.fixture(scope="session")
def llama_nextn_path(ckpt_root, llama_path) -> str:
    out = str(ckpt_root / "llama_nextn")
    assert baton_main(["convert", "random-draft", "--target", llama_path, "--algorithm", "NEXTN",
                       "--output", out]) == 0
    return out


def make_engine(model_path: str, **spec) -> Engine:
    return Engine(ServerArgs(model_path=model_path, device="cpu", context_length=512, spec=SpecConfig(**spec)))
