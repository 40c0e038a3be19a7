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
    to one tensor per expert. Under tensor parallelism, modules record the ``Shard`` each sharded parameter (or
    part) holds (``tp_shards`` {attr: Shard}, or the third element of a row split), and the slots say which
    block of the checkpoint tensor to take. ``prefix_map`` renames module prefixes (e.g. ``mtp.body.`` ->
    ``model.layers.42.``); by default the model's own ``checkpoint_prefix_map()`` is used when it has one.
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
                layout.update(_param_slots(name, _rename(name, prefix_map), p, shards.get(attr)))
    return layout


def _param_slots(name: str, hf: str, p: torch.Tensor, shard) -> dict[str, Slot]:
    """Slots of one parameter that is not a row split: stacked experts expand to one per expert."""
    if name.endswith("experts.w13"):
        inter = p.shape[1] // 2
        src = _source(shard, inter)
        base = hf[: -len("w13")]
        out = {}
        for e in range(p.shape[0]):
            out[f"{base}{e}.gate_proj.weight"] = Slot(name, e, (0, inter), src)
            out[f"{base}{e}.up_proj.weight"] = Slot(name, e, (inter, 2 * inter), src)
        return out
    if name.endswith("experts.w2"):
        src = _source(shard, p.shape[2])
        base = hf[: -len("w2")]
        return {f"{base}{e}.down_proj.weight": Slot(name, e, src=src) for e in range(p.shape[0])}
    if shard is None:
        return {hf: Slot(name)}
    local = p.shape[shard.dim]
    src = _source(shard, local)
    rows = None
    if shard.valid is not None and shard.valid < local:  # vocabulary padding: the tail rows are not in the file
        rows = (0, shard.valid)
    return {hf: Slot(name, rows=rows, src=src)}


def is_sharded(layout: dict[str, Slot]) -> bool:
    return any(slot.src is not None for slot in layout.values())


# Checkpoint tensors baton knows and deliberately does not load.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq$|\.shared_head\.|layers\.\d+\.embed_tokens\.)")


def load_tensors(model: nn.Module, tensors: Iterable[tuple[str, torch.Tensor]], total: int | None = None,
                 layout: dict[str, Slot] | None = None, desc: str = "loading weights",
                 ignore_prefixes: tuple[str, ...] = ()) -> None:
    """Copy named checkpoint tensors into ``model``; every parameter must be filled exactly once. The tensors
    may also be safetensors slices (``get_slice``), of which only this rank's part is read."""
    layout = hf_layout(model) if layout is None else layout
    params = dict(model.named_parameters())
    filled: set[str] = set()
    unexpected: list[str] = []
    bar = tqdm(tensors, total=total, desc=desc, unit="tensor", disable=env.disable_progress(), leave=False)
    with torch.no_grad():
        for name, tensor in bar:
            slot = layout.get(name)
            if slot is None:
                if not _IGNORED.search(name) and not name.startswith(ignore_prefixes):
                    unexpected.append(name)
                continue
            dst = slot.view(params)
            slot.check_source(name, _shape(tensor))
            part = slot.take(tensor)
            if tuple(part.shape) != tuple(dst.shape):
                what = "" if slot.src is None else " (this rank's part)"
                raise CheckpointError(
                    f"tensor {name}: expected shape {tuple(dst.shape)}{what}, found {tuple(part.shape)}"
                )
            dst.copy_(part.to(dst.dtype))
            filled.add(name)
    missing = [n for n in layout if n not in filled]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        expected = tuple(layout[missing[0]].view(params).shape)
        raise CheckpointError(f"checkpoint is missing tensor {missing[0]} (expected shape {expected}); "
                              f"missing: {', '.join(missing[:5])}{more}")
    if unexpected:
        log.warning("ignoring %d checkpoint tensors baton does not use, e.g. %s", len(unexpected), unexpected[0])


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
    for fn in files:
        with _open(fn) as f:
            for name in f.keys():
                try:
                    yield name, f.get_tensor(name)
                except Exception as e:
                    raise CheckpointError(f"{fn}: tensor {name} cannot be read ({e})") from e


def iter_safetensors_slices(files: list[str]) -> Iterator[tuple[str, object]]:
    """Like iter_safetensors, but lazy slices: a tensor-parallel rank reads only its part of each tensor."""
    for fn in files:
        with _open(fn) as f:
            for name in f.keys():
                try:
                    yield name, f.get_slice(name)
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
    with torch.no_grad():
        for name, p in tqdm(list(model.named_parameters()), desc="dummy weights", unit="tensor",
                            disable=env.disable_progress(), leave=False):
            if p.device.type != "meta":
                _init_param(name, p, seed)


def _init_param(name: str, p: torch.Tensor, seed: int) -> None:
    gen = torch.Generator(device=p.device).manual_seed(_seed_for(seed, name))
    leaf = name.rsplit(".", 1)[-1]
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


def _init_dummy_sliced(model: nn.Module, full_model: nn.Module, seed: int) -> None:
    layout, full_layout = hf_layout(model), hf_layout(full_model)
    names_of: dict[str, list[str]] = {}
    for ckpt, slot in full_layout.items():
        names_of.setdefault(slot.param, []).append(ckpt)
    params = dict(model.named_parameters())
    device = next(iter(params.values())).device
    with torch.no_grad():
        for name, p in tqdm(list(full_model.named_parameters()), desc="dummy weights", unit="tensor",
                            disable=env.disable_progress(), leave=False):
            full = torch.empty(p.shape, dtype=p.dtype, device=device)
            _init_param(name, full, seed)
            for ckpt in names_of.get(name, []):
                mine = layout[ckpt]
                mine.view(params).copy_(mine.take(full_layout[ckpt].view({name: full})))


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
        if dtype is not None and t.is_floating_point() and t.dtype != torch.float32:
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
