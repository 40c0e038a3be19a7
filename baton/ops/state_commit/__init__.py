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

import torch

from baton.ops.attention import triton_module

__all__ = ["StagedCommit", "commit_reference"]


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
        impl = triton_module("baton.ops.state_commit.triton", pairs[0][1]) if pairs else None
        if impl is not None and all(impl.supports(s, d) for s, d in pairs):
            self._kernel = impl.CommitTables(pairs)

    def __call__(self, index: torch.Tensor) -> None:
        if not self.pairs:
            return
        if self._kernel is not None:
            self._kernel(index)
        else:
            commit_reference(self.pairs, index)
