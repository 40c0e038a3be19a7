"""Bias-free linear layers, fused projections whose weight stacks several checkpoint tensors by rows, and their
tensor-parallel forms.

``FusedLinear`` keeps the checkpoint names of its parts in ``hf_row_splits`` so that loading and saving see
the published layout (e.g. q_proj / k_proj / v_proj) while the forward runs one GEMV.

Tensor parallelism is by construction: a module is built with this rank's local shapes (``baton.dist`` says
which rank of how many) and records, for each sharded parameter, the ``Shard`` of the checkpoint tensor it
holds, which ``baton.models.loader.hf_layout`` turns into slices. Column-parallel weights hold a block of rows
(output features: heads, intermediate channels), row-parallel weights a block of columns (input features);
a row-parallel projection's partial output is summed over ranks, with the residual added on rank 0 only.
At one rank every class here is exactly the plain layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton import dist
from baton.config import ConfigError
from baton.ops.linear import linear


@dataclass(frozen=True)
class Shard:
    """This rank's block of a checkpoint tensor along ``dim``: ``[rank * n, rank * n + valid)`` where ``n`` is the
    local extent of the parameter (or part), ``valid`` the rows that exist (vocab padding; default ``n``) and
    ``full`` the checkpoint tensor's extent (default ``n * size``)."""

    dim: int
    rank: int
    size: int
    valid: int | None = None
    full: int | None = None


def shard_count(total: int, what: str) -> int:
    """``total / tp_size``; a ConfigError naming ``what`` when it does not divide."""
    size = dist.tp_size()
    if total % size:
        raise ConfigError(f"{what} ({total}) is not divisible by --tp-size {size}")
    return total // size


def local_shard(dim: int) -> Shard | None:
    """This rank's Shard along ``dim``, None at one rank."""
    return Shard(dim, dist.tp_rank(), dist.tp_size()) if dist.tp_size() > 1 else None


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose weight is ``[out, in]``, as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None) -> None:
        super().__init__(in_features, out_features, bias=False, device=device, dtype=dtype)


class FusedLinear(Linear):
    """Rows of several checkpoint projections stacked: ``parts`` is [(checkpoint name, rows), ...], the names
    relative to this module's parent (e.g. "q_proj" for ``...self_attn.q_proj.weight``) and the rows those of
    the checkpoint tensor. Under TP each part is column-parallel (this rank holds a contiguous block of its
    rows) except those named in ``replicated``, which every rank holds whole."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], device=None, dtype=None,
                 replicated: tuple[str, ...] = ()) -> None:
        local = [(name, rows if name in replicated else shard_count(rows, name)) for name, rows in parts]
        super().__init__(in_features, sum(rows for _, rows in local), device=device, dtype=dtype)
        self.parts = local
        shard = local_shard(0)
        self.hf_row_splits = {"weight": [(f"{name}.weight", rows, None if name in replicated else shard)
                                         for name, rows in local]}

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split([rows for _, rows in self.parts], dim=-1)


class ColumnParallelLinear(Linear):
    """``out_features`` (the checkpoint's) split over ranks: this rank computes a block of the outputs."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, what: str = "out_features"):
        super().__init__(in_features, shard_count(out_features, what), device=device, dtype=dtype)
        if dist.tp_size() > 1:
            self.tp_shards = {"weight": local_shard(0)}


class RowParallelLinear(Linear):
    """``in_features`` (the checkpoint's) split over ranks: this rank multiplies its block of the input and the
    partial outputs are summed over ranks (``project``)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, what: str = "in_features"):
        super().__init__(shard_count(in_features, what), out_features, device=device, dtype=dtype)
        self.tp_rank, self.tp_size = dist.tp_rank(), dist.tp_size()
        if self.tp_size > 1:
            self.tp_shards = {"weight": local_shard(1)}

    def project(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
        """``[residual +] x @ W.T`` summed over ranks; ``reduce=False`` leaves the partial sum (the caller adds
        more partials and reduces once). The residual is added on rank 0 only, so it counts once."""
        if self.tp_size == 1:
            return linear(x, self.weight, residual=residual)
        y = linear(x, self.weight, residual=residual if self.tp_rank == 0 else None)
        return dist.all_reduce(y) if reduce else y
