"""Weights in and out: Hugging Face safetensors directories with the real checkpoint names (sharded or not),
GGUF files (via baton.models.gguf), deterministic dummy weights, and a writer of random checkpoints in the
HF layout.

baton fuses some checkpoint tensors (gate/up projections, the 512 experts of a MoE layer). ``hf_layout``
maps every checkpoint name to the slice of a baton parameter it fills, so loading and saving share one
table and a round trip is bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from tqdm import tqdm

from baton import env
from baton.config import ConfigError, ModelConfig, config_to_dict

log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A checkpoint that does not match the model: the message names the tensor."""


@dataclass(frozen=True)
class Slot:
    """Where one checkpoint tensor lives inside a baton parameter; under tensor parallelism, which part of the
    checkpoint tensor this rank keeps: ``src = (dim, start, stop, full)`` takes ``[start, stop)`` along ``dim`` of
    a checkpoint tensor whose extent along ``dim`` is ``full``."""

    param: str
    expert: int | None = None
    rows: tuple[int, int] | None = None
    src: tuple[int, int, int, int] | None = None

    def view(self, params: dict[str, torch.Tensor]) -> torch.Tensor:
        p = params[self.param]
        if self.expert is not None:
            p = p[self.expert]
        if self.rows is not None:
            p = p[self.rows[0] : self.rows[1]]
        return p

    def take(self, tensor):
        """This rank's part of a checkpoint tensor (a torch tensor, or a safetensors slice read lazily)."""
        if self.src is None:
            return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
        dim, start, stop, _ = self.src
        return tensor[(slice(None),) * dim + (slice(start, stop),)]

    def check_source(self, name: str, shape: tuple[int, ...]) -> None:
        if self.src is None:
            return
        dim, _, _, full = self.src
        if len(shape) <= dim or shape[dim] != full:
            raise CheckpointError(f"tensor {name}: expected {full} along dim {dim} (the full tensor; this rank "
                                  f"keeps [{self.src[1]}, {self.src[2]})), found shape {tuple(shape)}")


def _rename(name: str, prefix_map: list[tuple[str, str]]) -> str:
    for ours, theirs in prefix_map:
        if name.startswith(ours):
            return theirs + name[len(ours) :]
    return name


def _source(shard, local: int) -> tuple[int, int, int, int] | None:
    """Slot.src of a part with ``local`` rows (or columns) on this rank; None when it is not sharded."""
    if shard is None:
        return None
    start = shard.rank * local
    valid = local if shard.valid is None else shard.valid
    full = local * shard.size if shard.full is None else shard.full
    return (shard.dim, start, start + valid, full)


def hf_layout(model: nn.Module, prefix_map: list[tuple[str, str]] | None = None) -> dict[str, Slot]:
    """Checkpoint name -> Slot, for every parameter of ``model``.

    Modules with ``hf_row_splits`` ({param attr: [(checkpoint name relative to the parent module, rows[,
    shard])]}) stack several checkpoint tensors by rows; stacked experts (``experts.w13`` / ``experts.w2``) expand
    to one tensor per expert, and a fused shared expert stacked last (``Experts.shared_id``) to the shared expert's
    own tensors (``<parent>.shared_experts.{gate,up,down}_proj.*``, the names of the unfused shared MLP). Under
    tensor parallelism, modules record the ``Shard`` each sharded parameter (or part) holds (``tp_shards`` {attr:
    Shard}, or the third element of a row split), and the slots say which block of the checkpoint tensor to take.
    ``prefix_map`` renames module prefixes (e.g. ``mtp.body.`` -> ``model.layers.42.``); by default the model's
    own ``checkpoint_prefix_map()`` is used when it has one.
    """
    if prefix_map is None:
        prefix_map = model.checkpoint_prefix_map() if hasattr(model, "checkpoint_prefix_map") else []
    layout: dict[str, Slot] = {}
    split_params: set[str] = set()
    for mod_name, module in model.named_modules():
        for attr, parts in getattr(module, "hf_row_splits", {}).items():
            name = f"{mod_name}.{attr}" if mod_name else attr
            parent = mod_name.rsplit(".", 1)[0] + "." if "." in mod_name else ""
            start = 0
            for part, rows, *shard in parts:
                src = _source(shard[0] if shard else None, rows)
                layout[_rename(parent + part, prefix_map)] = Slot(name, rows=(start, start + rows), src=src)
                start += rows
            split_params.add(name)
    for mod_name, module in model.named_modules():
        shards = getattr(module, "tp_shards", {})
        for attr, p in module.named_parameters(recurse=False):
            name = f"{mod_name}.{attr}" if mod_name else attr
            if name not in split_params:
                layout.update(_param_slots(name, _rename(name, prefix_map), p, shards.get(attr),
                                           getattr(module, "shared_id", None)))
    return layout


def _param_slots(name: str, hf: str, p: torch.Tensor, shard, shared_id: int | None = None) -> dict[str, Slot]:
    """Slots of one parameter that is not a row split: stacked experts expand to one per expert."""
    attr = name.rsplit(".", 1)[-1]
    if attr in _EXPERT_SUFFIX and name.endswith(f"experts.{attr}"):
        return _expert_slots(name, hf[: -len(attr)], attr, p, shard, shared_id)
    if shard is None:
        return {hf: Slot(name)}
    local = p.shape[shard.dim]
    src = _source(shard, local)
    rows = None
    if shard.valid is not None and shard.valid < local:  # vocabulary padding: the tail rows are not in the file
        rows = (0, shard.valid)
    return {hf: Slot(name, rows=rows, src=src)}


# Stacked expert parameters -> the suffix of their per-expert checkpoint tensors (fp8 scales: weight_scale_inv).
_EXPERT_SUFFIX = {"w13": "weight", "w2": "weight", "w13_scale": "weight_scale_inv", "w2_scale": "weight_scale_inv"}


# A fused shared expert (``Experts.shared_id``) of the experts ``<parent>.experts`` lives in the checkpoint as
# ``<parent>.shared_experts`` (gate_proj / up_proj / down_proj, as the unfused MLP's ``hf_row_splits`` name them); its
# dummy weights are drawn as the unfused MLP's parameters ``<parent>.shared_experts.{gate_up,down}_proj.weight``.
SHARED_EXPERT = "shared_experts"
_SHARED_DUMMY = {"w13": "gate_up_proj.weight", "w2": "down_proj.weight"}


def _expert_prefix(base: str, e: int, shared_id: int | None) -> str:
    """``base`` (``<parent>.experts.``) + the checkpoint module of expert ``e``: ``{e}``, or the shared expert's."""
    if shared_id is not None and e == shared_id:
        return base[: -len("experts.")] + SHARED_EXPERT
    return f"{base}{e}"


def _expert_slots(name: str, base: str, attr: str, p: torch.Tensor, shard,
                  shared_id: int | None = None) -> dict[str, Slot]:
    """One slot per expert: w13 (and its scales) hold gate rows then up rows, w2 (and its scales) the down
    projection; under tensor parallelism each keeps this rank's block along the intermediate dimension (the fused
    shared expert too: the unfused shared MLP's column / row split is the same block). Expert ``shared_id`` takes
    the shared expert's checkpoint names."""
    suffix = _EXPERT_SUFFIX[attr]
    if attr.startswith("w13"):
        half = p.shape[1] // 2
        src = _source(shard, half)
        out = {}
        for e in range(p.shape[0]):
            prefix = _expert_prefix(base, e, shared_id)
            out[f"{prefix}.gate_proj.{suffix}"] = Slot(name, e, (0, half), src)
            out[f"{prefix}.up_proj.{suffix}"] = Slot(name, e, (half, 2 * half), src)
        return out
    src = _source(shard, p.shape[2])
    return {f"{_expert_prefix(base, e, shared_id)}.down_proj.{suffix}": Slot(name, e, src=src)
            for e in range(p.shape[0])}


def _fused_shared(model: nn.Module) -> dict[str, tuple[int, str]]:
    """Stacked expert parameters holding a fused shared expert -> (its index, the unfused shared MLP's parameter
    name that seeds its dummy weights), so that a fused dummy model has the unfused one's weights."""
    out: dict[str, tuple[int, str]] = {}
    for mod_name, module in model.named_modules():
        shared_id = getattr(module, "shared_id", None)
        if shared_id is None or not mod_name.endswith("experts") or "w13" not in module._parameters:
            continue
        parent = mod_name[: -len("experts")]
        for attr, mlp_param in _SHARED_DUMMY.items():
            out[f"{mod_name}.{attr}"] = (shared_id, f"{parent}{SHARED_EXPERT}.{mlp_param}")
    return out


def is_sharded(layout: dict[str, Slot]) -> bool:
    return any(slot.src is not None for slot in layout.values())


# Checkpoint tensors baton knows and deliberately does not load.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$|\.shared_head\.|layers\.\d+\.embed_tokens\.)")


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], total: int | None = None,
                 layout: dict[str, Slot] | None = None, desc: str = "loading weights",
                 ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Copy named checkpoint tensors into ``model``; every parameter must be filled exactly once. The tensors
    may also be safetensors slices (``get_slice``), of which only this rank's part is read.

    fp8: an fp8 tensor bound for a non-fp8 parameter (the layers an fp8 checkpoint quantises but baton keeps in
    bf16) is dequantised with its ``weight_scale_inv``; a non-fp8 tensor bound for an fp8 parameter (an expert or a
    dense projection: ``--quantization fp8`` on a bf16 checkpoint) is quantised here, this rank's part of it on its
    own, filling the matching scale slot too. An fp8 tensor bound for an fp8 parameter is copied with its scales,
    unless this rank's part of it does not start and end on a 128 x 128 block (a tensor-parallel shard of a narrow
    projection): that part is dequantised and quantised again on its own."""
    layout = hf_layout(model) if layout is None else layout
    params = dict(model.named_parameters())
    loader = _Loader(layout, params)
    unexpected: list[str] = []
    bar = tqdm(tensors, total=total, desc=desc, unit="tensor", disable=env.disable_progress(), leave=False)
    with torch.no_grad():
        for name, tensor in bar:
            if name in layout:
                loader.load(name, tensor)
            elif name.endswith(".weight_scale_inv"):
                loader.scale(name[: -len("_scale_inv")], tensor)
            elif not _IGNORED.search(name) and not name.startswith(ignore_prefixes):
                unexpected.append(name)
    if loader.pending:
        name = next(iter(loader.pending))
        raise CheckpointError(f"tensor {name} is fp8 but the checkpoint has no {name}_scale_inv")
    missing = [n for n in layout if n not in loader.filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        expected = tuple(layout[missing[0]].view(params).shape)
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]} (expected shape {expected}); "
                              f"missing: {', '.join(missing[:5])}{more}")
    if unexpected:
        log.warning("ignoring %d checkpoint tensors baton does not use, e.g. %s", len(unexpected), unexpected[0])


class _Loader:
    """Copies checkpoint tensors into their slots, converting between fp8 and the parameter dtype on the way."""

    def __init__(self, layout: dict[str, Slot], params: dict[str, torch.Tensor]) -> None:
        self.layout, self.params = layout, params
        self.filled: set[str] = set()
        self.scales: dict[str, torch.Tensor] = {}  # dense fp8 weights' scale_inv, by weight name
        self.pending: dict[str, object] = {}  # dense fp8 weights waiting for their scale

    def load(self, name: str, tensor) -> None:
        from baton.ops.quant import FP8_DTYPE

        dst = self.layout[name].view(self.params)
        if name.endswith("_scale_inv") and self._requantized(name[: -len("_scale_inv")]):
            self.scale(name[: -len("_scale_inv")], tensor)  # this rank's scales are made with its part
            return
        if _is_fp8(tensor) and (dst.dtype != FP8_DTYPE or self._requantized(name)) and not name.endswith("_scale_inv"):
            if name not in self.scales:
                self.pending[name] = tensor
                return
            tensor = _dequantize(tensor, self.scales.pop(name), torch.float32 if dst.dtype == FP8_DTYPE else dst.dtype)
        if dst.dtype == FP8_DTYPE and not _is_fp8(tensor):
            self._quantize(name, tensor)
            return
        self._copy(name, tensor)

    def scale(self, weight_name: str, tensor) -> None:
        self.scales[weight_name] = _full(tensor)
        if weight_name in self.pending:
            self.load(weight_name, self.pending.pop(weight_name))

    def _requantized(self, name: str) -> bool:
        """An fp8 parameter slot whose part of the checkpoint tensor cuts through its 128 x 128 blocks."""
        from baton.ops.quant import FP8_DTYPE
        from baton.ops.quant.fp8 import BLOCK

        slot = self.layout.get(name)
        if slot is None or slot.src is None or self.params[slot.param].dtype != FP8_DTYPE:
            return False
        _, start, stop, full = slot.src
        return start % BLOCK != 0 or (stop % BLOCK != 0 and stop != full)

    def _quantize(self, name: str, tensor) -> None:
        """A non-fp8 checkpoint tensor into an fp8 slot: this rank's part quantised on its own, with its scales."""
        from baton.ops.quant import quantize_fp8_block

        scale_name = name + "_scale_inv"
        if scale_name not in self.layout:
            raise CheckpointError(f"tensor {name}: an fp8 parameter without a scale slot {scale_name}")
        slot = self.layout[name]
        slot.check_source(name, _shape(tensor))
        q, s = quantize_fp8_block(_full(slot.take(tensor)))
        self._place(name, q)
        self._place(scale_name, s)

    def _copy(self, name: str, tensor) -> None:
        slot = self.layout[name]
        slot.check_source(name, _shape(tensor))
        self._place(name, slot.take(tensor))

    def _place(self, name: str, part: torch.Tensor) -> None:
        """Copy this rank's part of a checkpoint tensor into its slot."""
        slot = self.layout[name]
        dst = slot.view(self.params)
        if tuple(part.shape) != tuple(dst.shape):
            what = "" if slot.src is None else " (this rank's part)"
            raise CheckpointError(f"tensor {name}: expected shape {tuple(dst.shape)}{what}, found {tuple(part.shape)}")
        dst.copy_(part.to(dst.dtype))
        self.filled.add(name)


def _full(tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor[:]


def _is_fp8(tensor) -> bool:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    return str(tensor.get_dtype()).startswith("F8")


def _dequantize(tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    from baton.ops.quant import dequantize_fp8_block

    return dequantize_fp8_block(_full(tensor), scale_inv, dtype)


def _shape(tensor) -> tuple[int, ...]:
    return tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else tuple(tensor.get_shape())


def safetensors_files(model_path: str) -> list[str]:
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        for fn in files:
            if not os.path.isfile(os.path.join(model_path, fn)):
                raise CheckpointError(f"{index} names shard {fn}, which does not exist")
        return [os.path.join(model_path, fn) for fn in files]
    files = sorted(fn for fn in os.listdir(model_path) if fn.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{model_path}: no *.safetensors files (use --load-format dummy for random weights)")
    return [os.path.join(model_path, fn) for fn in files]


def _open(fn: str):
    try:
        return safe_open(fn, framework="pt")
    except Exception as e:  # safetensors raises its own error types for corrupt headers
        raise CheckpointError(f"{fn}: not a readable safetensors file ({e})") from e


def iter_safetensors(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    return _iter_entries(files, "get_tensor")


def iter_safetensors_slices(files: list[str]) -> Iterator[tuple[str, object]]:
    """Like iter_safetensors, but lazy slices: a tensor-parallel rank reads only its part of each tensor."""
    return _iter_entries(files, "get_slice")


def _iter_entries(files: list[str], read: str) -> Iterator[tuple[str, object]]:
    """(name, ``f.<read>(name)``) of every tensor of every file; a tensor that cannot be read names itself."""
    for fn in files:
        with _open(fn) as f:
            for name in f.keys():
                try:
                    yield name, getattr(f, read)(name)
                except Exception as e:
                    raise CheckpointError(f"{fn}: tensor {name} cannot be read ({e})") from e


def count_tensors(files: list[str]) -> int:
    total = 0
    for fn in files:
        with _open(fn) as f:
            total += len(list(f.keys()))
    return total


def load_safetensors(model: nn.Module, model_path: str, ignore_prefixes: tuple[str, ...] = ()) -> None:
    files = safetensors_files(model_path)
    layout = hf_layout(model)
    tensors = iter_safetensors_slices(files) if is_sharded(layout) else iter_safetensors(files)
    load_tensors(model, tensors, total=count_tensors(files), layout=layout, ignore_prefixes=ignore_prefixes)


def _seed_for(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_dummy_weights(model: nn.Module, seed: int = 0, full_model: nn.Module | None = None) -> None:
    """Deterministic random weights, generated on the parameters' own device in their own dtype.

    Scales keep activations O(1) through any depth: linear weights ~ N(0, 1/fan_in), norms 1, embeddings
    N(0, 1), KDA's A_log and dt_bias in their trained ranges, small expert biases.

    ``full_model`` is the single-rank twin (shapes only, on meta) of a tensor-parallel ``model``: each of its
    parameters is drawn whole, exactly as a single-rank model draws it, and this rank keeps its slices, so a
    tensor-parallel dummy model is the single-rank dummy model split (one full parameter at a time on the
    device)."""
    if full_model is not None:
        _init_dummy_sliced(model, full_model, seed)
        return
    params = dict(model.named_parameters())
    layout = hf_layout(model) if any(n.endswith(".weight_scale_inv") for n in params) else {}
    shared = _fused_shared(model)
    with torch.no_grad():
        for name, p in tqdm(list(model.named_parameters()), desc="dummy weights", unit="tensor",
                            disable=env.disable_progress(), leave=False):
            if p.device.type != "meta":
                _init_param(name, p, seed, params, layout, shared=shared.get(name))


def _init_param(name: str, p: torch.Tensor, seed: int, params: dict[str, torch.Tensor] | None = None,
                layout: dict[str, Slot] | None = None, full_layout: dict[str, Slot] | None = None,
                shared: tuple[int, str] | None = None) -> None:
    """``shared`` (stacked experts with a fused shared expert): (its index, the unfused shared MLP parameter whose
    draw it takes): the routed experts are drawn as without it, the shared one as the unfused MLP's weight."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in ("w13_scale", "w2_scale", "weight_scale_inv"):
        return  # filled with their fp8 weights
    if shared is not None:
        _init_fused_experts(name, p, seed, params, *shared)
        return
    gen = torch.Generator(device=p.device).manual_seed(_seed_for(seed, name))
    if p.dtype == torch.float8_e4m3fn:
        if leaf in ("w13", "w2"):
            _init_fp8_experts(name, p, gen, params)
        else:
            _init_fp8_dense(name, p, gen, params, layout, full_layout)
        return
    if name.endswith("norm.weight") or "layernorm" in name or leaf in ("enorm", "hnorm"):
        p.fill_(1.0)
    elif leaf == "A_log":
        p.uniform_(0.0, 2.77, generator=gen)  # exp(A_log) in [1, 16]
    elif leaf == "dt_bias":
        p.normal_(0.0, 0.5, generator=gen)
    elif leaf == "expert_bias":
        p.normal_(0.0, 0.01, generator=gen)
    elif "conv1d" in name:
        p.normal_(0.0, 0.5, generator=gen)
    elif "embed" in name:
        p.normal_(0.0, 1.0, generator=gen)
    else:
        fan_in = p.shape[-1]
        p.normal_(0.0, fan_in**-0.5, generator=gen)


def _init_fused_experts(name: str, p: torch.Tensor, seed: int, params: dict[str, torch.Tensor] | None,
                        shared_id: int, mlp_name: str) -> None:
    """Stacked experts whose expert ``shared_id`` is a fused shared expert: the routed ones drawn as a stack without
    it, the shared one exactly as the unfused shared MLP's weight ``mlp_name`` (its generator, N(0, 1/fan_in); fp8:
    drawn in fp32 and quantised per checkpoint part, as ``_init_fp8_dense`` does), so fused and unfused dummy models
    hold the same weights."""
    from baton.ops.quant import quantize_fp8_block, quantize_fp8_gate_up

    scale = None if params is None else params.get(name + "_scale")
    _init_param(name, p[:shared_id], seed, None if scale is None else {name + "_scale": scale[:shared_id]})
    gen = torch.Generator(device=p.device).manual_seed(_seed_for(seed, mlp_name))
    w = p[shared_id]
    if p.dtype != torch.float8_e4m3fn:
        w.normal_(0.0, w.shape[-1] ** -0.5, generator=gen)
        return
    full = torch.empty(w.shape, device=p.device, dtype=torch.float32).normal_(0.0, w.shape[-1] ** -0.5, generator=gen)
    q, s = (quantize_fp8_gate_up if name.endswith("w13") else quantize_fp8_block)(full)
    w.copy_(q)
    scale[shared_id].copy_(s)


def _init_fp8_experts(name: str, p: torch.Tensor, gen: torch.Generator, params: dict[str, torch.Tensor]) -> None:
    """Dummy fp8 experts: each expert drawn in fp32 (N(0, 1/fan_in)) and block-quantised, one at a time."""
    from baton.ops.quant import quantize_fp8_block, quantize_fp8_gate_up

    scale = params[name + "_scale"]
    quantize = quantize_fp8_gate_up if name.endswith("w13") else quantize_fp8_block
    for e in range(p.shape[0]):
        w = torch.empty(p.shape[1:], device=p.device, dtype=torch.float32).normal_(0.0, p.shape[-1] ** -0.5,
                                                                                     generator=gen)
        q, s = quantize(w)
        p[e].copy_(q)
        scale[e].copy_(s)


def _init_fp8_dense(name: str, p: torch.Tensor, gen: torch.Generator, params: dict[str, torch.Tensor],
                    layout: dict[str, Slot], full_layout: dict[str, Slot] | None = None) -> None:
    """A dummy fp8 dense weight: drawn in fp32 exactly as the fp32 model's (N(0, 1/fan_in), the same generator),
    then each checkpoint part quantised as the loader quantises a bf16 checkpoint. ``full_layout``: ``p`` is the
    single-rank twin's weight (tensor parallelism); this rank's part of each checkpoint part is taken from it and
    quantised on its own into ``params`` (``layout``: this rank's slots)."""
    from baton.ops.quant import quantize_fp8_block

    w = torch.empty(p.shape, device=p.device, dtype=torch.float32).normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    source = layout if full_layout is None else full_layout
    for ckpt, slot in _slots_of(source).get(name, []):
        part = slot.view({name: w})
        mine = layout[ckpt]
        q, s = quantize_fp8_block(part if full_layout is None else mine.take(part))
        mine.view(params).copy_(q)
        layout[ckpt + "_scale_inv"].view(params).copy_(s)


_SLOTS_OF: dict[int, tuple[dict[str, Slot], dict[str, list[tuple[str, Slot]]]]] = {}


def _slots_of(layout: dict[str, Slot]) -> dict[str, list[tuple[str, Slot]]]:
    """Parameter name -> its (checkpoint name, Slot)s, indexed once per layout (dummy fp8 dense weights look theirs
    up one parameter at a time)."""
    hit = _SLOTS_OF.get(id(layout))
    if hit is None or hit[0] is not layout:
        index: dict[str, list[tuple[str, Slot]]] = {}
        for ckpt, slot in layout.items():
            index.setdefault(slot.param, []).append((ckpt, slot))
        _SLOTS_OF.clear()
        _SLOTS_OF[id(layout)] = hit = (layout, index)
    return hit[1]


def _init_dummy_sliced(model: nn.Module, full_model: nn.Module, seed: int) -> None:
    layout, full_layout = hf_layout(model), hf_layout(full_model)
    shared = _fused_shared(full_model)
    names_of: dict[str, list[str]] = {}
    for ckpt, slot in full_layout.items():
        names_of.setdefault(slot.param, []).append(ckpt)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    with torch.no_grad():
        full_params = dict(full_model.named_parameters())
        for name, p in tqdm(list(full_params.items()), desc="dummy weights", unit="tensor",
                            disable=env.disable_progress(), leave=False):
            if name.endswith(("w13_scale", "w2_scale", "weight_scale_inv")):
                continue  # drawn with their fp8 weights
            if p.dtype == torch.float8_e4m3fn and not name.endswith(("w13", "w2")):  # fp8 dense: quantised per rank
                _init_param(name, torch.empty(p.shape, dtype=p.dtype, device=device), seed, params, layout,
                            full_layout)
                continue
            fulls = {name: torch.empty(p.shape, dtype=p.dtype, device=device)}
            if name + "_scale" in full_params:  # fp8 experts: the weight and its block scales together
                scale = full_params[name + "_scale"]
                fulls[name + "_scale"] = torch.empty(scale.shape, dtype=scale.dtype, device=device)
            _init_param(name, fulls[name], seed, fulls, shared=shared.get(name))
            for full_name in fulls:
                for ckpt in names_of.get(full_name, []):
                    mine = layout[ckpt]
                    mine.view(params).copy_(mine.take(full_layout[ckpt].view(fulls)))


def _rewrite_checkpoint(path: str, convert) -> None:
    """Rewrite each safetensors file of the checkpoint directory ``path`` with ``convert(name, tensor)`` (a dict of
    the tensors to write for it); a file whose tensors all come back unchanged is left alone."""
    for fn in safetensors_files(path):
        with safe_open(fn, "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        out: dict[str, torch.Tensor] = {}
        for k, t in tensors.items():
            out.update(convert(k, t))
        if out.keys() != tensors.keys() or any(out[k] is not tensors[k] for k in out):
            save_file({k: v.contiguous() for k, v in out.items()}, fn, metadata=meta)


def cast_checkpoint(path: str, dtype: torch.dtype) -> None:
    """Rewrite the safetensors files of a checkpoint directory with every floating tensor in ``dtype`` (drafts
    train in fp32 and ship in bf16). fp8 weights and their scales are left as they are."""

    def convert(k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        if t.is_floating_point() and not _is_fp8(t) and not k.endswith("_scale_inv") and t.dtype != dtype:
            return {k: t.to(dtype)}
        return {k: t}

    _rewrite_checkpoint(path, convert)


def quantize_checkpoint_fp8(path: str, min_dim: int = 16) -> int:
    """Rewrite a draft checkpoint directory with its matrices in fp8 e4m3 and 128 x 128 block scales: every 2-d
    floating ``*.weight`` with both dims >= ``min_dim`` becomes fp8 plus ``*.weight_scale_inv`` (fp32), the layout
    of the published fp8 checkpoints, which ``load_tensors`` dequantises into the (bf16) parameters; every other
    floating tensor becomes bf16. Half the bytes of a bf16 draft. Returns the number of quantised tensors."""
    from baton.ops.quant.fp8 import quantize_fp8_block

    count = 0

    def convert(k: str, t: torch.Tensor) -> dict[str, torch.Tensor]:
        nonlocal count
        if _is_fp8(t) or k.endswith("_scale_inv") or not t.is_floating_point():
            return {k: t}
        if t.dim() == 2 and k.endswith(".weight") and min(t.shape) >= min_dim:
            q, scale_inv = quantize_fp8_block(t.float())
            count += 1
            return {k: q, k + "_scale_inv": scale_inv.float()}
        return {k: t.to(torch.bfloat16)}

    _rewrite_checkpoint(path, convert)
    return count


def save_hf_checkpoint(model: nn.Module, cfg: ModelConfig | dict, path: str, max_shard_bytes: int = 2 << 30,
                       dtype: torch.dtype | None = None, layout: dict[str, Slot] | None = None) -> None:
    """Write ``model`` in the Hugging Face layout (unfused names), sharded with an index when large."""
    layout = hf_layout(model) if layout is None else layout
    if is_sharded(layout):
        raise CheckpointError("cannot write a checkpoint from one tensor-parallel rank's shard; "
                              "write it at --tp-size 1")
    os.makedirs(path, exist_ok=True)
    params = dict(model.named_parameters())
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, slot in layout.items():
        t = slot.view(params).detach()
        if dtype is not None and t.is_floating_point() and t.dtype not in (torch.float32, torch.float8_e4m3fn):
            t = t.to(dtype)
        t = t.contiguous().cpu().clone()
        if size + t.nbytes > max_shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += t.nbytes
    cfg_dict = cfg if isinstance(cfg, dict) else config_to_dict(cfg)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg_dict, f, indent=2)
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fn), metadata={"format": "pt"})
        weight_map.update({n: fn for n in shard})
    total = sum(t.nbytes for s in shards for t in s.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def parse_dtype(name: str, device: torch.device) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in table:
        raise ConfigError(f"--dtype {name}: choose auto, float32, bfloat16 or float16")
    return table[name]
