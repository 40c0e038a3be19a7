"""Random checkpoints written in the Hugging Face layout load back bit-exact; broken ones fail by name."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from baton.cli import main as baton_main
from baton.config import load_model_config
from baton.models.build import build_model
from baton.models.checkpoint import CheckpointError, load_safetensors
from tests.conftest import TINY_LING, TINY_LLAMA
from tests.helpers import checkpoint_tensors


def _write(tmp_path, cfg_dict, max_shard_mb=2048.0) -> str:
    cfg_path = tmp_path / "config.json"
    cfg_path.write_text(json.dumps(cfg_dict))
    out = str(tmp_path / "ckpt")
    assert baton_main(["convert", "random-checkpoint", "--config", str(cfg_path), "--output", out,
                       "--max-shard-mb", str(max_shard_mb)]) == 0
    return out



@pytest.mark.parametrize("cfg_dict", [TINY_LING, TINY_LLAMA], ids=["ling", "llama"])
def test_round_trip_bit_exact(tmp_path, cfg_dict):
    path = _write(tmp_path, cfg_dict, max_shard_mb=0.05)  # forces several shards + an index
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    tensors = checkpoint_tensors(path)
    if cfg_dict["model_type"] == "bailing_hybrid":
        n = cfg_dict["num_hidden_layers"]
        assert "model.layers.1.mlp.experts.15.down_proj.weight" in tensors
        assert f"model.layers.{n}.eh_proj.weight" in tensors  # MTP layer at index num_hidden_layers
        assert f"model.layers.{n}.attention.kv_b_proj.weight" in tensors
        assert "model.layers.0.attention.A_log" in tensors and "model.word_embeddings.weight" in tensors
    else:
        assert "model.layers.0.self_attn.q_proj.weight" in tensors and "lm_head.weight" not in tensors
    cfg = load_model_config(path)
    model = build_model(cfg, "cpu", torch.float32)
    load_safetensors(model, path)
    from baton.models.checkpoint import hf_layout

    params = dict(model.named_parameters())
    layout = hf_layout(model)
    assert set(layout) == set(tensors)
    for name, slot in layout.items():
        assert torch.equal(slot.view(params), tensors[name]), name


def test_wrong_shape_names_tensor(tmp_path):
    path = _write(tmp_path, TINY_LING)
    fn = os.path.join(path, "model.safetensors")
    tensors = load_file(fn)
    tensors["model.layers.2.attention.kv_b_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, fn)
    model = build_model(load_model_config(path), "cpu", torch.float32)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.attention\.kv_b_proj\.weight.*expected shape"):
        load_safetensors(model, path)


def test_missing_tensor_names_it(tmp_path):
    path = _write(tmp_path, TINY_LING)
    fn = os.path.join(path, "model.safetensors")
    tensors = load_file(fn)
    del tensors["model.layers.1.mlp.experts.3.up_proj.weight"]
    save_file(tensors, fn)
    model = build_model(load_model_config(path), "cpu", torch.float32)
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.experts\.3\.up_proj\.weight"):
        load_safetensors(model, path)


def test_truncated_file_is_a_clear_error(tmp_path):
    path = _write(tmp_path, TINY_LLAMA)
    fn = os.path.join(path, "model.safetensors")
    with open(fn, "r+b") as f:
        f.truncate(os.path.getsize(fn) // 2)
    model = build_model(load_model_config(path), "cpu", torch.float32)
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_safetensors(model, path)


def test_index_naming_absent_shard(tmp_path):
    path = _write(tmp_path, TINY_LLAMA, max_shard_mb=0.05)
    os.remove(os.path.join(path, sorted(f for f in os.listdir(path) if f.startswith("model-"))[0]))
    model = build_model(load_model_config(path), "cpu", torch.float32)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_safetensors(model, path)


def test_dtypes_kept_for_aux_tensors(tmp_path):
    path = _write(tmp_path, TINY_LING)
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        assert f.get_tensor("model.layers.0.attention.A_log").dtype == torch.float32
