"""Tiny Ling and Llama models in fp32: prefill + decode equals one forward, MLA absorbed equals naive,
group-limited routing, the full Ling-3.0-flash shape on the meta device."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

from baton.cache.kv import MLACache
from baton.cache.model_cache import ModelCache
from baton.config import ConfigError, LingConfig, parse_model_config
from baton.layers.context import ForwardContext
from baton.layers.mla import MLAttention
from baton.layers.rope import RotaryEmbedding
from baton.models.build import build_model
from baton.ops.moe import grouped_topk
from baton.types import ForwardMode
from tests.conftest import TINY_LING, TINY_LLAMA
from tests.helpers import full_logits, incremental_logits, tiny_model

LING_VARIANTS = {
    "flash-like": {},
    "q-lora+kda-lora": {"q_lora_rank": 24, "no_kda_lora": False},
    "group-4-partial": {"layer_group_size": 4, "num_hidden_layers": 6},
    "unsafe-gate": {"kda_safe_gate": False},
}


@pytest.mark.parametrize("variant", list(LING_VARIANTS))
@pytest.mark.parametrize("prefill_len", [1, 9, 70])
def test_ling_prefill_then_decode_equals_full(variant, prefill_len):
    model = tiny_model(TINY_LING, **LING_VARIANTS[variant])
    ids = torch.randint(0, model.config.vocab_size, (prefill_len + 6,))
    full = full_logits(model, ids)
    inc = incremental_logits(model, ids, prefill_len)
    assert torch.isfinite(full).all()
    torch.testing.assert_close(inc, full, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("prefill_len", [1, 13])
def test_llama_prefill_then_decode_equals_full(prefill_len):
    model = tiny_model(TINY_LLAMA)
    ids = torch.randint(0, model.config.vocab_size, (prefill_len + 7,))
    torch.testing.assert_close(incremental_logits(model, ids, prefill_len), full_logits(model, ids),
                               rtol=1e-4, atol=1e-4)


def test_ling_layer_layout():
    cfg = parse_model_config(TINY_LING)
    assert cfg.mla_layer_ids == [2, 5]
    partial = parse_model_config({**TINY_LING, "num_hidden_layers": 8})
    assert partial.mla_layer_ids == [2, 5, 6, 7]  # trailing partial group is all MLA
    model = build_model(cfg, "meta", torch.float32)
    kinds = [type(layer.attention).__name__ for layer in model.model.layers]
    assert kinds == ["KimiDeltaAttention", "KimiDeltaAttention", "MLAttention"] * 2
    assert type(model.model.layers[0].mlp).__name__ == "MLP"
    assert type(model.model.layers[1].mlp).__name__ == "SparseMoE"
    assert model.model.layers[4].mlp.expert_limit == 4.0
    assert model.model.layers[3].mlp.shared_limit == 5.0
    assert model.model.layers[3].mlp.shared_experts is None and model.model.layers[3].mlp.shared_id == 16  # fused
    cfg.fuse_shared_experts = False  # --disable-shared-experts-fusion: the separate MLP
    unfused = build_model(cfg, "meta", torch.float32)
    assert unfused.model.layers[3].mlp.shared_experts.swiglu_limit == 5.0
    assert unfused.model.layers[3].mlp.shared_id is None and unfused.model.layers[3].mlp.experts.w13.shape[0] == 16
    assert model.mtp.body.mlp.expert_limit == 0.0 and model.mtp.body.is_mla


@pytest.mark.parametrize("q_lora_rank", [None, 24])
def test_mla_absorbed_equals_expanded(q_lora_rank):
    cfg = parse_model_config({**TINY_LING, "q_lora_rank": q_lora_rank})
    rope = RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, True)
    mla = MLAttention(0, cfg, rope)
    for p in mla.parameters():
        torch.nn.init.normal_(p, 0, p.shape[-1] ** -0.5 if p.dim() > 1 else 1.0)
    x = torch.randn(11, cfg.hidden_size)
    positions = torch.arange(5, 16)  # a context of 5 earlier tokens
    prior = torch.randn(5, cfg.kv_lora_rank + cfg.qk_rope_head_dim)
    outs = {}
    for mode in (ForwardMode.PREFILL, ForwardMode.VERIFY):
        cache = MLACache(32, cfg.kv_lora_rank, cfg.qk_rope_head_dim, torch.float32, "cpu")
        cache.latent[:5] = prior
        ctx = ForwardContext(mode, positions, ModelCache({0: cache}, 32), kv_len=16)
        outs[mode] = mla(x, ctx)
    torch.testing.assert_close(outs[ForwardMode.VERIFY], outs[ForwardMode.PREFILL], rtol=1e-5, atol=1e-5)


def test_grouped_topk_crafted():
    # 8 experts, 4 groups of 2; keep 2 groups; top-3.
    scores = torch.tensor([[0.9, 0.1, 0.5, 0.5, 0.2, 0.2, 0.8, 0.7]])
    ids, w = grouped_topk(scores, None, top_k=3, n_group=4, topk_group=2, renormalize=True, scaling_factor=2.0)
    # group sums (top-2 of 2): g0 1.0, g1 1.0, g2 0.4, g3 1.5 -> keep g3 and one of g0/g1 (tie)
    assert set(ids[0].tolist()) in ({6, 7, 0}, {6, 7, 2}, {6, 7, 3})
    sel = scores[0, ids[0]]
    torch.testing.assert_close(w[0], sel / sel.sum() * 2.0)
    # expert_bias changes the choice but not the weights: boosting expert 4 (group 2) brings it in
    bias = torch.tensor([0, 0, 0, 0, 1.0, 0, 0, 0])
    ids_b, w_b = grouped_topk(scores, bias, top_k=3, n_group=4, topk_group=2, renormalize=True, scaling_factor=2.0)
    assert 4 in ids_b[0].tolist()
    sel_b = scores[0, ids_b[0]]  # weights from the unbiased scores
    torch.testing.assert_close(w_b[0], sel_b / sel_b.sum() * 2.0)


def test_grouped_topk_masks_groups():
    scores = torch.tensor([[0.95, 0.0, 0.0, 0.0, 0.6, 0.6, 0.6, 0.6]])
    ids, _ = grouped_topk(scores, None, top_k=2, n_group=2, topk_group=1, renormalize=False, scaling_factor=1.0)
    # group 0 sum of top-2 = 0.95 < group 1's 1.2: the best single expert (0) is excluded
    assert 0 not in ids[0].tolist()
    ids_flat, _ = grouped_topk(scores, None, top_k=2, n_group=1, topk_group=1, renormalize=False,
                               scaling_factor=1.0)
    assert 0 in ids_flat[0].tolist()


def _flash_config() -> LingConfig:
    text = resources.files("baton.data").joinpath("ling-3.0-flash.config.json").read_text()
    return parse_model_config(json.loads(text))


def test_flash_shape_on_meta():
    cfg = _flash_config()
    assert cfg.mla_layer_ids == [5, 11, 17, 23, 29, 35, 41]
    model = build_model(cfg, "meta", torch.bfloat16)
    total = sum(p.numel() for p in model.parameters())
    mtp = sum(p.numel() for p in model.mtp.parameters())
    assert total - mtp == 124_414_211_552  # ling3-architecture.md §8: 124.414 B main
    assert mtp == 3_072_194_048  # 3.07 B MTP
    layer = model.model.layers[2]
    assert tuple(layer.mlp.experts.w13.shape) == (513, 1536, 2560)  # 512 routed + the fused shared expert
    assert layer.mlp.shared_id == 512 and model.mtp.body.mlp.shared_id == 512
    assert tuple(layer.attention.in_proj.weight.shape) == (5 * 4096 + 32, 2560)  # q|k|v|f|g|b fused
    assert tuple(model.model.layers[5].attention.kv_b_proj.weight.shape) == (8192, 512)


def test_config_errors_and_overrides():
    bad = dict(TINY_LING)
    del bad["num_experts"]
    with pytest.raises(ConfigError, match="num_experts"):
        parse_model_config(bad)
    cfg = parse_model_config({**TINY_LING, "some_unknown_field": 3}, '{"num_hidden_layers": 3}')
    assert cfg.num_hidden_layers == 3
    with pytest.raises(ConfigError, match="not supported"):
        parse_model_config({"model_type": "gpt2"})
    with pytest.raises(ConfigError, match="JSON"):
        parse_model_config(TINY_LING, "{oops")
