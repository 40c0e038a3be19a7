"""Fake fp8: round a model's projection weights through fp8 e4m3 with block scales, in place, keeping their dtype.
The CPU emulation of ``--quantization fp8`` for models without fp8 layers (the embedded SmolLM2), to measure what
fp8 costs (logit error, GSM8K accuracy, the drafts' accept length). The formats are baton.ops.quant."""

from __future__ import annotations

import torch

from baton.layers.embedding import ParallelLMHead
from baton.layers.linear import Linear, quantized
from baton.layers.mlp import MLP
from baton.ops.quant import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_fp8_gate_up,
    dequantize_fp8_rows,
    quantize_fp8_block,
    quantize_fp8_gate_up,
    quantize_fp8_parts,
    row_block_map,
)
from baton.ops.quant.fp8 import BLOCK


def fake_quantize_mlp_fp8(model: torch.nn.Module, block: int = BLOCK) -> int:
    """Round a dense model's MLP weights (gate, up and down projections: what its "experts" would be) through
    fp8 e4m3 with ``block`` x ``block`` scales, in place, keeping their dtype: the dense stand-in for fp8
    experts, used to measure what fp8 costs a model without an MoE (logit error, greedy agreement, the accept
    length of drafts trained on the unquantised target). The gate and up halves of a fused ``gate_up_proj`` are
    quantised separately, as the MoE kernel's checkpoints store them. Returns the number of matrices changed."""
    changed = 0
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, MLP):
                w13, w2 = _float_weight(m.gate_up_proj), _float_weight(m.down_proj)
                w13.copy_(dequantize_fp8_gate_up(*quantize_fp8_gate_up(w13, block), w13.dtype, block))
                w2.copy_(dequantize_fp8_block(*quantize_fp8_block(w2, block), w2.dtype, block))
                changed += 3  # gate, up, down
    return changed


def fake_quantize_dense_fp8(model: torch.nn.Module, block: int = BLOCK, skip: tuple[str, ...] = ()) -> int:
    """Round every dense projection of ``model`` (each ``baton.layers.linear.Linear``: attention q/k/v/o, MLP
    gate/up/down, NEXTN eh_proj) through fp8 e4m3 with ``block`` x ``block`` scales, in place, keeping the dtype: the
    CPU emulation of ``--quantization fp8`` (experts + dense) for a model without fp8 layers (the embedded SmolLM2).
    Each checkpoint tensor of a fused projection is quantised on its own, as an fp8 checkpoint stores it. The
    lm_head and embeddings are left alone (the verify's lm_head stays in the model dtype). Modules whose name starts
    with one of ``skip`` are left alone too. Returns the number of checkpoint matrices changed."""
    changed = 0
    with torch.no_grad():
        for name, m in model.named_modules():
            if (not isinstance(m, Linear) or isinstance(m, ParallelLMHead) or (skip and name.startswith(skip))
                    or (m.weight is not None and m.weight.dtype == FP8_DTYPE)):
                continue
            w = _float_weight(m)
            rows = [r for _, r, *_ in m.hf_row_splits["weight"]] if hasattr(m, "hf_row_splits") else [w.shape[0]]
            q, s = quantize_fp8_parts(w, rows, block)
            w.copy_(dequantize_fp8_rows(q, s, _as_tensor(row_block_map(rows, block), w.device), w.dtype, block))
            changed += len(rows)
    return changed


def fake_quantize_activations_fp8(model: torch.nn.Module, skip: tuple[str, ...] = ()) -> int:
    """The w8a8 half of the emulation (``--fp8-activation-scheme dynamic``): every dense projection's input (after
    its fused RMSNorm prologue) rounded through e4m3 per (row, 128 columns) with the scales the w8a8 kernels use
    (``baton.ops.quant.fp8.quantize_act_e4m3``), then multiplied as before. Use after
    ``fake_quantize_dense_fp8``; the lm_head is left alone, as are modules whose name starts with one of ``skip``.
    Returns the number of modules changed."""
    changed = 0
    for name, m in model.named_modules():
        if not isinstance(m, Linear) or isinstance(m, ParallelLMHead) or (skip and name.startswith(skip)):
            continue
        _round_inputs(m)
        changed += 1
    return changed


def _round_inputs(m: Linear) -> None:
    from baton.ops.quant.fp8 import dequantize_act_e4m3, quantize_act_e4m3
    from baton.ops.rmsnorm.naive import rms_norm

    linear, linear_swiglu = m.linear, m.linear_swiglu

    def rounded(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        h = x if norm_weight is None else rms_norm(x, norm_weight, eps)
        flat = h.reshape(-1, h.shape[-1])
        return dequantize_act_e4m3(*quantize_act_e4m3(flat)).to(h.dtype).reshape(h.shape)

    m.linear = lambda x, norm_weight=None, eps=1e-6, residual=None: linear(rounded(x, norm_weight, eps), None,
                                                                            eps, residual)
    m.linear_swiglu = lambda x, norm_weight=None, eps=1e-6, limit=0.0: linear_swiglu(rounded(x, norm_weight, eps),
                                                                                      None, eps, limit)


def _as_tensor(rows: list[int] | None, device) -> torch.Tensor | None:
    return None if rows is None else torch.tensor(rows, dtype=torch.int32, device=device)


def _float_weight(m: torch.nn.Module) -> torch.Tensor:
    """A projection's weight as a float tensor to round in place: a GGUF-quantized weight kept in its block format
    (``baton.layers.linear.QuantizedWeight``, the embedded model on the CPU) is dequantised into a plain fp32
    parameter first (the same values: its matmul computes from the exact dequantised weights)."""
    q = quantized(m)
    if q is not None:
        w = q.dequantize().float()
        del m._modules["qweight"]
        m.weight = torch.nn.Parameter(w, requires_grad=False)
    return m.weight.data
