"""RMSNorm variants."""

from baton.ops.rmsnorm.naive import gated_rms_norm, rms_norm

__all__ = ["gated_rms_norm", "rms_norm"]
