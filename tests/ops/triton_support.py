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


def assert_graph_replays_without_sync(step) -> None:
    """``step()`` (CUDA tensors in, one tensor out) captured in a CUDA graph under sync-debug "error" (any host
    sync raises), after a warm-up run on a side stream; its replay equals the eager result bit for bit."""
    expected = step()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
