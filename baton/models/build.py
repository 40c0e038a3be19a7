"""Build the target model from ServerArgs: the embedded SmolLM2 GGUF by default, a GGUF file, or a Hugging
Face directory (safetensors, or ``--load-format dummy`` for deterministic random weights). Its tokenizer is
paired with it one level up (baton.engine.load), so models never import the tokenizer.

Parameters are created on the meta device and materialised directly on the target device in the target
dtype, so a full-size dummy model never exists on the host.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from baton import dist, env
from baton.config import ConfigError, LingConfig, ModelConfig, ServerArgs, load_model_config, parse_model_config
from baton.layers.rope import RotaryEmbedding
from baton.models.base import CausalLM
from baton.models.checkpoint import init_dummy_weights, load_safetensors, load_tensors
from baton.models.registry import model_class

log = logging.getLogger(__name__)

LOAD_FORMATS = ("auto", "safetensors", "gguf", "dummy")


@dataclass
class BuiltModel:
    model: CausalLM
    config: ModelConfig
    model_path: str  # the absolute directory, the absolute .gguf path, or "embedded"
    gguf_path: str | None  # the file it was read from, when it is a GGUF (its tokenizer lives in it)


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


def build_target(args: ServerArgs, device: torch.device, dtype: torch.dtype) -> BuiltModel:
    if args.load_format not in LOAD_FORMATS:
        raise ConfigError(f"--load-format {args.load_format}: choose one of {', '.join(LOAD_FORMATS)}")
    path = args.model_path
    if args.is_embedded or (path and path.endswith(".gguf")):
        return _load_gguf(args, device, dtype)
    if not os.path.isdir(path):
        raise ConfigError(f"--model-path {path}: not a directory or a .gguf file")
    cfg = load_model_config(path, args.json_model_override_args)
    apply_quantization(cfg, args.quantization, args.fp8_activation_scheme)
    apply_shared_experts_fusion(cfg, not args.disable_shared_experts_fusion)
    model = build_model(cfg, device, dtype)
    if isinstance(cfg, LingConfig) and cfg.fp8_activations:
        set_fp8_activations(model)
    if args.load_format == "dummy":
        init_dummy(model, cfg, args.seed, dtype)
    else:
        load_safetensors(model, path, ignore_prefixes=_ignored_prefixes(cfg))
    return BuiltModel(model, cfg, os.path.abspath(path), None)


@contextlib.contextmanager
def _meta_init_skipped():
    """While a model is built on the meta device: ``nn.init.normal_`` (nn.Embedding's init) leaves meta tensors
    alone. Their values are never read, and the meta kernel of ``normal_`` imports torch._dynamo, 1.4 s of every
    start-up (measured 2026-12-02) where nothing else needs it."""
    original = torch.nn.init.normal_

    def normal_(tensor, *args, **kwargs):
        return tensor if tensor.is_meta else original(tensor, *args, **kwargs)

    torch.nn.init.normal_ = normal_
    try:
        yield
    finally:
        torch.nn.init.normal_ = original


def _load_gguf(args: ServerArgs, device: torch.device, dtype: torch.dtype) -> BuiltModel:
    from baton.models.gguf import find_embedded_gguf, read_gguf_llama

    gguf_path = find_embedded_gguf() if args.is_embedded else args.model_path
    if device.type == "cpu":
        torch.set_num_threads(env.num_threads())  # the cores this process may use (BATON_NUM_THREADS overrides)
    if gguf_quantized_path(args, device):
        with _meta_init_skipped():
            cfg, model = _load_gguf_quantized(gguf_path, args, device, dtype)
    else:
        cfg_dict, tensors = read_gguf_llama(gguf_path)
        cfg = parse_model_config(cfg_dict, args.json_model_override_args)
        with _meta_init_skipped():
            model = build_model(cfg, device, dtype)
        if args.load_format == "dummy":
            init_dummy(model, cfg, args.seed, dtype)
        else:
            load_tensors(model, tensors.items(), total=len(tensors))
    name = "embedded" if args.is_embedded else os.path.abspath(gguf_path)
    return BuiltModel(model, cfg, name, gguf_path)


def gguf_quantized_path(args: ServerArgs, device: torch.device) -> bool:
    """Whether a GGUF loads with its Q4_1 / Q8_0 tensors kept quantized (``baton.layers.linear.QuantizedWeight``):
    the default on the CPU with ``--dtype auto`` at one rank, real weights, where the C kernels build here
    (baton.ops.quant_cpu.native: a C compiler; the first process on a machine builds them in a few seconds).
    Otherwise, with ``--dtype float32``, or with ``BATON_GGUF_QUANT=0`` (env.gguf_cpu_quantized), every tensor is
    dequantised to fp32 (the reference the exactness tests compare against)."""
    if not (env.gguf_cpu_quantized() and device.type == "cpu" and args.dtype == "auto" and dist.tp_size() == 1
            and args.load_format != "dummy"):
        return False
    from baton.ops import quant_cpu

    if not quant_cpu.fast_path_ok():
        log.warning("GGUF loaded dequantised to fp32: the quantized CPU kernels cannot be built here (%s)",
                    quant_cpu.native.error())
        return False
    return True


def _load_gguf_quantized(path: str, args: ServerArgs, device: torch.device, dtype: torch.dtype):
    """The model with every weight whose checkpoint tensors are all Q4_1 (or all Q8_0) kept in that format, fused
    parts (q/k/v, gate/up) stacked by rows; the other tensors (norms; any other GGML type) dequantised to ``dtype``.
    Activations, norms and caches stay in ``dtype`` (fp32)."""
    from gguf.constants import GGMLQuantizationType as T

    from baton.layers.linear import QuantizedWeight, quantize_weight_
    from baton.models.checkpoint import hf_layout
    from baton.models.gguf import read_gguf_llama_quantized

    formats = {T.Q4_1: "q4_1", T.Q8_0: "q8_0"}
    cfg_dict, dense, quant = read_gguf_llama_quantized(path, keep=tuple(formats))
    cfg = parse_model_config(cfg_dict, args.json_model_override_args)
    model = build_model(cfg, "meta", dtype)  # shapes only: the quantized parameters are replaced, then the rest made
    layout = hf_layout(model)
    by_param: dict[str, list[tuple[str, tuple[int, int] | None]]] = {}
    for hname, slot in layout.items():
        by_param.setdefault(slot.param, []).append((hname, slot.rows))
    modules = dict(model.named_modules())
    kept: set[str] = set()
    for pname, parts in by_param.items():
        tensors = [quant.get(h) for h, _ in parts]
        same_format = all(t is not None for t in tensors) and len({t.ggml_type for t in tensors}) == 1
        if not (same_format and pname.endswith(".weight")):
            continue
        order = sorted(range(len(parts)), key=lambda i: (parts[i][1] or (0, 0))[0])  # fused parts by their rows
        raw = torch.cat([tensors[i].raw for i in order]) if len(order) > 1 else tensors[0].raw
        qweight = QuantizedWeight.from_gguf(formats[tensors[0].ggml_type], raw)
        quantize_weight_(modules[pname[: -len(".weight")]], qweight)
        kept.add(pname)
    for hname, t in quant.items():  # a quantized tensor of a parameter that could not stay quantized
        if layout[hname].param not in kept:
            dense[hname] = t.dequantize()
    _materialize_rest(model, device)
    rest = {h: slot for h, slot in layout.items() if slot.param not in kept}
    load_tensors(model, dense.items(), total=len(dense), layout=rest)
    log.info("GGUF weights kept quantized on the CPU: %d matrices (%.0f MB)", len(kept),
             sum(m.qweight.nbytes for m in model.modules() if "qweight" in m._modules) / 1e6)
    return cfg, model


def _materialize_rest(model: CausalLM, device: torch.device) -> None:
    """``materialize`` for a model whose quantized weights are already real: every parameter and buffer still on
    the meta device gets uninitialised storage on ``device`` (torch.empty: ``Module.to_empty`` would import
    torch's symbolic-shapes machinery, half a second of start-up), then the non-persistent buffers and the vocabulary
    padding are recomputed."""
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                module._parameters[name] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=device),
                                                        requires_grad=p.requires_grad)
        for name, b in module._buffers.items():
            if b is not None and b.is_meta:
                module._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device=device)
    for module in model.modules():
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()
        elif module is not model and hasattr(module, "reset_padding") and getattr(module, "weight", None) is not None:
            module.reset_padding()
    model.eval()


def apply_quantization(cfg: ModelConfig, quantization: str | None, activation_scheme: str | None = None) -> None:
    """``--quantization fp8``: routed experts and dense projections in fp8 e4m3 with 128 x 128 block scales
    (quantised at load from a bf16 checkpoint, or drawn so for dummy weights); ``fp8-experts``: the routed experts
    only. Router, embeddings and lm_head stay in the model dtype (``LingConfig.fp8_dense`` lists what else does). An
    fp8 checkpoint's own quantization_config is kept (its block size is checked); only the dense choice is set.

    ``activation_scheme`` (``--fp8-activation-scheme``): "dynamic" (w8a8) or "none" (w8a16) for the fp8 weights;
    None keeps an fp8 checkpoint's own ``activation_scheme`` and gives at-load quantisation the default."""
    from baton.config import DEFAULT_FP8_ACTIVATION_SCHEME, FP8_ACTIVATION_SCHEMES, QUANTIZATION_METHODS

    if activation_scheme is not None and activation_scheme not in FP8_ACTIVATION_SCHEMES:
        raise ConfigError(f"--fp8-activation-scheme {activation_scheme}: choose one of "
                          f"{', '.join(FP8_ACTIVATION_SCHEMES)}")
    if quantization is None:
        if activation_scheme is not None and isinstance(cfg, LingConfig) and cfg.fp8_experts:
            cfg.quantization_config = {**cfg.quantization_config, "activation_scheme": activation_scheme}
        return
    if quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"--quantization {quantization}: choose one of {', '.join(QUANTIZATION_METHODS)}")
    if not isinstance(cfg, LingConfig):
        raise ConfigError(f"--quantization {quantization} quantises MoE experts; this model has none")
    q = dict(cfg.quantization_config or {"quant_method": "fp8", "weight_block_size": [128, 128],
                                         "activation_scheme": DEFAULT_FP8_ACTIVATION_SCHEME})
    q["baton_fp8_dense"] = quantization == "fp8"
    if activation_scheme is not None:
        q["activation_scheme"] = activation_scheme
    cfg.quantization_config = q


def apply_shared_experts_fusion(cfg: ModelConfig, enabled: bool) -> None:
    """``--disable-shared-experts-fusion`` (``enabled`` False) keeps the MoE shared expert a separate MLP; otherwise
    it is stacked with the routed experts where ``LingConfig.shared_experts_fused`` says it can be. A model without
    a MoE is left alone."""
    if isinstance(cfg, LingConfig):
        cfg.fuse_shared_experts = cfg.fuse_shared_experts and enabled


def set_fp8_activations(model: torch.nn.Module, on: bool = True) -> int:
    """Every fp8 dense projection and fp8 expert stack of ``model`` multiplies with fp8 activations (w8a8,
    ``act_fp8`` of baton.ops.fp8_linear / baton.ops.moe) when ``on``; returns how many modules it set."""
    from baton.layers.linear import Linear
    from baton.layers.moe import Experts

    n = 0
    for m in model.modules():
        if isinstance(m, Linear | Experts) and m.fp8:
            m.act_fp8 = on
            n += 1
    return n


def _ignored_prefixes(cfg: ModelConfig) -> tuple[str, ...]:
    # An MTP layer in the checkpoint of a config that does not ask for it (num_nextn_predict_layers 0).
    if getattr(cfg, "num_nextn_predict_layers", 0) == 0:
        return (f"model.layers.{cfg.num_hidden_layers}.",)
    return ()
