"""The KDA prefill dispatch says, once and with what to do, when fla-core's chunk_kda cannot be imported (it took
the PyTorch chunked form silently once, on a GPU machine without einops: a 15x slower 8192-token prefill)."""

from __future__ import annotations

import logging
import sys

from baton.ops import kda


def test_missing_fla_is_said_once_with_the_fix(monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "fla.ops.kda", None)  # import of fla.ops.kda fails: ModuleNotFoundError
    kda._fla_chunk.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="baton.ops.kda"):
            assert kda._fla_chunk() is None
            assert kda._fla_chunk() is None  # cached: said once
        said = [r.getMessage() for r in caplog.records if r.name == "baton.ops.kda"]
        assert len(said) == 1
        assert "falls back to the PyTorch chunked form" in said[0] and "pip install 'baton[gpu]'" in said[0]
    finally:
        kda._fla_chunk.cache_clear()


def test_a_missing_dependency_of_fla_names_it(monkeypatch, caplog):
    err = ModuleNotFoundError("No module named 'einops'", name="einops")

    def failing_import(name, *args, **kwargs):
        if name.startswith("fla"):
            raise err
        return real_import(name, *args, **kwargs)

    import builtins
    real_import = builtins.__import__
    monkeypatch.setattr(builtins, "__import__", failing_import)
    kda._fla_chunk.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="baton.ops.kda"):
            assert kda._fla_chunk() is None
        said = [r.getMessage() for r in caplog.records if r.name == "baton.ops.kda"]
        assert len(said) == 1 and "pip install einops" in said[0]
    finally:
        monkeypatch.undo()
        kda._fla_chunk.cache_clear()
