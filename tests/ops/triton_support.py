"""Helpers for the Triton kernel tests: run the kernels in Triton's interpreter on CPU-only machines."""

from __future__ import annotations

import importlib
import os

import pytest
import torch

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _interpreter_loops() -> None:
    """Triton 3.6's interpreter keeps scalars as 1-element arrays and converts them with ``int(array)``, which
    NumPy >= 2.3 refuses: loops with a run-time bound (``range(start, end)`` over loaded values) then fail.
    Take the element instead. No effect on compiled kernels."""
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang_tensor, "_baton_index_fix", False):
        return
    original = interpreter._patch_lang_tensor

    def patched(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._baton_index_fix = True
    interpreter._patch_lang_tensor = patched


def load_triton_module(name: str):
    """The Triton module, re-imported if something loaded it before TRITON_INTERPRET was set."""
    mod = importlib.import_module(name)
    if DEV == "cpu":
        _interpreter_loops()
        if not any(type(v).__name__ == "InterpretedFunction" for v in vars(mod).values()):
            mod = importlib.reload(mod)
    return mod


def interpreted_module(name: str):
    """``load_triton_module`` for a test module that imports Triton lazily: on a CPU-only machine the interpreter is
    switched on first (``TRITON_INTERPRET=1``); without triton installed the test is skipped."""
    if DEV == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    pytest.importorskip("triton")
    return load_triton_module(name)
