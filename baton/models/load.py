"""Build the target model from ServerArgs: the embedded SmolLM2 GGUF by default, a GGUF file, or a Hugging
Face directory (safetensors, or ``--load-format dummy`` for deterministic random weights), with its tokenizer.

Parameters are created on the meta device and materialised directly on the target device in the target
dtype, so a full-size dummy model never exists on the host.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from baton import dist
from baton.config import ConfigError, LingConfig, ModelConfig, ServerArgs, load_model_config, parse_model_config
from baton.layers.rope import RotaryEmbedding
from baton.models.base import CausalLM
from baton.models.loader import init_dummy_weights, load_safetensors, load_tensors
from baton.models.registry import model_class

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class LoadedModel:
    model: CausalLM
    config: ModelConfig
    tokenizer: object
    model_path: str
    tokenizer_path: str | None


def materialize(model: nn.Module, device: torch.device) -> nn.Module:
    """meta -> real storage on ``device`` (uninitialised), then recompute the non-persistent buffers."""
    model.to_empty(device=device)
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.reset_buffers()
    return model


def build_model(cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> CausalLM:
    """An uninitialised model of ``cfg`` on ``device`` ("meta" builds shapes only), with this tensor-parallel
    rank's shapes (baton.dist); vocabulary padding rows are zeroed."""
    model = model_class(cfg)(cfg, device="meta", dtype=dtype)
    if torch.device(device).type != "meta":
        materialize(model, torch.device(device))
        model.reset_padding()
    return model.eval()


def init_dummy(model: CausalLM, cfg: ModelConfig, seed: int, dtype: torch.dtype) -> None:
    """Dummy weights; a tensor-parallel rank takes its slices of the single-rank dummy model's weights."""
    if dist.tp_size() == 1:
        init_dummy_weights(model, seed)
        return
    with dist.layout_context(0, 1):
        full = build_model(cfg, "meta", dtype)
    init_dummy_weights(model, seed, full_model=full)


def load_target(args: ServerArgs, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    if args.load_format not in LOAD_FORMATS:
        raise ConfigError(f"--load-format {args.load_format}: choose one of {', '.join(LOAD_FORMATS)}")
    path = args.model_path
    if args.is_embedded or (path and path.endswith(".gguf")):
        return _load_gguf(args, device, dtype)
    if not os.path.isdir(path):
        raise ConfigError(f"--model-path {path}: not a directory or a .gguf file")
    cfg = load_model_config(path, args.json_model_override_args)
    _apply_quantization(cfg, args.quantization)
    model = build_model(cfg, device, dtype)
    if args.load_format == "dummy":
        init_dummy(model, cfg, args.seed, dtype)
    else:
        load_safetensors(model, path, ignore_prefixes=_ignored_prefixes(cfg))
    tok_path = args.tokenizer_path or path
    return LoadedModel(model, cfg, _tokenizer_for(tok_path, cfg), os.path.abspath(path), tok_path)


def _load_gguf(args: ServerArgs, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    from baton.models.gguf import find_embedded_gguf, read_gguf_llama
    from baton.tokenizer import load_tokenizer

    gguf_path = find_embedded_gguf() if args.is_embedded else args.model_path
    cfg_dict, tensors = read_gguf_llama(gguf_path)
    cfg = parse_model_config(cfg_dict, args.json_model_override_args)
    model = build_model(cfg, device, dtype)
    if args.load_format == "dummy":
        init_dummy(model, cfg, args.seed, dtype)
    else:
        load_tensors(model, tensors.items(), total=len(tensors))
    name = "embedded" if args.is_embedded else os.path.abspath(gguf_path)
    tokenizer = load_tokenizer(args.tokenizer_path) if args.tokenizer_path else load_tokenizer(gguf_path=gguf_path)
    return LoadedModel(model, cfg, tokenizer, name, args.tokenizer_path or name)


def _apply_quantization(cfg: ModelConfig, quantization: str | None) -> None:
    """``--quantization fp8``: routed experts in fp8 e4m3 with 128 x 128 block scales (quantised at load from a
    bf16 checkpoint, or drawn so for dummy weights); dense layers, router and lm_head stay in the model dtype."""
    if quantization is None:
        return
    if quantization != "fp8":
        raise ConfigError(f"--quantization {quantization}: only fp8 is supported")
    if not isinstance(cfg, LingConfig):
        raise ConfigError("--quantization fp8 quantises MoE experts; this model has none")
    cfg.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}


def _ignored_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    # An MTP layer in the checkpoint of a config that does not ask for it (num_nextn_predict_layers 0).
    if getattr(cfg, "num_nextn_predict_layers", 0) == 0:
        return (f"model.layers.{cfg.num_hidden_layers}.",)
    return ()


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")


def _tokenizer_for(path: str, cfg: ModelConfig):
    import os

    from baton.tokenizer import IdTokenizer, load_tokenizer

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
