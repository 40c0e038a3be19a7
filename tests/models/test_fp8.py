"""fp8 experts end to end on CPU: quantise a bf16 checkpoint at load (--quantization fp8), dummy fp8 weights, fp8
checkpoints (weight + weight_scale_inv) written and read back bit-exact, fp8 dense tensors dequantised into bf16
layers, and the greedy speculative invariant with fp8 experts."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.config import ServerArgs, SpecConfig, load_model_config
from baton.engine.engine import Engine
from baton.models.build import build_model
from baton.models.checkpoint import CheckpointError, hf_layout, init_dummy_weights, load_safetensors, save_hf_checkpoint
from baton.ops.quant import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block
from tests.conftest import TINY_LING
from tests.helpers import full_logits
from tests.speculative.test_spec_core import PROMPT, run


def _engine(path: str, **kw) -> Engine:
    spec = kw.pop("spec", {})
    return Engine(ServerArgs(model_path=path, device="cpu", context_length=256,
                             spec=SpecConfig(**{"adaptive": False, **spec}), **kw))


def test_quantise_at_load_is_close_to_bf16(ling_path):
    ref = _engine(ling_path)
    fp8 = _engine(ling_path, quantization="fp8")
    experts = fp8.model.model.layers[1].mlp.experts
    assert experts.w13.dtype == FP8_DTYPE and experts.w13_scale.dtype == torch.float32
    x = torch.randn(7, TINY_LING["hidden_size"])
    with torch.inference_mode():  # one MoE layer on the same input: e4m3's ~3% per weight through two GEMMs
        a, b = ref.model.model.layers[1].mlp(x), fp8.model.model.layers[1].mlp(x)
    assert ((a - b).norm() / a.norm()).item() < 0.08
    assert torch.isfinite(full_logits(fp8.model, torch.tensor(PROMPT))).all()
    # the stored fp8 expert equals the block quantisation of the bf16 checkpoint's tensor
    want_q, want_s = quantize_fp8_block(ref.model.model.layers[1].mlp.experts.w2[3])
    assert torch.equal(experts.w2[3].view(torch.uint8), want_q.view(torch.uint8))
    torch.testing.assert_close(experts.w2_scale[3], want_s)


def test_fp8_checkpoint_round_trip(tmp_path):
    cfg = load_model_config_dict({**TINY_LING, "quantization_config": {"quant_method": "fp8"}}, tmp_path)
    model = build_model(cfg, "cpu", torch.float32)
    init_dummy_weights(model, 5)
    out = str(tmp_path / "fp8")
    save_hf_checkpoint(model, {**TINY_LING, "quantization_config": {"quant_method": "fp8"}}, out)
    tensors = load_file(os.path.join(out, "model.safetensors"))
    assert tensors["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == FP8_DTYPE
    assert "model.layers.1.mlp.experts.0.gate_proj.weight_scale_inv" in tensors
    again = build_model(load_model_config(out), "cpu", torch.float32)
    load_safetensors(again, out)
    params, params2 = dict(model.named_parameters()), dict(again.named_parameters())
    for name, slot in hf_layout(model).items():
        a, b = slot.view(params), slot.view(params2)
        assert torch.equal(a.view(torch.uint8) if a.dtype == FP8_DTYPE else a,
                           b.view(torch.uint8) if b.dtype == FP8_DTYPE else b), name


def load_model_config_dict(data: dict, tmp_path):
    d = tmp_path / "cfg"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(data))
    return load_model_config(str(d))


def test_fp8_dense_tensor_is_dequantised(ling_path, tmp_path):
    out = tmp_path / "dense_fp8"
    out.mkdir()
    tensors = load_file(os.path.join(ling_path, "model.safetensors"))
    name = "model.layers.0.attention.o_proj.weight"
    q, s = quantize_fp8_block(tensors[name])
    tensors[name], tensors[name + "_scale_inv"] = q, s
    save_file(tensors, str(out / "model.safetensors"))
    (out / "config.json").write_text(open(os.path.join(ling_path, "config.json")).read())
    model = build_model(load_model_config(str(out)), "cpu", torch.float32)
    load_safetensors(model, str(out))
    torch.testing.assert_close(model.model.layers[0].attention.o_proj.weight, dequantize_fp8_block(q, s, torch.float32))
    del tensors[name + "_scale_inv"]
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(CheckpointError, match="scale_inv"):
        load_safetensors(build_model(load_model_config(str(out)), "cpu", torch.float32), str(out))


@pytest.mark.parametrize("steps", [1, 3])
def test_fp8_spec_equals_plain(ling_path, steps):
    plain, _ = run(_engine(ling_path, quantization="fp8"))
    spec, verify = run(_engine(ling_path, quantization="fp8", spec={"algorithm": "NEXTN", "num_steps": steps}))
    assert spec == plain and verify > 0


def test_dummy_fp8_engine_runs(ling_path):
    engine = _engine(ling_path, quantization="fp8", load_format="dummy")
    tokens, _ = run(engine, max_new_tokens=8)
    assert len(tokens) == 8


def test_fake_quantize_mlp_fp8_rounds_every_mlp_matrix_once():
    """The dense stand-in for fp8 experts: every gate, up and down matrix of a Llama model goes through e4m3 with
    block scales (a small relative change, nothing else touched), and doing it twice changes nothing more."""
    from baton.layers.fake_quant import fake_quantize_mlp_fp8
    from tests.conftest import TINY_LLAMA
    from tests.helpers import tiny_model

    model = tiny_model(TINY_LLAMA)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert fake_quantize_mlp_fp8(model) == 3 * model.config.num_hidden_layers
    once = {n: p.detach().clone() for n, p in model.named_parameters()}
    for name, w in once.items():
        if "gate_up_proj" in name or "down_proj" in name:
            rel = float((w - before[name]).norm() / before[name].norm())
            assert 0 < rel < 0.08, name
        else:
            assert torch.equal(w, before[name]), name
    fake_quantize_mlp_fp8(model)
    for name, w in model.named_parameters():
        torch.testing.assert_close(w.detach(), once[name], rtol=0, atol=1e-6)
