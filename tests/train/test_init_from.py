"""``baton train nextn|dspark --init-from DIR``: training continues from a draft checkpoint (the shipped drafts
can be trained further across sessions). With a zero learning rate the written draft is the one read, and for
DSpark the checkpoint's architecture replaces the command line's."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from baton.config import load_model_config
from baton.models.dspark_checkpoint import write_random_dspark_draft
from baton.models.nextn_checkpoint import write_random_nextn_head
from tests.train.conftest import train_cli


def _tensors(path: str) -> dict[str, torch.Tensor]:
    return load_file(os.path.join(path, "model.safetensors"))


def _train(kind: str, target_path: str, train: str, out: str, *extra: str) -> int:
    return train_cli(kind, target_path, train, out, "--steps", "1", "--batch-size", "2", "--lr", "0",
                     "--save-dtype", "float32", *extra)


@pytest.mark.timeout(120)
def test_dspark_init_from_keeps_the_checkpoint_and_its_architecture(tmp_path, target_path, greedy_data):
    train, _ = greedy_data
    start = str(tmp_path / "start")
    write_random_dspark_draft(load_model_config(target_path), start, seed=3, block_size=6, markov_rank=8)
    out = str(tmp_path / "out")
    # the command line asks for another block size and rank: the checkpoint's win
    assert _train("dspark", target_path, train, out, "--init-from", start, "--block-size", "4", "--markov-rank",
                  "16", "--num-layers", "1") == 0
    cfg = json.load(open(os.path.join(out, "config.json")))
    assert cfg["dspark_block_size"] == 6 and cfg["dspark_markov_rank"] == 8
    want, got = _tensors(start), _tensors(out)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


@pytest.mark.timeout(120)
def test_dspark_init_from_a_dflash_checkpoint_is_refused_for_dspark(tmp_path, target_path, greedy_data, capsys):
    train, _ = greedy_data
    start = str(tmp_path / "dflash")
    write_random_dspark_draft(load_model_config(target_path), start, with_heads=False)
    assert _train("dspark", target_path, train, str(tmp_path / "out"), "--init-from", start) != 0
    assert "a DFlash checkpoint, but the run trains DSpark" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_nextn_init_from_keeps_the_checkpoint(tmp_path, target_path, greedy_data):
    train, _ = greedy_data
    start = str(tmp_path / "start")
    write_random_nextn_head(load_model_config(target_path), start, seed=5)
    out = str(tmp_path / "out")
    assert _train("nextn", target_path, train, out, "--init-from", start, "--unroll-steps", "1") == 0
    want, got = _tensors(start), _tensors(out)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)
