"""The commit of a speculative verify's staged linear-attention states, every layer in one launch.

After the verdict each KDA layer copies the staged state of the last accepted chain position (``staged[index]``,
``index`` a device value) into its persistent slot, for its recurrent state (fp32 [H, K, V]) and its short-conv
window. Per layer in PyTorch that is an ``index_select`` into a temporary and a ``copy_``: four kernels a layer
(140 a Ling-3.0-flash step) and twice the bytes. ``StagedCommit`` gathers every layer's (staged, persistent)
pairs once; on CUDA with Triton it copies all of them in one kernel per dtype, reading ``index`` on the device
(``triton.py``: a table of base addresses, so it is safe in CUDA-graph capture and replays for any index).
Everywhere else (CPU, no Triton) it runs the plain-PyTorch reference, the per-layer copies.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from baton.env import use_triton

__all__ = ["StagedCommit", "commit_reference"]


@functools.cache
def _triton_impl() -> Any:
    try:
        from baton.ops.state_commit import triton as impl
    except ImportError:
        return None
    return impl


def commit_reference(pairs: list[tuple[torch.Tensor, torch.Tensor]], index: torch.Tensor) -> None:
    """``dst.copy_(staged[index])`` for every (staged [S, ...], dst [...]) pair; index: 0-d or [1] int tensor."""
    idx = index.reshape(1).long()
    for staged, dst in pairs:
        dst.copy_(staged.index_select(0, idx)[0])


class StagedCommit:
    """Every (staged, persistent) pair of a model's caches, committed together."""

    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for staged, dst in pairs:
            if staged.shape[1:] != dst.shape or staged.dtype != dst.dtype or staged.device != dst.device:
                raise ValueError(f"staged {tuple(staged.shape)} {staged.dtype} does not stage {tuple(dst.shape)} "
                                 f"{dst.dtype}")
        self.pairs = pairs
        self._kernel = None
        device = pairs[0][1].device if pairs else torch.device("cpu")
        if device.type == "cuda" and use_triton() and _triton_impl() is not None:
            if all(_triton_impl().supports(s, d) for s, d in pairs):
                self._kernel = _triton_impl().CommitTables(pairs)

    def __call__(self, index: torch.Tensor) -> None:
        if not self.pairs:
            return
        if self._kernel is not None:
            self._kernel(index)
        else:
            commit_reference(self.pairs, index)
