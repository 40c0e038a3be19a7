"""The target and its tokenizer, from ServerArgs: baton.models.build makes the model; the tokenizer is the
``--tokenizer-path``, the model directory's, the GGUF's own, or (a config-only directory: dummy weights) raw token
ids as text."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from baton.config import ModelConfig, ServerArgs
from baton.models.base import CausalLM
from baton.models.build import build_target
from baton.tokenizer import IdTokenizer, Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: Tokenizer | IdTokenizer
    model_path: str
    tokenizer_path: str | None


def load_target(args: ServerArgs, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    built = build_target(args, device, dtype)
    if built.gguf_path is not None:
        path = args.tokenizer_path
        tokenizer = load_tokenizer(path) if path else load_tokenizer(gguf_path=built.gguf_path)
        return LoadedModel(built.model, built.config, tokenizer, built.model_path, path or built.model_path)
    tok_path = args.tokenizer_path or args.model_path
    return LoadedModel(built.model, built.config, tokenizer_for(tok_path, built.config), built.model_path, tok_path)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def tokenizer_for(path: str, cfg: ModelConfig) -> Tokenizer | IdTokenizer:
    if os.path.isdir(path) and not any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES):
        # a config-only directory (dummy weights): no tokenizer to try, and no transformers warnings about it
        log.warning("no tokenizer files in %s; using raw token ids as text", path)
        return IdTokenizer(cfg.vocab_size, _first_eos(cfg))
    try:
        return load_tokenizer(path)
    except Exception as e:  # no tokenizer files beside a dummy config: fall back to raw token ids
        log.warning("no tokenizer at %s (%s); using raw token ids as text", path, e)
        return IdTokenizer(cfg.vocab_size, _first_eos(cfg))


def _first_eos(cfg: ModelConfig) -> int | None:
    eos = getattr(cfg, "eos_token_id", None)
    return eos[0] if isinstance(eos, list) else eos
