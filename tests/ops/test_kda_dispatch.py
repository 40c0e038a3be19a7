"""The KDA prefill dispatch says, once and with what to do, when fla-core's chunk_kda cannot be imported (it took
the PyTorch chunked form silently once, on a GPU machine without einops: a 15x slower 8192-token prefill)."""

from __future__ import annotations

import builtins
import logging
import sys

import pytest

from baton.ops import kda


@pytest.fixture
def said(caplog):
    """The warnings of baton.ops.kda while the test runs, with the cached lookup of chunk_kda cleared around it."""
    kda._fla_chunk.cache_clear()
    with caplog.at_level(logging.WARNING, logger="baton.ops.kda"):
        yield lambda: [r.getMessage() for r in caplog.records if r.name == "baton.ops.kda"]
    kda._fla_chunk.cache_clear()


def test_missing_fla_is_said_once_with_the_fix(monkeypatch, said):
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)  # import of fla.ops.kda fails: ModuleNotFoundError
    assert kda._fla_chunk() is None
    assert kda._fla_chunk() is None  # cached: said once
    assert len(said()) == 1
    assert "falls back to the PyTorch chunked form" in said()[0] and "pip install 'baton[gpu]'" in said()[0]


def test_a_missing_dependency_of_fla_names_it(monkeypatch, said):
    real_import = builtins.__import__

    def failing_import(name, *args, **kwargs):
        if name.startswith("fla"):
            raise ModuleNotFoundError("No module named 'einops'", name="einops")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", failing_import)
    assert kda._fla_chunk() is None
    assert len(said()) == 1 and "pip install einops" in said()[0]
