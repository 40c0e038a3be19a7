"""KDA recurrent and short-conv states for one sequence, with per-position staging for speculative verify.

During verify the persistent state is read but not written; the state after each chain position goes to
``staged_*[t]``. After the verdict, ``commit(index)`` copies the staged state of the last accepted position
into the persistent slot. ``index`` is a device tensor, so the commit needs no host round trip.
"""

from __future__ import annotations

import torch


class KDAState:
    def __init__(self, num_heads: int, head_k_dim: int, head_v_dim: int, conv_dim: int, conv_width: int,
                 max_stage: int, conv_dtype: torch.dtype, device: torch.device | str) -> None:
        h, k, v, w = num_heads, head_k_dim, head_v_dim, conv_width - 1
        self.recurrent = torch.zeros(h, k, v, dtype=torch.float32, device=device)  # [H, K, V]
        self.conv = torch.zeros(conv_dim, w, dtype=conv_dtype, device=device)  # [3P, W-1]
        self.max_stage = max_stage
        self.staged_recurrent = torch.zeros(max_stage, h, k, v, dtype=torch.float32, device=device)
        self.staged_conv = torch.zeros(max_stage, conv_dim, w, dtype=conv_dtype, device=device)

    def stage(self, recurrent_states: torch.Tensor, conv_states: torch.Tensor) -> None:
        """Write the per-position post-states of a verify forward ([T, ...] each)."""
        t = recurrent_states.shape[0]
        if t > self.max_stage:
            raise ValueError(f"verify of {t} tokens exceeds the staging depth {self.max_stage}")
        self.staged_recurrent[:t].copy_(recurrent_states)
        self.staged_conv[:t].copy_(conv_states)

    def commit(self, index: torch.Tensor) -> None:
        """Make the staged state at position ``index`` (0-d or [1] int64 device tensor) persistent."""
        idx = index.reshape(1)
        self.recurrent.copy_(self.staged_recurrent.index_select(0, idx)[0])
        self.conv.copy_(self.staged_conv.index_select(0, idx)[0])

    def reset(self) -> None:
        self.recurrent.zero_()
        self.conv.zero_()

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.recurrent, self.conv, self.staged_recurrent, self.staged_conv))
