"""Weight quantisation formats."""

from baton.ops.quant.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_fp8_gate_up,
    dequantize_fp8_rows,
    part_blocks,
    quantize_fp8_block,
    quantize_fp8_gate_up,
    quantize_fp8_parts,
    row_block_map,
    scale_shape,
)

__all__ = [
    "FP8_DTYPE", "dequantize_fp8_block", "dequantize_fp8_gate_up", "dequantize_fp8_rows", "part_blocks",
    "quantize_fp8_block", "quantize_fp8_gate_up", "quantize_fp8_parts", "row_block_map", "scale_shape",
]
