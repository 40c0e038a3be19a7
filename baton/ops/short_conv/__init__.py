"""Depthwise causal short convolution (+SiLU) of KDA."""

from baton.ops.short_conv.naive import short_conv

__all__ = ["short_conv"]
