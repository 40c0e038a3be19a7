"""model_type -> model class."""

from __future__ import annotations

from baton.config import LingConfig, LlamaConfig, ModelConfig
from baton.models.base import CausalLM
from baton.models.ling import LingForCausalLM
from baton.models.llama import LlamaForCausalLM


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    if isinstance(cfg, LingConfig):
        return LingForCausalLM
    if isinstance(cfg, LlamaConfig):
        return LlamaForCausalLM
    raise TypeError(f"no model class for {type(cfg).__name__}")
