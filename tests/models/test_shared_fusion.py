"""Shared experts fusion (``LingConfig.shared_experts_fused``, ``--disable-shared-experts-fusion``): the MoE's shared
expert stacked as expert E of the routed experts and routed by every row with weight 1. Where it applies; the fused
``SparseMoE`` against the unfused one holding the same weights (the model dtype and fp8, per-pair SwiGLU clamps,
active rows); the checkpoint names (the shared expert's own, loaded into the last expert; errors name the tensor);
dummy weights; the engine's greedy tokens with and without the flag; the census's bytes. fp32 on the CPU."""

from __future__ import annotations

import argparse
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.args import add_engine_args, server_args_from
from baton.config import ServerArgs, SpecConfig, config_to_dict, load_model_config, parse_model_config
from baton.engine.engine import Engine
from baton.models.build import apply_quantization, apply_shared_experts_fusion, build_model, set_fp8_activations
from baton.models.checkpoint import CheckpointError, hf_layout, init_dummy_weights, load_safetensors, save_hf_checkpoint
from baton.ops.quant import FP8_DTYPE
from tests.conftest import TINY_LING
from tests.dist.ranks import generate_all
from tests.helpers import checkpoint_tensors, full_logits

E = TINY_LING["num_experts"]
# per layer (routed, shared) SwiGLU clamps: (0, 0.8), (0.5, 0), (0, 0.7), (0.6, 1.0), (0.5, 0.5); small enough to
# bite on the tiny model's O(1) activations
CLAMPS = dict(expert_swiglu_limit_list=[0, 0, 0.5, 0, 0.6, 0.5],
              share_expert_swiglu_limit_list=[0, 0.8, 0, 0.7, 1.0, 0.5])
PROMPT = [3, 5, 7, 11, 13, 17, 19, 23]


def _cfg(fused: bool = True, quantization: str | None = None, activation: str | None = None, **overrides):
    cfg = parse_model_config({**TINY_LING, **CLAMPS, **overrides})
    apply_quantization(cfg, quantization, activation)
    apply_shared_experts_fusion(cfg, fused)
    return cfg


def _model(cfg, seed: int = 0):
    model = build_model(cfg, "cpu", torch.float32)
    init_dummy_weights(model, seed)
    if cfg.fp8_activations:
        set_fp8_activations(model)
    return model


# ---- where it applies, and the flag ----


def test_fusion_applies_where_the_shared_expert_is_a_routed_one():
    assert _cfg().shared_experts_fused
    assert not _cfg(fused=False).shared_experts_fused  # --disable-shared-experts-fusion
    assert not _cfg(moe_shared_expert_intermediate_size=48).shared_experts_fused  # wider than a routed expert
    assert _cfg(num_shared_experts=2, moe_shared_expert_intermediate_size=12).shared_experts_fused  # 2 x 12 = 24
    assert not _cfg(num_shared_experts=0).shared_experts_fused
    assert _cfg(quantization="fp8").shared_experts_fused  # both fp8
    assert not _cfg(quantization="fp8-experts").shared_experts_fused  # fp8 experts, shared expert in the model dtype
    moe = build_model(_cfg(quantization="fp8-experts"), "meta", torch.float32).model.layers[1].mlp
    assert moe.shared_id is None and moe.shared_experts is not None and moe.experts.w13.shape[0] == E
    fused = build_model(_cfg(), "meta", torch.float32)
    for moe in (fused.model.layers[1].mlp, fused.mtp.body.mlp):  # the MTP layer's MoE too
        assert moe.shared_id == E and moe.shared_experts is None and moe.experts.w13.shape[0] == E + 1
    assert "fuse_shared_experts" not in config_to_dict(_cfg(fused=False))  # a run-time choice, not a config.json key


def test_the_flag_reaches_server_args_and_its_help_says_what_it_does():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    help_text = " ".join(p.format_help().split())
    assert "--disable-shared-experts-fusion" in help_text and "one more expert" in help_text
    ns = p.parse_args(["--model-path", "x", "--disable-shared-experts-fusion", "--speculative-algorithm", "none"])
    assert server_args_from(ns).disable_shared_experts_fusion
    assert not server_args_from(p.parse_args(["--model-path", "x", "--speculative-algorithm", "none"])
                                ).disable_shared_experts_fusion


# ---- the fused SparseMoE against the unfused one, the same weights ----


def _stack(unfused, fused) -> None:
    """Copy an unfused model's weights into a fused one: the routed experts into the first E of every expert stack,
    the shared MLP (and its fp8 scales) into expert E."""
    fp = dict(fused.named_parameters())
    with torch.no_grad():
        for name, p in unfused.named_parameters():
            if ".shared_experts." not in name:
                dst = fp[name]
                (dst if dst.shape == p.shape else dst[:E]).copy_(p)  # an expert stack: its routed experts
        for prefix, m in unfused.named_modules():
            shared = getattr(m, "shared_experts", None)
            if shared is None:
                continue
            base = prefix + ".experts."
            fp[base + "w13"][E].copy_(shared.gate_up_proj.weight)
            fp[base + "w2"][E].copy_(shared.down_proj.weight)
            if shared.gate_up_proj.fp8:
                fp[base + "w13_scale"][E].copy_(shared.gate_up_proj.weight_scale_inv)
                fp[base + "w2_scale"][E].copy_(shared.down_proj.weight_scale_inv)


@pytest.mark.parametrize("quantization,activation", [(None, None), ("fp8", "none"), ("fp8", "dynamic")],
                         ids=["model-dtype", "fp8", "fp8-w8a8"])
def test_fused_sparse_moe_equals_unfused(quantization, activation):
    unfused = _model(_cfg(False, quantization, activation), seed=1)
    fused = build_model(_cfg(True, quantization, activation), "cpu", torch.float32)
    if activation == "dynamic":
        set_fp8_activations(fused)
    _stack(unfused, fused)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, TINY_LING["hidden_size"], generator=gen) * 2.0
    for layer in (1, 2, 3, 4, 5):  # clamps (0, 0.8), (0.5, 0), (0, 0.7), (0.6, 1.0), (0.5, 0.5)
        a, b = unfused.model.layers[layer], fused.model.layers[layer]
        assert b.mlp.shared_experts is None and b.mlp.shared_limit == CLAMPS["share_expert_swiglu_limit_list"][layer]
        for active in (None, torch.tensor([3])):
            kw = dict(norm=a.post_attention_layernorm, residual=x, active_rows=active)
            want = a.mlp(x, **kw)
            got = b.mlp(x, **kw)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            if active is not None:  # rows past the active prefix: residual + shared, as unfused
                shared = a.mlp.shared_experts(a.post_attention_layernorm(x))
                torch.testing.assert_close(got[3:], x[3:] + shared[3:], atol=1e-5, rtol=1e-5)
        if layer == 4:  # the per-pair clamp matters here: the shared expert at the routed clamp differs
            b.mlp.shared_limit = b.mlp.expert_limit
            norm = a.post_attention_layernorm
            assert not torch.allclose(b.mlp(x, norm=norm), a.mlp(x, norm=norm), atol=1e-4, rtol=1e-4)


def test_fused_route_appends_the_shared_column():
    moe = _model(_cfg()).model.layers[1].mlp
    x = torch.randn(4, TINY_LING["hidden_size"])
    ids, w = moe.route(x, torch.tensor([2]))
    k = moe.top_k
    assert ids.shape == (4, k + 1) and (ids[:, k] == E).all() and (w[:, k] == 1.0).all()
    assert (ids[2:, :k] == -1).all() and (w[2:, :k] == 0).all() and (ids[:2, :k] < E).all()


# ---- checkpoints ----



def test_checkpoint_round_trip_keeps_the_shared_expert_names(tmp_path):
    """An unfused model's checkpoint (the HF names: ``mlp.shared_experts.{gate,up,down}_proj``) loads into the
    fused layout, gives the unfused logits, and writes back the same tensors bit for bit; an fp8 checkpoint too."""
    cfg = _cfg(fused=False)
    unfused = _model(cfg, seed=2)
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(unfused, cfg, path)
    tensors = checkpoint_tensors(path)
    n = TINY_LING["num_hidden_layers"]
    for layer in (1, n):  # a MoE layer and the MTP layer
        assert f"model.layers.{layer}.mlp.shared_experts.gate_proj.weight" in tensors
        assert f"model.layers.{layer}.mlp.experts.{E}.gate_proj.weight" not in tensors
    fused_cfg = load_model_config(path)
    assert fused_cfg.shared_experts_fused
    fused = build_model(fused_cfg, "cpu", torch.float32)
    load_safetensors(fused, path)
    shared = unfused.model.layers[1].mlp.shared_experts
    assert torch.equal(fused.model.layers[1].mlp.experts.w2[E], shared.down_proj.weight)
    ids = torch.tensor(PROMPT)
    torch.testing.assert_close(full_logits(fused, ids), full_logits(unfused, ids), atol=1e-5, rtol=1e-5)
    again = str(tmp_path / "again")
    save_hf_checkpoint(fused, fused_cfg, again)
    back = checkpoint_tensors(again)
    assert back.keys() == tensors.keys() and all(torch.equal(back[k], tensors[k]) for k in tensors)
    # --quantization fp8 of the bf16 checkpoint: the shared expert quantised at load exactly as the dense MLP's parts
    q_cfg, uq_cfg = _cfg(True, "fp8"), _cfg(False, "fp8")
    q, uq = build_model(q_cfg, "cpu", torch.float32), build_model(uq_cfg, "cpu", torch.float32)
    load_safetensors(q, path)
    load_safetensors(uq, path)
    experts, shared = q.model.layers[4].mlp.experts, uq.model.layers[4].mlp.shared_experts
    assert experts.w13.dtype == FP8_DTYPE
    assert torch.equal(experts.w13[E].view(torch.uint8), shared.gate_up_proj.weight.view(torch.uint8))
    assert torch.equal(experts.w13_scale[E], shared.gate_up_proj.weight_scale_inv)
    assert torch.equal(experts.w2_scale[E], shared.down_proj.weight_scale_inv)
    torch.testing.assert_close(full_logits(q, ids), full_logits(uq, ids), atol=1e-5, rtol=1e-5)
    fp8_path = str(tmp_path / "fp8")  # an fp8 checkpoint (weights and weight_scale_inv) written from the fused model
    save_hf_checkpoint(q, q_cfg, fp8_path)
    fp8 = checkpoint_tensors(fp8_path)
    assert fp8["model.layers.4.mlp.shared_experts.up_proj.weight"].dtype == FP8_DTYPE
    assert "model.layers.4.mlp.shared_experts.up_proj.weight_scale_inv" in fp8
    q2 = build_model(load_model_config(fp8_path), "cpu", torch.float32)
    assert q2.config.shared_experts_fused and q2.model.layers[4].mlp.experts.w13.dtype == FP8_DTYPE
    load_safetensors(q2, fp8_path)
    torch.testing.assert_close(full_logits(q2, ids), full_logits(q, ids), atol=0, rtol=0)


@pytest.mark.parametrize("edit,match", [
    ("drop", r"missing tensor model\.layers\.1\.mlp\.shared_experts\.up_proj\.weight"),
    ("shape", r"model\.layers\.3\.mlp\.shared_experts\.down_proj\.weight: expected shape"),
])
def test_a_bad_shared_expert_tensor_is_named(tmp_path, edit, match):
    cfg = _cfg(fused=False)
    path = str(tmp_path / "ckpt")
    save_hf_checkpoint(_model(cfg), cfg, path)
    fn = os.path.join(path, "model.safetensors")
    tensors = load_file(fn)
    if edit == "drop":
        del tensors["model.layers.1.mlp.shared_experts.up_proj.weight"]
    else:
        tensors["model.layers.3.mlp.shared_experts.down_proj.weight"] = torch.zeros(3, 5)
    save_file(tensors, fn)
    model = build_model(load_model_config(path), "cpu", torch.float32)
    assert model.model.layers[1].mlp.shared_id == E
    with pytest.raises(CheckpointError, match=match):
        load_safetensors(model, path)


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_dummy_weights_are_the_unfused_dummy_weights(quantization):
    """Fused and unfused dummy models hold the same checkpoint tensors (the shared expert drawn as the unfused MLP),
    so ``--load-format dummy`` gives the same model either way."""
    a, b = _model(_cfg(True, quantization)), _model(_cfg(False, quantization))
    la, lb = hf_layout(a), hf_layout(b)
    assert la.keys() == lb.keys()
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    for name in la:
        ta, tb = la[name].view(pa), lb[name].view(pb)
        if ta.dtype == FP8_DTYPE:
            ta, tb = ta.view(torch.uint8), tb.view(torch.uint8)
        assert torch.equal(ta, tb), name


# ---- the engine, and the census's bytes ----


def _engine(path: str, fused: bool, **spec) -> Engine:
    return Engine(ServerArgs(model_path=path, device="cpu", context_length=256, disable_shared_experts_fusion=not fused,
                             spec=SpecConfig(**{"adaptive": False, **spec})))


@pytest.mark.parametrize("spec", [{}, {"algorithm": "NEXTN", "num_steps": 3}], ids=["plain", "nextn"])
def test_engine_greedy_tokens_fused_equal_disabled(ling_path, spec):
    """The tiny Ling (its MTP layer a MoE too) greedy, token for token, with and without the fusion."""
    fused, unfused = _engine(ling_path, True, **spec), _engine(ling_path, False, **spec)
    assert fused.model.model.layers[1].mlp.shared_id == E and unfused.model.model.layers[1].mlp.shared_id is None
    if spec:
        assert fused.drafter.head.body.mlp.shared_id == E and unfused.drafter.head.body.mlp.shared_id is None
    requests = [(PROMPT, dict(temperature=0.0, max_new_tokens=24, ignore_eos=True))]
    want = generate_all(unfused, [(list(i), dict(k)) for i, k in requests])
    got = generate_all(fused, [(list(i), dict(k)) for i, k in requests])
    assert got == want and len(got[0][0]) == 24


def test_census_counts_the_fused_shared_expert_once_per_layer(ling_path):
    from baton.bench.census import distinct_experts, draft_head_bytes, step_bytes

    spec = {"algorithm": "NEXTN", "num_steps": 3}
    fused, unfused = _engine(ling_path, True, **spec), _engine(ling_path, False, **spec)
    a, b = step_bytes(fused, 100, 4, 2.0), step_bytes(unfused, 100, 4, 2.0)
    experts = fused.model.model.layers[1].mlp.experts
    one = (experts.w13.nbytes + experts.w2.nbytes) / (E + 1)
    moe_layers = TINY_LING["num_hidden_layers"] - TINY_LING["first_k_dense_replace"]
    assert a["experts"] - b["experts"] == pytest.approx(moe_layers * one)  # the shared expert, once per layer
    assert b["dense_weights"] - a["dense_weights"] == pytest.approx(moe_layers * one)
    assert a["total"] == pytest.approx(b["total"])
    assert draft_head_bytes(fused.drafter.head) == pytest.approx(draft_head_bytes(unfused.drafter.head))
    torch.manual_seed(5)
    n_fused = distinct_experts(fused, 4)
    torch.manual_seed(5)
    assert n_fused == distinct_experts(unfused, 4) <= 4 * TINY_LING["num_experts_per_tok"]  # routed experts only
