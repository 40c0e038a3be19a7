"""Weight-absorbed MLA decode/verify attention over the latent cache."""

from baton.ops.mla_decode.naive import mla_decode

__all__ = ["mla_decode"]
