"""Logits processing and sampling."""

from baton.ops.sampling.naive import logits_to_probs, logits_to_probs_t, sample_from_probs

__all__ = ["logits_to_probs", "logits_to_probs_t", "sample_from_probs"]
