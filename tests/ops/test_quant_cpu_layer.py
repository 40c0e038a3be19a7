"""The CPU step of a GGUF-quantized Llama (kernels.c ``bq_llama_layer`` / ``bq_llama_stack``, called from
baton.models.llama) against the plain-PyTorch layers on the same quantized weights, on a tiny random model: prefill,
verify and decode rows, captures, the per-layer and whole-stack entry points, thread counts, and every kernel code
path this CPU runs (head_dim 64: the AVX-512 attention). Fast (a tiny model; the kernels build once per machine)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import baton.models.llama as llama
from baton.config import parse_model_config
from baton.layers.context import ModelRunner
from baton.layers.linear import QuantizedWeight, quantize_weight_, quantized
from baton.models.build import build_model
from baton.models.checkpoint import init_dummy_weights
from baton.ops.quant_cpu import native
from baton.types import ForwardMode

gguf_quants = pytest.importorskip("gguf.quants", reason="gguf-py quantises the tiny model's weights")
from gguf.constants import GGMLQuantizationType as T  # noqa: E402

if native.lib() is None:
    pytest.skip(f"the quantized CPU kernels do not build here ({native.error()})", allow_module_level=True)

TINY = dict(model_type="llama", vocab_size=100, hidden_size=128, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=True, eos_token_id=1, max_position_embeddings=256)


def _quantize(module: torch.nn.Module, fmt: str) -> torch.Tensor:
    """Replace module.weight by its GGUF quantisation; returns the dequantised fp32 weight."""
    w = module.weight.detach().numpy()
    raw = torch.from_numpy(np.ascontiguousarray(gguf_quants.quantize(w, T.Q4_1 if fmt == "q4_1" else T.Q8_0)))
    qw = QuantizedWeight.from_gguf(fmt, raw)
    quantize_weight_(module, qw)
    return qw.dequantize()


@pytest.fixture(scope="module")
def models():
    """(quantized model, the same weights dequantised into a plain fp32 model)."""
    cfg = parse_model_config(TINY)
    torch.manual_seed(0)
    quant = build_model(cfg, "cpu", torch.float32)
    init_dummy_weights(quant, 3)
    ref = build_model(cfg, "cpu", torch.float32)
    ref.load_state_dict(quant.state_dict())
    ref_modules = dict(ref.named_modules())
    for name, module in list(quant.named_modules()):
        if name.endswith(("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "embed_tokens")):
            w = _quantize(module, "q8_0" if name.endswith("embed_tokens") else "q4_1")
            with torch.no_grad():
                ref_modules[name].weight.copy_(w)
    return quant, ref


def _run(model, ids: list[int], chunks: list[int], capture=()) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Forward ``ids`` in consecutive chunks of the given sizes (the first a prefill, the others verify / decode
    rows) on a fresh cache: (hidden states of each chunk, captured layer outputs of the last chunk)."""
    runner = ModelRunner(model.make_cache(256, torch.float32, "cpu"), torch.device("cpu"))
    outs, pos = [], 0
    with torch.inference_mode():
        for i, n in enumerate(chunks):
            mode = ForwardMode.PREFILL if i == 0 else ForwardMode.VERIFY if n > 1 else ForwardMode.DECODE
            ctx = runner.context(mode, pos, n, capture=capture)
            outs.append(model(torch.tensor(ids[pos : pos + n]), ctx))
            pos += n
    return outs, ctx.captured


IDS = [int(i) for i in torch.randint(2, 100, (80,), generator=torch.Generator().manual_seed(7))]


@pytest.mark.parametrize("chunks", [[20, 5, 1, 1], [60, 9, 1]])  # <= 48 rows; more (eager at 1 thread)
def test_quantized_step_matches_reference(models, chunks):
    quant, ref = models
    got, _ = _run(quant, IDS, chunks)
    want, _ = _run(ref, IDS, chunks)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
    assert quant._cpu_stack_args is not False  # the whole-stack C call ran
    assert ref._cpu_stack_args is False  # (a plain fp32 model never takes it)


def test_verify_rows_equal_decode_rows(models):
    """The rows of a verify window equal the same tokens decoded one at a time, bit for bit (the kernels sum each
    row in one order whatever the row count): greedy speculative output equals plain output on this path too."""
    quant, _ = models
    window, _ = _run(quant, IDS, [30, 6])
    single, _ = _run(quant, IDS, [30, 1, 1, 1, 1, 1, 1])
    assert torch.equal(window[1], torch.cat(single[1:]))
    assert torch.equal(window[0], single[0])


def test_stack_layers_and_eager_agree(models, monkeypatch):
    """The whole-stack C call, the per-layer C call and the eager layers on the quantized weights."""
    quant, _ = models
    stack, cap_stack = _run(quant, IDS, [12, 3, 1], capture=(0, 2))
    monkeypatch.setattr(llama, "_cpu_stack_forward", lambda *a: None)
    layers, cap_layers = _run(quant, IDS, [12, 3, 1], capture=(0, 2))
    for a, b in zip(cap_stack, cap_layers, strict=True):
        assert torch.equal(a, b)  # the same C layer either way
    for a, b in zip(stack, layers, strict=True):  # the final norm: C there, torch here
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert len(cap_stack) == 2 and cap_stack[0].shape == (1, 128)
    monkeypatch.setattr(llama, "_fused_cpu_step", lambda *a: False)
    eager, cap_eager = _run(quant, IDS, [12, 3, 1], capture=(0, 2))
    for a, b in zip(stack + cap_stack, eager + cap_eager, strict=True):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_long_prefill_in_chunks(models, monkeypatch):
    """With several threads a prefill past FUSED_MAX_ROWS runs on the C stack too, STACK_CHUNK rows per call (each
    chunk attending to the cache the earlier ones wrote); with one thread it takes the eager layers."""
    quant, ref = models
    monkeypatch.setattr(llama, "STACK_CHUNK", 16)
    before = torch.get_num_threads()
    calls = []
    real = llama._cpu_stack_forward

    def spy(*a):
        out = real(*a)
        if a[0] is quant:
            calls.append((torch.get_num_threads(), a[1].shape[0], out is not None))
        return out

    monkeypatch.setattr(llama, "_cpu_stack_forward", spy)
    try:
        for threads, c_stack in ((2, True), (1, False)):
            torch.set_num_threads(threads)
            got, cap = _run(quant, IDS, [60, 3], capture=(1,))
            want, cap_ref = _run(ref, IDS, [60, 3], capture=(1,))
            for g, w in zip(got + cap, want + cap_ref, strict=True):
                torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
            assert llama._stack_rows_ok(60) == c_stack
    finally:
        torch.set_num_threads(before)
    assert calls == [(2, 60, True), (2, 3, True), (1, 60, False), (1, 3, True)]


def test_threads_give_the_same_bits(models):
    quant, _ = models
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = _run(quant, IDS, [20, 4, 1])
        torch.set_num_threads(3)
        three, _ = _run(quant, IDS, [20, 4, 1])
    finally:
        torch.set_num_threads(before)
    for a, b in zip(one, three, strict=True):
        assert torch.equal(a, b)


def test_greedy_tokens_and_embedding(models):
    quant, ref = models
    h = torch.randn(3, 128)
    with torch.inference_mode():
        logits = quant.compute_logits(h)
        torch.testing.assert_close(logits, ref.compute_logits(h), rtol=2e-5, atol=2e-5)
        assert torch.equal(quant.greedy_tokens(h), logits.argmax(-1))
        ids = torch.tensor([0, 99, 5])
        assert torch.equal(quant.embed(ids), ref.embed(ids))
    assert quantized(quant.model.embed_tokens).fmt == "q8_0"


@pytest.mark.parametrize("variant", ["avx2", "portable"])
def test_narrower_code_paths(models, variant, monkeypatch):
    """The AVX2 and portable builds of the kernels (what CPUs without AVX-512 run) on the same model."""
    if native.isa() not in ("avx512", "avx2") or (variant == "avx2" and native.isa() != "avx512"):
        pytest.skip(f"this CPU cannot run the {variant} build next to its own")
    lib = native.lib(variant)
    if lib is None:
        pytest.skip(native.error(variant))
    quant, ref = models
    want, _ = _run(quant, IDS, [20, 5, 1])
    monkeypatch.setattr(native, "lib", lambda v="native": lib)
    got, _ = _run(quant, IDS, [20, 5, 1])
    ref_out, _ = _run(ref, IDS, [20, 5, 1])
    for g, w, r in zip(got, want, ref_out, strict=True):
        torch.testing.assert_close(g, w, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(g, r, rtol=2e-5, atol=2e-5)
