"""Fixtures for speculative-decoding tests: tiny target checkpoints on disk and engines built from them."""

from __future__ import annotations

import json

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
    return Engine(ServerArgs(model_path=model_path, device="cpu", context_length=512, spec=SpecConfig(**spec)))
