"""baton: a batch-1, latency-first inference server for hybrid linear-attention MoE models."""

__version__ = "0.1.0"
