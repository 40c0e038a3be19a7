"""Tokenizer built from the embedded GGUF (round trip, chat template, EOS ids, on-disk cache), HF-directory
loading, and IncrementalDetokenizer streaming (multi-byte characters, no partial U+FFFD)."""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest

from baton import tokenizer as tokmod
from baton.models.gguf import EmbeddedModelNotFound, find_embedded_gguf
from baton.tokenizer import (
    IncrementalDetokenizer,
    Tokenizer,
    TokenizerError,
    gguf_tokenizer_cache_dir,
    load_tokenizer,
)

pytest.importorskip("transformers", reason="baton's tokenizer wraps a transformers fast tokenizer")

try:
    GGUF_PATH = find_embedded_gguf()
except EmbeddedModelNotFound as e:
    pytest.skip(f"embedded SmolLM2 GGUF absent ({e})", allow_module_level=True)

CHAT_EXPECTED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
)
TEXTS = [
    "Hello, world!",
    "héllo 世界 🎉",
    "  leading spaces, tabs\tand\nnew lines\n\n",
    "numbers 1234567 and 3.14159; code: def f(x): return x**2",
    "Ünïcödé: Ελληνικά, русский, العربية, 日本語のテキスト, 👩‍👩‍👧‍👦",
]


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("baton-cache")
    old = os.environ.get("BATON_CACHE_DIR")
    os.environ["BATON_CACHE_DIR"] = str(root)
    yield root
    if old is None:
        os.environ.pop("BATON_CACHE_DIR", None)
    else:
        os.environ["BATON_CACHE_DIR"] = old


@pytest.fixture(scope="module")
def tok(cache_root) -> Tokenizer:
    t0 = time.perf_counter()
    t = load_tokenizer(gguf_path=GGUF_PATH)
    print(f"cold GGUF tokenizer load: {time.perf_counter() - t0:.2f} s")
    return t


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (independent of the code under test)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def _byte_token(tok: Tokenizer, byte: int) -> int:
    tid = tok.hf.convert_tokens_to_ids(_bytes_to_unicode()[byte])
    assert isinstance(tid, int) and tid != tok.hf.unk_token_id
    return tid


# ---- Tokenizer ----


def test_basic_properties(tok: Tokenizer) -> None:
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1 and tok.bos_token == "<|im_start|>"
    assert tok.eos_token_id == 2 and tok.eos_token == "<|im_end|>"
    assert tok.eos_token_ids == {2}  # the GGUF declares eos=2 and no eot/eom
    assert tok.pad_token_id == 2
    assert tok.num_special_tokens_to_add() == 0  # add_bos_token is false
    assert tok.has_chat_template
    assert tok.name_or_path == GGUF_PATH
    assert tok.hf.is_fast


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert ids and all(isinstance(i, int) for i in ids)
    assert tok.decode(ids) == text


def test_known_encodings(tok: Tokenizer) -> None:
    # SmolLM's pre-tokenizer splits every digit off before the GPT-2 regex.
    assert len(tok.encode("12345")) == 5
    assert tok.encode("<|im_start|>user\nhi<|im_end|>")[:1] == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.encode("<|endoftext|>") == [0]
    assert tok.encode("hi", add_special_tokens=True) == tok.encode("hi")


def test_special_tokens_skipped_in_decode(tok: Tokenizer) -> None:
    ids = tok.encode("<|im_start|>assistant\nParis.<|im_end|>")
    assert tok.decode(ids) == "assistant\nParis."
    assert tok.decode(ids, skip_special_tokens=False) == "<|im_start|>assistant\nParis.<|im_end|>"


def test_chat_template(tok: Tokenizer) -> None:
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    assert tok.apply_chat_template(msgs) == CHAT_EXPECTED
    assert (
        tok.apply_chat_template(msgs, add_generation_prompt=False) == CHAT_EXPECTED[: -len("<|im_start|>assistant\n")]
    )
    assert tok.apply_chat_template(msgs, tokenize=False) == CHAT_EXPECTED  # tokenize is ignored
    sys_msgs = [{"role": "system", "content": "Be brief."}, *msgs]
    assert tok.apply_chat_template(sys_msgs).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user")


def test_cache_is_written_and_reused(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    cache = gguf_tokenizer_cache_dir(GGUF_PATH)
    assert cache.is_dir()
    names = set(os.listdir(cache))
    assert {
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        tokmod._CACHE_MARKER,
    } <= names
    assert not [n for n in os.listdir(cache.parent) if n.startswith(".")]  # no leftover temp dirs

    def boom(*a, **k):
        raise AssertionError("the cached tokenizer should have been used")

    monkeypatch.setattr(tokmod, "_convert_gguf_tokenizer", boom)
    t0 = time.perf_counter()
    again = load_tokenizer(gguf_path=GGUF_PATH)
    dt = time.perf_counter() - t0
    print(f"cached GGUF tokenizer load: {dt:.2f} s")
    assert dt < 5.0  # ~0.2 s normally; generous for loaded CI machines
    assert again.encode(TEXTS[3]) == tok.encode(TEXTS[3])
    assert again.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]) == CHAT_EXPECTED
    assert again.eos_token_ids == tok.eos_token_ids


def test_default_is_embedded_and_gguf_path_as_path(tok: Tokenizer) -> None:
    assert load_tokenizer().name_or_path == GGUF_PATH
    assert load_tokenizer(GGUF_PATH).name_or_path == GGUF_PATH


def test_broken_cache_entry_is_rebuilt(tok: Tokenizer, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    cache = gguf_tokenizer_cache_dir(GGUF_PATH)
    cache.mkdir(parents=True)
    (cache / "tokenizer.json").write_text("{ truncated")  # no marker: an interrupted, non-atomic write
    t = load_tokenizer(gguf_path=GGUF_PATH)
    assert t.encode(TEXTS[1]) == tok.encode(TEXTS[1])
    assert (cache / tokmod._CACHE_MARKER).is_file()


def test_unloadable_cache_entry_is_rebuilt(tok: Tokenizer, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    load_tokenizer(gguf_path=GGUF_PATH)
    cache = gguf_tokenizer_cache_dir(GGUF_PATH)
    (cache / "tokenizer.json").write_text("{ corrupted")  # marker present, contents bad
    t = load_tokenizer(gguf_path=GGUF_PATH)
    assert t.encode(TEXTS[1]) == tok.encode(TEXTS[1])
    assert oct(cache.stat().st_mode & 0o777) == oct(0o755)


def test_hf_directory(tok: Tokenizer, tmp_path) -> None:
    d = tmp_path / "model"
    shutil.copytree(gguf_tokenizer_cache_dir(GGUF_PATH), d)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": [2, 0]}))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    t = load_tokenizer(str(d))
    assert t.name_or_path == str(d)
    assert t.eos_token_ids == {0, 2}
    assert t.encode(TEXTS[4]) == tok.encode(TEXTS[4])

    (d / "chat_template.jinja").unlink()
    t = load_tokenizer(str(d))
    assert not t.has_chat_template
    with pytest.raises(TokenizerError, match="no chat template"):
        t.apply_chat_template([{"role": "user", "content": "hi"}])


def test_missing_paths(tmp_path) -> None:
    with pytest.raises(TokenizerError, match="not a local directory"):
        load_tokenizer(str(tmp_path / "nope"))
    with pytest.raises(TokenizerError, match="does not exist"):
        load_tokenizer(gguf_path=str(tmp_path / "nope.gguf"))


# ---- IncrementalDetokenizer ----


def _stream(tok: Tokenizer, ids: list[int], chunk: int = 1, **kw) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kw)
    deltas = [detok.add(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas, detok


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_detok_matches_decode(tok: Tokenizer, text: str, chunk: int) -> None:
    ids = tok.encode(text)
    deltas, detok = _stream(tok, ids, chunk)
    assert "".join(deltas) == tok.decode(ids) == detok.text == text
    assert not any("\ufffd" in d for d in deltas)


def test_detok_multibyte_one_token_at_a_time(tok: Tokenizer) -> None:
    text = "héllo 世界 🎉"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # some characters really are split across tokens
    deltas, detok = _stream(tok, ids)
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    assert "" in deltas[:-1]  # text was held back while a character was incomplete
    assert deltas[-1] == ""  # nothing left for flush


def test_detok_holds_split_character(tok: Tokenizer) -> None:
    ids = [_byte_token(tok, b) for b in "世".encode()]
    detok = IncrementalDetokenizer(tok)
    assert [detok.add([i]) for i in ids] == ["", "", "世"]


def test_detok_with_prompt_and_specials(tok: Tokenizer) -> None:
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Say hi in Chinese"}]))
    gen = tok.encode("你好! 👋 Hello<|im_end|>")
    deltas, _ = _stream(tok, gen, prompt_ids=prompt)
    assert "".join(deltas) == tok.decode(gen) == "你好! 👋 Hello"
    assert not any("\ufffd" in d for d in deltas)
    deltas, _ = _stream(tok, gen, prompt_ids=prompt, skip_special_tokens=False)
    assert "".join(deltas) == "你好! 👋 Hello<|im_end|>"


def test_detok_incomplete_tail_released_by_flush(tok: Tokenizer) -> None:
    ids = tok.encode("ok ") + [_byte_token(tok, b) for b in "🎉".encode()[:2]]
    deltas, _ = _stream(tok, ids)
    assert "".join(deltas[:-1]) == "ok "
    assert deltas[-1] == "\ufffd"
    assert "".join(deltas) == tok.decode(ids)


def test_detok_invalid_bytes_are_not_held_forever(tok: Tokenizer) -> None:
    """A run of stray continuation bytes decodes to real U+FFFDs; they are released, and the stream
    still equals decode(all)."""
    ids = tok.encode("a") + [_byte_token(tok, 0x80)] * 20 + tok.encode("b 世界")
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add([i]) for i in ids[:21]]
    assert len("".join(deltas)) > 1  # released before flush
    deltas += [detok.add([i]) for i in ids[21:]] + [detok.flush()]
    assert "".join(deltas) == tok.decode(ids)


def test_detok_window_stays_small(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> None:
    ids = tok.encode("The quick brown fox jumps over the lazy dog. " * 40)
    detok = IncrementalDetokenizer(tok)
    sizes: list[int] = []
    inner = detok._decode_fn
    detok._decode_fn = lambda x, **kw: (sizes.append(len(x)), inner(x, **kw))[1]
    for i in ids:
        detok.add([i])
    assert max(sizes) <= 4
    assert detok.text == tok.decode(ids)


def test_a_config_only_directory_gets_token_ids_without_trying_transformers(tmp_path, caplog, capsys):
    import logging

    from baton.config import parse_model_config
    from baton.engine.load import tokenizer_for
    from baton.tokenizer import IdTokenizer
    from tests.conftest import TINY_LING

    (tmp_path / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING):
        tok = tokenizer_for(str(tmp_path), parse_model_config(dict(TINY_LING)))
    assert isinstance(tok, IdTokenizer)
    assert "no tokenizer files in" in caplog.text
    assert "transformers" not in capsys.readouterr().err  # no AutoTokenizer attempt, so none of its warnings
