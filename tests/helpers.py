"""Helpers shared by tests: build tiny models, run full / incremental forwards."""

from __future__ import annotations

import os

import torch
from safetensors.torch import load_file

from baton.config import parse_model_config
from baton.layers.context import ModelRunner
from baton.models.build import build_model
from baton.models.checkpoint import init_dummy_weights
from baton.types import ForwardMode


def tiny_model(cfg_dict: dict, seed: int = 0, **overrides):
    cfg = parse_model_config({**cfg_dict, **overrides})
    model = build_model(cfg, "cpu", torch.float32)
    init_dummy_weights(model, seed)
    return model


def _runner(model, length: int) -> ModelRunner:
    p = next(model.parameters())
    return ModelRunner(model.make_cache(length, p.dtype, p.device), p.device)


def full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    runner = _runner(model, ids.shape[0] + 8)
    with torch.inference_mode():
        ctx = runner.context(ForwardMode.PREFILL, 0, ids.shape[0])
        return model.compute_logits(model(ids, ctx))


def incremental_logits(model, ids: torch.Tensor, prefill_len: int) -> torch.Tensor:
    runner = _runner(model, ids.shape[0] + 8)
    outs = []
    with torch.inference_mode():
        ctx = runner.context(ForwardMode.PREFILL, 0, prefill_len)
        outs.append(model.compute_logits(model(ids[:prefill_len], ctx)))
        for t in range(prefill_len, ids.shape[0]):
            ctx = runner.context(ForwardMode.DECODE, t, 1)
            outs.append(model.compute_logits(model(ids[t : t + 1], ctx)))
    return torch.cat(outs)


def record_figure(name: str, **values) -> None:
    """Append a measured figure (e.g. a GPU-vs-CPU error) as one JSON line to $BATON_TEST_REPORT, when set:
    the GPU tests' numbers reach the results folder this way (pytest-xdist swallows prints)."""
    import json
    import os

    path = os.environ.get("BATON_TEST_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": name, **values}) + "\n")


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of the safetensors files in a checkpoint folder, by name."""
    out = {}
    for fn in os.listdir(path):
        if fn.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, fn)))
    return out
