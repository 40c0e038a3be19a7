"""MoE routing and routed experts."""

from baton.ops.moe.naive import fused_experts, grouped_topk

__all__ = ["fused_experts", "grouped_topk"]
