"""DSpark / DFlash draft checkpoints: the config (both published namings) and safetensors IO.

A draft checkpoint is a directory with ``config.json`` + ``model.safetensors``. The config accepts:

- DSpark names (DeepSeek-V4-DSpark style), top level: ``dspark_block_size``, ``dspark_markov_rank``,
  ``dspark_target_layer_ids``, ``dspark_noise_token_id`` (the mask token);
- DFlash names (z-lab style): ``block_size`` and a nested ``dflash_config: {target_layer_ids, mask_token_id}``;

plus the draft backbone's architecture: ``hidden_size``, ``num_hidden_layers`` (the draft depth),
``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``, ``rms_norm_eps``,
``rope_theta``, ``rope_scaling``, ``vocab_size`` and ``qk_norm`` (per-head q/k RMSNorm, Qwen3 style; default
true, as in the published Qwen3-based drafts). The block size is gamma, the number of query slots (DeepSpec
convention: gamma slots give gamma drafts). Without target layer ids the default of ``build_target_layer_ids``
applies. baton writes ``model_type: "baton_dspark"`` with the DSpark names.

Tensor names: ``fc.weight`` [H, n*H], ``hidden_norm.weight``, ``layers.{i}.{input_layernorm,
post_attention_layernorm}.weight``, ``layers.{i}.self_attn.{q,k,v,o}_proj.weight`` (+ ``q_norm``/``k_norm``),
``layers.{i}.mlp.{gate,up,down}_proj.weight``, ``norm.weight``, and for DSpark ``markov_head.w1.weight`` [V, r]
(an embedding), ``markov_head.w2.weight`` [V, r] (Linear r -> V), ``confidence_head.weight`` [1, H+r],
``confidence_head.bias`` [1]. No embedding and no lm_head: both come from the target.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from baton.config import ConfigError, ModelConfig
from baton.models.checkpoint import (
    count_tensors,
    hf_layout,
    init_dummy_weights,
    iter_safetensors,
    load_tensors,
    safetensors_files,
    save_hf_checkpoint,
)

if TYPE_CHECKING:
    from baton.models.dspark import DSparkDraftModel

DSPARK_TYPE = "baton_dspark"
HEAD_PREFIXES = ("markov_head.", "confidence_head.")


@dataclass
class DSparkDraftConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int  # draft depth
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    block_size: int  # gamma: query slots = drafts per round
    mask_token_id: int
    target_layer_ids: list[int] | None = None  # None: build_target_layer_ids(target layers, depth)
    markov_rank: int = 0  # 0: no Markov / confidence heads (DFlash)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    qk_norm: bool = True

    @property
    def has_heads(self) -> bool:
        return self.markov_rank > 0


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The default tapped layers (z-lab / SGLang): [L // 2] for one, else n ids spread over [1, L - 3]."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _first(data: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if data.get(key) is not None:
            return data[key]
    return None


def parse_dspark_config(data: dict[str, Any], where: str) -> DSparkDraftConfig:
    """A draft config.json dict (either naming) -> DSparkDraftConfig; names any missing or unsupported field."""
    dflash = data.get("dflash_config") or {}
    block_size = _first(data, "dspark_block_size", "block_size")
    mask_token_id = _first(data, "dspark_noise_token_id", "mask_token_id")
    if mask_token_id is None:
        mask_token_id = dflash.get("mask_token_id")
    layer_ids = _first(data, "dspark_target_layer_ids", "target_layer_ids")
    if layer_ids is None:
        layer_ids = dflash.get("target_layer_ids")
    required = {"vocab_size": data.get("vocab_size"), "hidden_size": data.get("hidden_size"),
                "num_hidden_layers": data.get("num_hidden_layers"),
                "num_attention_heads": data.get("num_attention_heads"),
                "intermediate_size": data.get("intermediate_size"),
                "dspark_block_size (or block_size)": block_size,
                "dspark_noise_token_id (or dflash_config.mask_token_id)": mask_token_id}
    missing = [k for k, v in required.items() if v is None]
    if missing:
        raise ConfigError(f"{where}: draft config is missing {', '.join(missing)}")
    if data.get("attention_bias"):
        raise ConfigError(f"{where}: attention_bias is not supported in DSpark/DFlash drafts")
    layer_types = data.get("layer_types") or []
    if any(t != "full_attention" for t in layer_types):
        raise ConfigError(f"{where}: only full_attention draft layers are supported, found {sorted(set(layer_types))}")
    heads = int(data["num_attention_heads"])
    return DSparkDraftConfig(
        vocab_size=int(data["vocab_size"]), hidden_size=int(data["hidden_size"]),
        num_hidden_layers=int(data["num_hidden_layers"]), num_attention_heads=heads,
        num_key_value_heads=int(data.get("num_key_value_heads") or heads),
        head_dim=int(data.get("head_dim") or data["hidden_size"] // heads),
        intermediate_size=int(data["intermediate_size"]), block_size=int(block_size),
        mask_token_id=int(mask_token_id), target_layer_ids=None if layer_ids is None else [int(i) for i in layer_ids],
        markov_rank=int(data.get("dspark_markov_rank") or 0), rms_norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        rope_theta=float(data.get("rope_theta", 10000.0)), rope_scaling=data.get("rope_scaling"),
        qk_norm=bool(data.get("qk_norm", True)),
    )


def dspark_config_dict(cfg: DSparkDraftConfig) -> dict[str, Any]:
    """What baton writes: ``model_type: baton_dspark`` and the DSpark field names."""
    out = {"model_type": DSPARK_TYPE, "architectures": ["DSparkDraftModel"]}
    renamed = {"block_size": "dspark_block_size", "markov_rank": "dspark_markov_rank",
               "target_layer_ids": "dspark_target_layer_ids", "mask_token_id": "dspark_noise_token_id"}
    for key, value in dataclasses.asdict(cfg).items():
        out[renamed.get(key, key)] = value
    return out


def read_dspark_config(path: str | None) -> DSparkDraftConfig:
    if not path:
        raise ConfigError("--speculative-algorithm DSPARK/DFLASH needs --speculative-draft-model-path "
                          "(a draft checkpoint directory with config.json and model.safetensors)")
    fn = os.path.join(path, "config.json")
    if not os.path.isfile(fn):
        raise ConfigError(f"--speculative-draft-model-path {path}: no config.json there")
    with open(fn) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{fn} is not valid JSON: {e}") from e
    return parse_dspark_config(data, fn)


def markov_rank_from_tensors(path: str) -> int:
    """A checkpoint whose config does not state the Markov rank but whose file holds the head: read r from it."""
    for fn in safetensors_files(path):
        with safe_open(fn, framework="pt") as f:
            if "markov_head.w1.weight" in f.keys():
                return int(f.get_slice("markov_head.w1.weight").get_shape()[1])
    return 0


def load_dspark_weights(model: nn.Module, path: str, ignore_heads: bool) -> None:
    """Fill ``model`` from ``path``; a missing or mis-shaped tensor fails with its name and shapes."""
    ignore = HEAD_PREFIXES if ignore_heads else ()
    files = safetensors_files(path)
    load_tensors(model, iter_safetensors(files), total=count_tensors(files), layout=hf_layout(model, []),
                 desc="loading draft", ignore_prefixes=ignore)


def save_dspark_draft(model: nn.Module, cfg: DSparkDraftConfig, path: str) -> None:
    save_hf_checkpoint(model, dspark_config_dict(cfg), path, layout=hf_layout(model, []))


def draft_config_for(target_cfg: ModelConfig, block_size: int, num_layers: int, markov_rank: int,
                     mask_token_id: int | None, target_layer_ids: list[int] | None,
                     qk_norm: bool = True) -> DSparkDraftConfig:
    """A draft backbone shaped like the target's attention (DeepSpec ``build_draft_config``)."""
    heads = target_cfg.num_attention_heads
    return DSparkDraftConfig(
        vocab_size=target_cfg.vocab_size, hidden_size=target_cfg.hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=heads, num_key_value_heads=target_cfg.num_key_value_heads or heads,
        head_dim=target_cfg.head_dim or target_cfg.hidden_size // heads,
        intermediate_size=target_cfg.intermediate_size, block_size=block_size,
        mask_token_id=target_cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
        target_layer_ids=target_layer_ids or build_target_layer_ids(target_cfg.num_hidden_layers, num_layers),
        markov_rank=markov_rank, rms_norm_eps=target_cfg.rms_norm_eps, rope_theta=target_cfg.rope_theta,
        rope_scaling=target_cfg.rope_scaling, qk_norm=qk_norm,
    )


def write_random_dspark_draft(target_cfg: ModelConfig, path: str, seed: int = 0, block_size: int = 8,
                              num_layers: int = 1, markov_rank: int = 32, with_heads: bool = True,
                              mask_token_id: int | None = None, target_layer_ids: list[int] | None = None,
                              qk_norm: bool = True) -> DSparkDraftModel:
    """Write a randomly initialised draft for ``target_cfg`` (tests, benchmarks, ``baton convert random-draft``).

    ``with_heads=False`` writes a DFlash draft (no Markov / confidence heads). The mask token defaults to the
    last vocabulary id (``vocab_size - 1``), which real vocabularies pad; the tapped layers default to
    ``build_target_layer_ids(target layers, num_layers)``."""
    from baton.models.dspark import DSparkDraftModel

    cfg = draft_config_for(target_cfg, block_size, num_layers, markov_rank if with_heads else 0, mask_token_id,
                           target_layer_ids, qk_norm)
    model = DSparkDraftModel(cfg, with_heads=with_heads, dtype=torch.float32)
    init_dummy_weights(model, seed)
    save_dspark_draft(model, cfg, path)
    return model


__all__ = ["DSPARK_TYPE", "DSparkDraftConfig", "build_target_layer_ids", "draft_config_for", "dspark_config_dict",
           "load_dspark_weights", "markov_rank_from_tensors", "parse_dspark_config", "read_dspark_config",
           "save_dspark_draft", "write_random_dspark_draft"]
