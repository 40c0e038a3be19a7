"""Weight quantisation formats."""

from baton.ops.quant.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_fp8_gate_up,
    fake_quantize_mlp_fp8,
    quantize_fp8_block,
    quantize_fp8_gate_up,
    scale_shape,
)

__all__ = [
    "FP8_DTYPE", "dequantize_fp8_block", "dequantize_fp8_gate_up", "fake_quantize_mlp_fp8", "quantize_fp8_block",
    "quantize_fp8_gate_up", "scale_shape",
]
