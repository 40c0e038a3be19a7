"""Bias-free linear layers, fused projections whose weight stacks several checkpoint tensors by rows, and their
tensor-parallel forms.

``FusedLinear`` keeps the checkpoint names of its parts in ``hf_row_splits`` so that loading and saving see
the published layout (e.g. q_proj / k_proj / v_proj) while the forward runs one GEMV.

Tensor parallelism is by construction: a module is built with this rank's local shapes (``baton.dist`` says
which rank of how many) and records, for each sharded parameter, the ``Shard`` of the checkpoint tensor it
holds, which ``baton.models.checkpoint.hf_layout`` turns into slices. Column-parallel weights hold a block of rows
(output features: heads, intermediate channels), row-parallel weights a block of columns (input features);
a row-parallel projection's partial output is summed over ranks, with the residual added on rank 0 only.
At one rank every class here is exactly the plain layer.

fp8 (``--quantization fp8``, ``fp8=True``): the weight is float8_e4m3fn with fp32 ``weight_scale_inv`` 128 x 128
block scales, each checkpoint tensor (part of a fused weight; this rank's block of it) quantised on its own, as the
published fp8 checkpoints store them: ``weight_scale_inv`` stacks the parts' scale blocks, and ``weight_row_block``
(a buffer, only when some part but the last is not a multiple of 128 rows) names each weight row's scale row.
``linear`` / ``linear_swiglu`` / ``forward`` dispatch on the weight: ``baton.ops.linear`` or ``baton.ops.fp8_linear``
with the same fusions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from baton import dist
from baton.config import ConfigError
from baton.ops.fp8_linear import fp8_dense_linear, fp8_dense_linear_swiglu
from baton.ops.linear import linear, linear_swiglu, swiglu
from baton.ops.quant import FP8_DTYPE, part_blocks, row_block_map
from baton.ops.quant.fp8 import BLOCK as FP8_BLOCK


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
    """``nn.Linear`` without bias whose weight is ``[out, in]``, as in Hugging Face checkpoints; ``fp8``: the weight in
    e4m3 with 128 x 128 block scales (``weight_scale_inv``); ``qweight``: a GGUF block-quantized weight in place of
    ``weight`` (``quantize_weight_``, the CPU path of the embedded model)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, fp8: bool = False,
                 rows: list[int] | None = None) -> None:
        """``rows``: the row parts (checkpoint tensors) of a fused weight, each quantised on its own under fp8."""
        super().__init__(in_features, out_features, bias=False, device="meta" if fp8 else device, dtype=dtype)
        self.fp8 = fp8
        self.act_fp8 = False  # fp8: w8a8 (the rows quantised per token and 128 columns; models/build.py sets it)
        if fp8:
            rows = rows or [out_features]
            self.weight = nn.Parameter(torch.empty(out_features, in_features, device=device, dtype=FP8_DTYPE),
                                       requires_grad=False)
            nk = -(-in_features // FP8_BLOCK)
            self.weight_scale_inv = nn.Parameter(torch.empty(part_blocks(rows), nk, device=device,
                                                             dtype=torch.float32), requires_grad=False)
            self._row_parts = list(rows)
            rb = None
            if row_block_map(rows) is not None:
                rb = torch.empty(out_features, device=device, dtype=torch.int32)
            self.register_buffer("weight_row_block", rb, persistent=False)
            self.reset_padding()

    def reset_padding(self) -> None:
        """Recompute ``weight_row_block`` (after materialising from the meta device)."""
        rb = getattr(self, "weight_row_block", None)
        if rb is not None and rb.device.type != "meta":
            with torch.no_grad():
                rb.copy_(torch.tensor(row_block_map(self._row_parts), dtype=torch.int32))

    def linear(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] (rms_norm(x) if norm_weight else x) @ W.T`` (``baton.ops.linear.linear``)."""
        qweight = quantized(self)
        if qweight is not None:
            return qweight.linear(x, norm_weight, eps, residual)
        if self.fp8:
            return fp8_dense_linear(x, self.weight, self.weight_scale_inv, self.weight_row_block, norm_weight, eps,
                                    residual, act_fp8=self.act_fp8)
        return linear(x, self.weight, norm_weight, eps, residual)

    def linear_swiglu(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
                      limit: float = 0.0) -> torch.Tensor:
        """``swiglu((rms_norm(x) if norm_weight else x) @ W.T, limit)``, W holding gate rows then up rows."""
        qweight = quantized(self)
        if qweight is not None:
            return swiglu(qweight.linear(x, norm_weight, eps), limit)
        if self.fp8:
            return fp8_dense_linear_swiglu(x, self.weight, self.weight_scale_inv, self.weight_row_block, norm_weight,
                                           eps, limit, act_fp8=self.act_fp8)
        return linear_swiglu(x, self.weight, norm_weight, eps, limit)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8 or quantized(self) is not None:
            return self.linear(x)
        return super().forward(x)

    def extra_repr(self) -> str:
        return super().extra_repr() + (", fp8" if self.fp8 else "") + (" w8a8" if self.act_fp8 else "")


def _fp8_row_splits(parts: list[tuple[str, int, Shard | None]]) -> list[tuple[str, int, Shard | None]]:
    """The scale rows of fp8 row parts: each part's ceil(rows / 128) blocks, sharded like the part."""
    return [(f"{name[: -len('.weight')]}.weight_scale_inv", -(-rows // FP8_BLOCK), shard)
            for name, rows, shard in parts]


class FusedLinear(Linear):
    """Rows of several checkpoint projections stacked: ``parts`` is [(checkpoint name, rows), ...], the names
    relative to this module's parent (e.g. "q_proj" for ``...self_attn.q_proj.weight``) and the rows those of
    the checkpoint tensor. Under TP each part is column-parallel (this rank holds a contiguous block of its
    rows) except those named in ``replicated``, which every rank holds whole."""

    def __init__(self, in_features: int, parts: list[tuple[str, int]], device=None, dtype=None,
                 replicated: tuple[str, ...] = (), fp8: bool = False) -> None:
        local = [(name, rows if name in replicated else shard_count(rows, name)) for name, rows in parts]
        super().__init__(in_features, sum(rows for _, rows in local), device=device, dtype=dtype, fp8=fp8,
                         rows=[rows for _, rows in local])
        self.parts = local
        shard = local_shard(0)
        self.hf_row_splits = {"weight": [(f"{name}.weight", rows, None if name in replicated else shard)
                                         for name, rows in local]}
        if fp8:
            self.hf_row_splits["weight_scale_inv"] = _fp8_row_splits(self.hf_row_splits["weight"])

    def split(self, y: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return y.split([rows for _, rows in self.parts], dim=-1)


class ColumnParallelLinear(Linear):
    """``out_features`` (the checkpoint's) split over ranks: this rank computes a block of the outputs."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, what: str = "out_features",
                 fp8: bool = False):
        super().__init__(in_features, shard_count(out_features, what), device=device, dtype=dtype, fp8=fp8)
        if dist.tp_size() > 1:
            self.tp_shards = {"weight": local_shard(0), "weight_scale_inv": local_shard(0)}


class RowParallelLinear(Linear):
    """``in_features`` (the checkpoint's) split over ranks: this rank multiplies its block of the input and the
    partial outputs are summed over ranks (``project``)."""

    def __init__(self, in_features: int, out_features: int, device=None, dtype=None, what: str = "in_features",
                 fp8: bool = False):
        super().__init__(shard_count(in_features, what), out_features, device=device, dtype=dtype, fp8=fp8)
        self.tp_rank, self.tp_size = dist.tp_rank(), dist.tp_size()
        if self.tp_size > 1:
            self.tp_shards = {"weight": local_shard(1), "weight_scale_inv": local_shard(1)}

    def project(self, x: torch.Tensor, residual: torch.Tensor | None = None, reduce: bool = True) -> torch.Tensor:
        """``[residual +] x @ W.T`` summed over ranks; ``reduce=False`` leaves the partial sum (the caller adds
        more partials and reduces once). The residual is added on rank 0 only, so it counts once."""
        if self.tp_size == 1:
            return self.linear(x, residual=residual)
        y = self.linear(x, residual=residual if self.tp_rank == 0 else None)
        return dist.all_reduce(y) if reduce else y


class QuantizedWeight(nn.Module):
    """A [N, K] weight kept in a GGUF block format on the CPU (``baton.ops.quant_cpu``): ``fmt`` "q4_1" or "q8_0",
    the file's bytes regrouped once at load into the x4 layout of ``baton.ops.quant_cpu.naive`` (buffer ``packed``
    uint8 [ceil(N/4), K/32 * 80 or 136]: the same bytes per weight as the file). ``matmul`` computes in fp32 from the
    exact dequantised values; no fp32 copy of the matrix is kept."""

    FORMATS = ("q4_1", "q8_0")

    def __init__(self, fmt: str, packed: torch.Tensor, n: int) -> None:
        super().__init__()
        from baton.ops.quant_cpu.naive import X4_BYTES

        if fmt not in self.FORMATS:
            raise ConfigError(f"quantized weight format {fmt!r}: choose one of {', '.join(self.FORMATS)}")
        if packed.dtype != torch.uint8 or packed.dim() != 2 or packed.shape[1] % X4_BYTES[fmt] or \
                packed.shape[0] != -(-n // 4):
            raise ConfigError(f"{fmt} weight of {n} rows: packed {list(packed.shape)} {packed.dtype} is not its "
                              "x4 layout")
        self.fmt = fmt
        self.register_buffer("packed", packed.contiguous())
        self.shape = (n, packed.shape[1] // X4_BYTES[fmt] * 32)

    @classmethod
    def from_gguf(cls, fmt: str, raw: torch.Tensor) -> QuantizedWeight:
        """From the file's block rows (uint8 [N, row_bytes])."""
        from baton.ops import quant_cpu

        return cls(fmt, quant_cpu.pack(fmt, raw), raw.shape[0])

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., K] -> fp32 [..., N] = x @ dequantize().T."""
        from baton.ops import quant_cpu

        y = quant_cpu.linear(self.fmt, x.reshape(-1, x.shape[-1]), self.packed, self.shape[0])
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def linear(self, x: torch.Tensor, norm_weight: torch.Tensor | None = None, eps: float = 1e-6,
               residual: torch.Tensor | None = None) -> torch.Tensor:
        """``[residual +] (rms_norm(x) if norm_weight else x) @ W.T`` in fp32 (``Linear.linear`` on this weight)."""
        from baton.ops.rmsnorm import rms_norm

        h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
        y = self.matmul(h)
        return y if residual is None else residual + y

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Dequantised rows ``ids`` -> fp32 [*ids.shape, K] (the embedding lookup)."""
        from baton.ops import quant_cpu

        return quant_cpu.embedding(self.fmt, ids, self.packed, self.shape[0])

    def dequantize(self) -> torch.Tensor:
        """The fp32 [N, K] matrix (a new tensor: for tests and references)."""
        from baton.ops import quant_cpu

        return quant_cpu.dequantize(self.fmt, self.packed, self.shape[0])

    def extra_repr(self) -> str:
        return f"{self.fmt}, shape={list(self.shape)}"


def quantize_weight_(module: nn.Module, qweight: QuantizedWeight) -> None:
    """Replace ``module.weight`` by ``qweight`` (as ``module.qweight``; ``module.weight`` becomes None). The module's
    forward must then read it: ``Linear.linear`` / ``linear_swiglu`` / ``forward`` do."""
    if tuple(module.weight.shape) != qweight.shape:
        raise ConfigError(f"quantized weight {list(qweight.shape)} for a {list(module.weight.shape)} parameter")
    del module.weight
    module.register_parameter("weight", None)
    module.qweight = qweight


def quantized(module: nn.Module) -> QuantizedWeight | None:
    """The module's QuantizedWeight, None when it holds a plain weight."""
    return module._modules.get("qweight")
