"""Configuration: model configs parsed from a Hugging Face ``config.json``, speculative-decoding options,
and the server arguments shared by every command.

Model configs are plain dataclasses. ``parse_model_config`` picks the class from ``model_type``, ignores
fields it does not know, applies ``--json-model-override-args`` and names any required field that is
missing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A config.json or a flag combination that baton cannot serve; the message says what to fix."""


_REQUIRED = object()


def _req() -> Any:
    return field(default=_REQUIRED)  # marks a field that config.json must provide


def _from_dict(cls, data: dict[str, Any], where: str):
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in data.items() if k in names}
    obj = cls(**kwargs)
    missing = [f.name for f in dataclasses.fields(cls) if getattr(obj, f.name) is _REQUIRED]
    if missing:
        raise ConfigError(f"{where}: missing required field(s) {', '.join(missing)}")
    return obj


@dataclass
class LlamaConfig:
    """HF ``llama`` config (SmolLM2 and friends): GQA attention, SwiGLU MLP, rotate-half RoPE."""

    vocab_size: int = _req()
    hidden_size: int = _req()
    intermediate_size: int = _req()
    num_hidden_layers: int = _req()
    num_attention_heads: int = _req()
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    model_type: str = "llama"
    num_nextn_predict_layers: int = 0

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None and self.hidden_size is not _REQUIRED:
            self.head_dim = self.hidden_size // self.num_attention_heads


@dataclass
class LingConfig:
    """HF ``bailing_hybrid`` config (BailingMoeV3: Ling-3.0-flash, Ling-3.0-tiny). Defaults are Flash values;
    see docs/ling3-architecture.md in the shared docs for the meaning of each field."""

    vocab_size: int = _req()
    hidden_size: int = _req()
    intermediate_size: int = _req()
    num_hidden_layers: int = _req()
    num_attention_heads: int = _req()
    num_experts: int = _req()
    num_experts_per_tok: int = _req()
    moe_intermediate_size: int = _req()
    num_key_value_heads: int | None = None
    head_dim: int = 128
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 262144
    rope_theta: float = 6000000.0
    rope_scaling: dict | None = None
    rope_interleave: bool = True
    tie_word_embeddings: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    layer_group_size: int = 6
    short_conv_kernel_size: int = 4
    no_kda_lora: bool = True
    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    num_shared_experts: int = 1
    moe_shared_expert_intermediate_size: int | None = None
    first_k_dense_replace: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    moe_router_enable_expert_bias: bool = True
    router_dtype: str = "fp32"
    expert_swiglu_limit_list: list[float] | None = None
    share_expert_swiglu_limit_list: list[float] | None = None
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    torch_dtype: str | None = None
    model_type: str = "bailing_hybrid"
    quantization_config: dict | None = None  # {"quant_method": "fp8", "weight_block_size": [128, 128], ...}
    # baton's, not the checkpoint's (never written to a config.json, ``config_to_dict``): the shared expert stacked
    # with the routed ones where it can be (``shared_experts_fused``); models/build.py sets it from
    # ``--disable-shared-experts-fusion``
    fuse_shared_experts: bool = True

    def __post_init__(self) -> None:
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.moe_shared_expert_intermediate_size is None:
            self.moe_shared_expert_intermediate_size = self.moe_intermediate_size

    def validate(self) -> None:
        if self.num_experts % self.n_group:
            raise ConfigError(f"num_experts {self.num_experts} is not divisible by n_group {self.n_group}")
        if self.topk_group > self.n_group:
            raise ConfigError(f"topk_group {self.topk_group} > n_group {self.n_group}")
        if self.num_experts_per_tok > self.num_experts:
            raise ConfigError("num_experts_per_tok > num_experts")

    # ---- layer layout (ling3-architecture.md §2) ----
    def is_mla_layer(self, layer_id: int) -> bool:
        g = self.layer_group_size
        full = (self.num_hidden_layers // g) * g
        return (layer_id + 1) % g == 0 or layer_id >= full

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.first_k_dense_replace

    def expert_swiglu_limit(self, layer_id: int) -> float:
        lst = self.expert_swiglu_limit_list
        return float(lst[layer_id]) if lst is not None and layer_id < len(lst) else 0.0

    def shared_swiglu_limit(self, layer_id: int) -> float:
        lst = self.share_expert_swiglu_limit_list
        return float(lst[layer_id]) if lst is not None and layer_id < len(lst) else 0.0

    @property
    def fp8_experts(self) -> bool:
        """Routed experts in fp8 e4m3 with 128 x 128 block scales (an fp8 checkpoint, or --quantization fp8)."""
        q = self.quantization_config or {}
        if q.get("quant_method") not in (None, "fp8"):
            raise ConfigError(f"quantization method {q.get('quant_method')!r} is not supported (fp8 is)")
        block = q.get("weight_block_size", [128, 128])
        if q and list(block) != [128, 128]:
            raise ConfigError(f"fp8 weight_block_size {block} is not supported (128 x 128 is)")
        return bool(q)

    @property
    def fp8_dense(self) -> bool:
        """The dense projections (KDA, MLA, shared expert, dense MLP, the MTP layer's) in fp8 too, with 128 x 128 block
        scales: an fp8 checkpoint or ``--quantization fp8``; not under ``--quantization fp8-experts``
        (``quantization_config["baton_fp8_dense"]`` false). Router, embeddings, lm_head and MLA's kv_b_proj stay in
        the model dtype."""
        return self.fp8_experts and bool(self.quantization_config.get("baton_fp8_dense", True))

    @property
    def shared_experts_fused(self) -> bool:
        """The shared expert computed as one more expert of the routed kernels (SGLang's "shared experts fusion"):
        stacked as expert ``num_experts`` of every MoE layer's ``experts.w13`` / ``w2`` and routed by every row
        with weight 1.0, so a decode step runs no separate shared MLP (its gate_up and down GEMMs: two launches per
        MoE layer). Where it applies: ``fuse_shared_experts`` (on unless ``--disable-shared-experts-fusion``), the
        shared expert as wide as a routed one (``num_shared_experts * moe_shared_expert_intermediate_size ==
        moe_intermediate_size``: Ling-3.0's 1 x 768) and in the same format (both in the model dtype, or both fp8
        with 128 x 128 block scales: not under ``--quantization fp8-experts``, where the shared expert stays in the
        model dtype)."""
        if not (self.fuse_shared_experts and self.num_shared_experts):
            return False
        if self.num_shared_experts * self.moe_shared_expert_intermediate_size != self.moe_intermediate_size:
            return False
        return self.fp8_experts == self.fp8_dense

    @property
    def fp8_activations(self) -> bool:
        """fp8 weights multiplied with fp8 activations (w8a8): the rows quantised to e4m3 per (token, 128 channels)
        at run time, as ``quantization_config["activation_scheme"] == "dynamic"`` asks (an fp8 checkpoint's own
        setting, or ``--fp8-activation-scheme``). Otherwise the weights alone are fp8 (w8a16)."""
        return self.fp8_experts and (self.quantization_config or {}).get("activation_scheme") == "dynamic"

    @property
    def mla_layer_ids(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_mla_layer(i)]


ModelConfig = LlamaConfig | LingConfig

_MODEL_TYPES: dict[str, type] = {"llama": LlamaConfig, "bailing_hybrid": LingConfig}


def parse_model_config(data: dict[str, Any], overrides: str | dict | None = None) -> ModelConfig:
    """Build a model config from a parsed config.json dict, applying a JSON override string or dict."""
    data = dict(data)
    if overrides:
        if isinstance(overrides, str):
            try:
                overrides = json.loads(overrides)
            except json.JSONDecodeError as e:
                raise ConfigError(f"--json-model-override-args is not valid JSON: {e}") from e
        if not isinstance(overrides, dict):
            raise ConfigError("--json-model-override-args must be a JSON object")
        data.update(overrides)
    model_type = data.get("model_type")
    if model_type is None:
        raise ConfigError("config.json: missing required field model_type")
    cls = _MODEL_TYPES.get(model_type)
    if cls is None:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; baton serves {', '.join(sorted(_MODEL_TYPES))}"
        )
    cfg = _from_dict(cls, data, "config.json")
    if isinstance(cfg, LingConfig):
        cfg.validate()
    return cfg


def load_model_config(model_path: str, overrides: str | dict | None = None) -> ModelConfig:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"{model_path}: no config.json (is --model-path a Hugging Face model directory?)")
    with open(path) as f:
        try:
            data = json.load(f)
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
    return parse_model_config(data, overrides)


# Model config fields that are baton's run-time choices, not config.json keys: left out of ``config_to_dict``, so a
# written checkpoint's config.json is the same whatever they were.
RUNTIME_FIELDS = ("fuse_shared_experts",)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if v is not _REQUIRED and k not in RUNTIME_FIELDS}


SPEC_ALGORITHMS = ("NEXTN", "EAGLE", "DSPARK", "DFLASH")
# --quantization: "fp8" = routed experts and dense projections in fp8 (e4m3, 128 x 128 block scales); "fp8-experts" =
# the routed experts only (dense layers in the model dtype).
QUANTIZATION_METHODS = ("fp8", "fp8-experts")
# --fp8-activation-scheme: "dynamic" = activations quantised to e4m3 per (token, 128 channels) at run time (w8a8, the
# numerics SGLang and vLLM give a block-fp8 checkpoint whose quantization_config says activation_scheme "dynamic");
# "none" = weight-only fp8 (w8a16). Unset: an fp8 checkpoint's own setting, else DEFAULT_FP8_ACTIVATION_SCHEME.
FP8_ACTIVATION_SCHEMES = ("dynamic", "none")
DEFAULT_FP8_ACTIVATION_SCHEME = "none"


@dataclass
class SpecConfig:
    """Speculative-decoding options, named as SGLang's ``--speculative-*`` flags."""

    algorithm: str | None = None
    draft_model_path: str | None = None
    num_steps: int | None = None
    eagle_topk: int = 1
    num_draft_tokens: int | None = None
    simulate_accept_len: float | None = None
    dspark_sps_table_path: str | None = None
    dspark_confidence_sts_path: str | None = None
    token_map: str | None = None  # --speculative-token-map: the drafts' hot vocabulary (speculative/token_map.py)
    adaptive: bool = True  # --speculative-adaptive: the draft depth follows the acceptance (speculative/adaptive.py)

    def __post_init__(self) -> None:
        if self.algorithm is None:
            return
        self.algorithm = self.algorithm.upper()
        if self.algorithm not in SPEC_ALGORITHMS:
            raise ConfigError(
                f"--speculative-algorithm {self.algorithm}: choose one of {', '.join(SPEC_ALGORITHMS)}"
            )
        if self.algorithm == "EAGLE":
            self.algorithm = "NEXTN"
        if self.eagle_topk != 1:
            raise ConfigError(
                f"--speculative-eagle-topk {self.eagle_topk} is not supported: baton drafts chains (topk=1), "
                "which keeps KDA states indexable by position"
            )
        if self.algorithm == "NEXTN":
            if self.num_steps is None:
                self.num_steps = 3 if self.num_draft_tokens is None else self.num_draft_tokens - 1
            if self.num_steps < 1:
                raise ConfigError("--speculative-num-steps must be >= 1")
            if self.num_draft_tokens is None:
                self.num_draft_tokens = self.num_steps + 1
            if self.num_draft_tokens != self.num_steps + 1:
                raise ConfigError(
                    f"--speculative-num-draft-tokens {self.num_draft_tokens} must equal "
                    f"--speculative-num-steps + 1 = {self.num_steps + 1} for a topk=1 chain"
                )
        if self.simulate_accept_len is not None and self.simulate_accept_len < 1.0:
            raise ConfigError("--speculative-simulate-accept-len must be >= 1 (it counts the bonus token)")

    @property
    def enabled(self) -> bool:
        return self.algorithm is not None

    @property
    def gamma(self) -> int | None:
        """DSpark/DFlash draft count: num_draft_tokens = gamma + 1 (DeepSpec slot convention)."""
        return None if self.num_draft_tokens is None else self.num_draft_tokens - 1


@dataclass
class ServerArgs:
    """Every flag of ``baton serve`` / ``baton generate`` (SGLang names, snake_case)."""

    model_path: str | None = None
    tokenizer_path: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str | None = None
    json_model_override_args: str | None = None
    context_length: int | None = None
    seed: int = 0
    tp_size: int = 1
    disable_cuda_graph: bool = False
    disable_prefill_cuda_graph: bool = False
    cuda_graph_max_tokens_prefill: int = 256
    mem_fraction_static: float | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    log_level: str = "info"
    served_model_name: str | None = None
    max_request_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 5.0  # seconds running requests get after SIGTERM before they are aborted
    timeout_keep_alive: float = 30.0  # seconds an idle keep-alive connection stays open
    read_timeout: float = 30.0  # seconds a client has to send a request's headers, and again its body
    skip_server_warmup: bool = False  # baton serve: listen without first running the warm-up requests
    enable_fp32_lm_head: bool = False  # keep an fp32 copy of the lm_head (default: the model dtype)
    enable_fp32_router: bool = False  # keep the MoE router gate in fp32 (default: the model dtype)
    enable_fp8_draft_lm_head: bool = False  # drafts' logits from an fp8 copy of the lm_head (the verify's unchanged)
    disable_radix_cache: bool = False  # prefix cache off (baton/cache/prefix.py): every request starts empty
    max_total_tokens: int | None = None  # prefix cache: cached attention rows, in tokens (None: device default)
    max_mamba_cache_size: int | None = None  # prefix cache: recurrent-state snapshots kept (None: device default)
    prefix_snapshot_stride: int = 4096  # prefix cache: recurrent-state snapshot every this many prompt tokens
    quantization: str | None = None  # QUANTIZATION_METHODS: "fp8" experts + dense, "fp8-experts" (quantised at load)
    fp8_activation_scheme: str | None = None  # FP8_ACTIVATION_SCHEMES; None: the checkpoint's, else the default
    disable_shared_experts_fusion: bool = False  # keep the MoE shared expert a separate MLP (LingConfig docs)
    spec: SpecConfig = field(default_factory=SpecConfig)

    @property
    def is_embedded(self) -> bool:
        return self.model_path is None or self.model_path == "embedded"
