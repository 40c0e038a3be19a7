"""Attention over a position-indexed cache; ``attention`` picks the implementation for the device."""

from baton.ops.attention.naive import attention, causal_mask

__all__ = ["attention", "causal_mask"]
