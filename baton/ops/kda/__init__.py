"""KDA (Kimi Delta Attention) ops. ``naive`` holds the plain-PyTorch references."""

from baton.ops.kda.naive import kda_chunk, kda_decode_step, kda_gate, kda_recurrent, l2norm

__all__ = ["kda_chunk", "kda_decode_step", "kda_gate", "kda_recurrent", "l2norm"]
