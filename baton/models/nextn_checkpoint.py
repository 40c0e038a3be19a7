"""Draft checkpoints: a directory with config.json + model.safetensors.

A NEXTN head for a target without its own MTP layer has ``model_type: "baton_nextn"`` and a ``body``
config of the target's own architecture (one decoder layer); its tensors are named as a Ling MTP layer's,
under ``model.layers.0.`` (enorm, hnorm, eh_proj, final_layernorm, and the body's layer weights).
"""

from __future__ import annotations

import json
import os

import torch

from baton.config import ConfigError, LingConfig, ModelConfig, config_to_dict, parse_model_config
from baton.layers.rope import RotaryEmbedding
from baton.models.base import CausalLM
from baton.models.checkpoint import hf_layout, init_dummy_weights, load_safetensors, save_hf_checkpoint
from baton.models.nextn import NextNLayer

NEXTN_TYPE = "baton_nextn"
_NEXTN_PREFIX = [("body.", "model.layers.0."), ("", "model.layers.0.")]


def read_draft_config(path: str) -> dict:
    fn = os.path.join(path, "config.json")
    if not os.path.isfile(fn):
        raise ConfigError(f"--speculative-draft-model-path {path}: no config.json there")
    with open(fn) as f:
        return json.load(f)


def build_nextn_head(body_cfg: ModelConfig, device=None, dtype=None) -> NextNLayer:
    if isinstance(body_cfg, LingConfig):
        from baton.models.ling import LingDecoderLayer

        rope = RotaryEmbedding(body_cfg.qk_rope_head_dim, body_cfg.rope_theta, body_cfg.rope_interleave,
                               body_cfg.rope_scaling, device=device)
        body = LingDecoderLayer(0, body_cfg, rope, force_mla=True, device=device, dtype=dtype)
    else:
        from baton.models.llama import LlamaDecoderLayer

        rope = RotaryEmbedding(body_cfg.head_dim, body_cfg.rope_theta, False, body_cfg.rope_scaling, device=device)
        body = LlamaDecoderLayer(0, body_cfg, rope, device=device, dtype=dtype)
    eps = body_cfg.rms_norm_eps
    return NextNLayer(body_cfg.hidden_size, eps, body, device=device, dtype=dtype)


def nextn_body_config(target_cfg: ModelConfig, **overrides) -> ModelConfig:
    data = config_to_dict(target_cfg)
    data.update(num_hidden_layers=1, num_nextn_predict_layers=0, first_k_dense_replace=0, **overrides)
    for key in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        data.pop(key, None)
    return _follow_target(parse_model_config(data), target_cfg)


def _follow_target(body_cfg: ModelConfig, target_cfg: ModelConfig) -> ModelConfig:
    """The target's run-time choices that are no config.json key (``baton.config.RUNTIME_FIELDS``: the shared
    experts fusion) apply to its NEXTN head's body too."""
    if isinstance(body_cfg, LingConfig) and isinstance(target_cfg, LingConfig):
        body_cfg.fuse_shared_experts = target_cfg.fuse_shared_experts
    return body_cfg


def load_nextn_head(path: str, target: CausalLM, device, dtype) -> NextNLayer:
    head = build_nextn_head(nextn_checkpoint_config(path, target), device=device, dtype=dtype)
    load_safetensors_with_prefix(head, path)
    return head


def nextn_checkpoint_config(path: str, target: CausalLM) -> ModelConfig:
    """The body config of the NEXTN head checkpoint at ``path``, checked against ``target`` (model type,
    vocabulary, hidden size)."""
    data = read_draft_config(path)
    if data.get("model_type") != NEXTN_TYPE:
        raise ConfigError(f"{path}: model_type {data.get('model_type')!r} is not a NEXTN head ({NEXTN_TYPE!r})")
    body_cfg = _follow_target(parse_model_config(data["body"]), target.config)
    check_vocab(path, data.get("vocab_size"), target)
    if body_cfg.hidden_size != target.config.hidden_size:
        raise ConfigError(f"{path}: draft hidden_size {body_cfg.hidden_size} != target {target.config.hidden_size}")
    return body_cfg


def load_safetensors_with_prefix(head: NextNLayer, path: str) -> None:
    from baton.models.checkpoint import count_tensors, iter_safetensors, load_tensors, safetensors_files

    files = safetensors_files(path)
    load_tensors(head, iter_safetensors(files), total=count_tensors(files), layout=hf_layout(head, _NEXTN_PREFIX),
                 desc="loading draft")


def check_vocab(path: str, vocab_size: int | None, target: CausalLM) -> None:
    if vocab_size != target.config.vocab_size:
        raise ConfigError(f"draft checkpoint {path} is for a vocabulary of {vocab_size} tokens, the target has "
                          f"{target.config.vocab_size}: pass a draft trained for this target")


def write_random_nextn_head(target_cfg: ModelConfig, path: str, seed: int = 0, **body_overrides) -> NextNLayer:
    """Write a randomly initialised NEXTN head for ``target_cfg`` (tests and benchmarks use it)."""
    body_cfg = nextn_body_config(target_cfg, **body_overrides)
    head = build_nextn_head(body_cfg, dtype=torch.float32)
    init_dummy_weights(head, seed)
    save_nextn_head(head, body_cfg, target_cfg.vocab_size, path)
    return head


def save_nextn_head(head: NextNLayer, body_cfg: ModelConfig, vocab_size: int, path: str) -> None:
    cfg = {"model_type": NEXTN_TYPE, "architectures": ["NextNHead"], "vocab_size": vocab_size,
           "hidden_size": body_cfg.hidden_size, "body": config_to_dict(body_cfg)}
    save_hf_checkpoint(head, cfg, path, layout=hf_layout(head, _NEXTN_PREFIX))


__all__ = ["build_nextn_head", "load_nextn_head", "load_safetensors", "write_random_nextn_head"]
