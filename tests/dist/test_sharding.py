"""Sharding by construction, checked in one process: the models of ranks 0 and 1 of 2 (built in
``dist.layout_context``) load their slices of the same checkpoint, and together they hold exactly the
single-rank model's weights (column blocks, row blocks, expert intermediate blocks, padded vocabulary blocks,
replicated tensors); tensor-parallel dummy weights are the single-rank dummy weights split; shapes that do not
divide are a ConfigError naming the field."""

from __future__ import annotations

import pytest
import torch

from baton import dist
from baton.config import ConfigError, load_model_config, parse_model_config
from baton.models.build import build_model, init_dummy
from baton.models.checkpoint import CheckpointError, Slot, hf_layout, load_safetensors, save_hf_checkpoint
from tests.conftest import TINY_LING, TINY_LLAMA

TP = 2


def _load(path: str, rank: int, size: int):
    cfg = load_model_config(path)
    with dist.layout_context(rank, size):
        model = build_model(cfg, "cpu", torch.float32)
        load_safetensors(model, path)
        layout = hf_layout(model)
    return model, layout


def _tensor(model, slot: Slot) -> torch.Tensor:
    t = slot.view(dict(model.named_parameters()))
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t  # compare fp8 bit patterns


def _check_split(full_model, full_layout, ranks) -> set[int]:
    """Every checkpoint tensor: each rank's slot holds its block of the single-rank tensor, and the blocks
    cover the tensor exactly once (or every rank holds it whole). Returns the sharded dims seen."""
    dims = set()
    for name, slot in full_layout.items():
        full = _tensor(full_model, slot)
        blocks = []
        for model, layout in ranks:
            mine = layout[name]
            local = _tensor(model, mine)
            if mine.src is None:
                assert torch.equal(local, full), name
                continue
            dim, start, stop, extent = mine.src
            assert extent == full.shape[dim], name
            assert torch.equal(local, full.narrow(dim, start, stop - start)), name
            blocks.append((start, stop))
            dims.add(dim)
        if blocks:  # consecutive blocks from 0 to the end
            ends = [0] + [stop for _, stop in sorted(blocks)]
            assert [start for start, _ in sorted(blocks)] == ends[:-1] and ends[-1] == full.shape[dim], name
    return dims


@pytest.mark.parametrize("which", ["ling", "llama"])
def test_rank_slices_of_one_checkpoint_make_the_full_model(which, ling_path, llama_path):
    path = ling_path if which == "ling" else llama_path
    full_model, full_layout = _load(path, 0, 1)
    ranks = [_load(path, r, TP) for r in range(TP)]
    assert set(ranks[0][1]) == set(full_layout)  # the same checkpoint names on every rank
    assert _check_split(full_model, full_layout, ranks) == {0, 1}  # column and row blocks both occur


def test_which_tensors_are_split_how(ling_path):
    _, layout = _load(ling_path, 1, TP)
    cfg = load_model_config(ling_path)
    kda, mla, moe = "model.layers.0.attention.", "model.layers.2.attention.", "model.layers.1.mlp."
    rows = cfg.num_attention_heads * cfg.head_dim
    assert layout[kda + "q_proj.weight"].src == (0, rows // 2, rows, rows)
    assert layout[kda + "A_log"].src == (0, 2, 4, 4)
    assert layout[kda + "o_proj.weight"].src == (1, rows // 2, rows, rows)
    assert layout[mla + "kv_a_proj_with_mqa.weight"].src is None  # replicated latent path
    assert layout[mla + "kv_a_layernorm.weight"].src is None
    assert layout[mla + "g_proj.weight"].src == (0, 2, 4, 4)
    assert layout[moe + "gate.weight"].src is None  # the router is replicated
    inter = cfg.moe_intermediate_size
    assert layout[moe + "experts.3.up_proj.weight"].src == (0, inter // 2, inter, inter)
    assert layout[moe + "experts.3.down_proj.weight"].src == (1, inter // 2, inter, inter)
    # the fused shared expert (the stack's last expert) is split as the routed ones, under its own names
    e = cfg.num_experts
    assert layout[moe + "shared_experts.up_proj.weight"].src == (0, inter // 2, inter, inter)
    assert layout[moe + "shared_experts.up_proj.weight"].expert == e
    assert layout[moe + "shared_experts.down_proj.weight"].src == (1, inter // 2, inter, inter)
    assert f"{moe}experts.{e}.up_proj.weight" not in layout
    vocab = cfg.vocab_size  # 97: blocks of 49, the last one 48 rows plus a zero padding row
    assert layout["model.word_embeddings.weight"].src == (0, 49, vocab, vocab)
    assert layout["lm_head.weight"].rows == (0, 48)


@pytest.mark.parametrize("fp8", [False, True])
def test_tp_dummy_weights_are_the_single_rank_dummy_weights_split(fp8):
    # fp8 experts need each rank's intermediate width to be whole 128-wide scale blocks; the dense projections stay
    # unquantised here (fp8 dense shards of these narrow layers are quantised per rank: tests/models/test_fp8_dense.py)
    extra = {"moe_intermediate_size": 256, "quantization_config": {"quant_method": "fp8", "baton_fp8_dense": False}
             } if fp8 else {}
    cfg = parse_model_config({**TINY_LING, **extra})
    full = build_model(cfg, "cpu", torch.float32)
    init_dummy(full, cfg, 3, torch.float32)
    ranks = []
    for r in range(TP):
        with dist.layout_context(r, TP):
            model = build_model(cfg, "cpu", torch.float32)
            init_dummy(model, cfg, 3, torch.float32)
            ranks.append((model, hf_layout(model)))
    _check_split(full, hf_layout(full), ranks)
    pad = ranks[-1][0].model.word_embeddings.weight[-1]
    assert torch.equal(pad, torch.zeros_like(pad))


def test_a_sharded_model_refuses_to_write_a_checkpoint(tmp_path):
    cfg = parse_model_config(dict(TINY_LLAMA))
    with dist.layout_context(0, TP):
        model = build_model(cfg, "cpu", torch.float32)
    with pytest.raises(CheckpointError, match="tensor-parallel"):
        save_hf_checkpoint(model, cfg, str(tmp_path / "out"))


def test_a_checkpoint_of_another_size_names_the_tensor(tmp_path, llama_path):
    cfg = parse_model_config({**TINY_LLAMA, "vocab_size": 103})
    with dist.layout_context(1, TP):
        model = build_model(cfg, "cpu", torch.float32)
        with pytest.raises(CheckpointError, match="embed_tokens.weight: expected 103 along dim 0"):
            load_safetensors(model, llama_path)


@pytest.mark.parametrize(("overrides", "field"), [({}, "num_attention_heads"),
                                                  ({"num_attention_heads": 8}, "num_key_value_heads"),
                                                  ({"num_key_value_heads": 4, "num_attention_heads": 4,
                                                    "intermediate_size": 90}, "gate_proj")])
def test_shapes_that_do_not_divide_are_a_config_error(overrides, field):
    cfg = parse_model_config({**TINY_LLAMA, **overrides})
    with dist.layout_context(0, 4), pytest.raises(ConfigError, match=f"{field}.*not divisible by --tp-size 4"):
        build_model(cfg, "meta", torch.float32)
