"""Projections with optional RMSNorm prologue, residual epilogue, SwiGLU epilogue."""

from baton.ops.linear.naive import linear, linear_swiglu, swiglu

__all__ = ["linear", "linear_swiglu", "swiglu"]
