"""Fixtures for the draft-training tests: a tiny untied Llama target (its greedy continuations are not trivial
repeats, unlike the tied one), a small dataset generated greedily by it, and single-threaded torch (on small
CPU machines the intra-op pool costs far more than these tiny ops)."""

from __future__ import annotations

import json

import pytest
import torch

from baton.cli import main as baton_main
from tests.conftest import TINY_LLAMA
from tests.speculative.conftest import write_checkpoint

TINY_UNTIED = {**TINY_LLAMA, "tie_word_embeddings": False}
PROMPTS = [[5, 17, 42, 8, 3], [60, 11, 29, 33], [7, 7, 9], [23, 54, 2, 90, 71, 12], [44, 18, 66], [81, 3, 3, 40, 9],
           [12, 99, 31], [57, 24, 70, 16]]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def target_path(ckpt_root) -> str:
    return write_checkpoint(ckpt_root, "llama_untied", TINY_UNTIED)


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("train_prompts") / "prompts.jsonl"
    path.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in PROMPTS))
    return str(path)


@pytest.fixture(scope="session")
def greedy_data(tmp_path_factory, target_path, prompts_file) -> tuple[str, str]:
    """(train.jsonl, holdout.jsonl): 40 greedy tokens per prompt, 2 of the 8 prompts held out."""
    out = tmp_path_factory.mktemp("train_data") / "greedy.jsonl"
    assert baton_main(["train", "data", "--model-path", target_path, "--device", "cpu", "--extra-prompts",
                       prompts_file, "--temperatures", "0", "--max-new-tokens", "40", "--holdout-frac", "0.25",
                       "--output", str(out)]) == 0
    return str(out), str(out).replace(".jsonl", ".holdout.jsonl")


def train_cli(kind: str, target_path: str, train: str, out: str, *args: str) -> int:
    """``baton train KIND`` with the target and the trainer on the CPU and no accept-length evaluation (a later
    ``--eval-prompts`` in ``args`` wins); returns the exit code."""
    return baton_main(["train", kind, "--model-path", target_path, "--target-device", "cpu", "--device", "cpu",
                       "--train-data", train, "--output", out, "--eval-prompts", "0", *args])
