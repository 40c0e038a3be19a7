"""``baton train nextn|dspark --dp-size N``: N processes split every batch and sum their gradients. On the CPU
(gloo) a two-rank run must follow the one-process run step for step, up to summation order. Both runs get the
same global batches, the same anchors (drawn per sequence from seed, step and global index) and the same
normaliser, and end with the same weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from baton.cli import main as baton_main
from baton.train.dp import DataParallel, plan_generator, resolve_dp_devices
from tests.train.conftest import train_cli


def _train(kind: str, target_path: str, train: str, out: str, dp: int, *extra: str) -> int:
    return train_cli(kind, target_path, train, out, "--steps", "3", "--batch-size", "5", "--lr", "3e-3",
                     "--save-dtype", "float32", "--log-every", "1", "--dp-size", str(dp), *extra)


def _losses(out: str) -> list[float]:
    with open(os.path.join(out, "metrics.json")) as f:
        return [s["loss"] for s in json.load(f)["steps"]]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,extra", [
    ("dspark", ("--num-layers", "1", "--block-size", "4", "--markov-rank", "8", "--num-anchors", "6")),
    ("nextn", ("--unroll-steps", "2")),
])
def test_two_ranks_follow_one_process(tmp_path, target_path, greedy_data, kind, extra):
    train, _ = greedy_data
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert _train(kind, target_path, train, one, 1, *extra) == 0
    assert _train(kind, target_path, train, two, 2, *extra) == 0
    # batch 5 over 2 ranks: shares of 3 and 2 sequences; the losses are the global batch's
    torch.testing.assert_close(torch.tensor(_losses(two)), torch.tensor(_losses(one)), rtol=1e-4, atol=1e-5)
    want, got = load_file(os.path.join(one, "model.safetensors")), load_file(os.path.join(two, "model.safetensors"))
    assert want.keys() == got.keys()
    for name in want:
        # atol: Adam turns a near-zero gradient's rounding into a step of up to lr (one weight in 4608 moved
        # 1.9e-5 apart here); the training moves weights by ~1e-2
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-4, msg=lambda m, n=name: f"{n}: {m}")
    meta = json.load(open(os.path.join(two, "train_args.json")))
    assert meta["dp_size"] == 2


@pytest.mark.timeout(300)
def test_training_moves_the_weights_under_dp(tmp_path, target_path, greedy_data):
    """The equality above must not come from two runs that both did nothing: the weights change with lr > 0."""
    train, _ = greedy_data
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    args = ("--num-layers", "1", "--block-size", "4", "--markov-rank", "8", "--num-anchors", "6")
    assert _train("dspark", target_path, train, a, 2, *args) == 0
    assert train_cli("dspark", target_path, train, b, "--steps", "3", "--batch-size", "5", "--lr", "0",
                     "--save-dtype", "float32", *args) == 0
    trained, still = load_file(os.path.join(a, "model.safetensors")), load_file(os.path.join(b, "model.safetensors"))
    diff = max(float((trained[k] - still[k]).abs().max()) for k in trained)
    assert diff > 1e-4


def test_shards_cover_the_batch_once():
    batch = list("abcdefg")
    shards = [DataParallel(r, 3, torch.device("cpu")).shard(batch) for r in range(3)]
    assert sorted(x for s in shards for x in s) == batch
    for r, s in enumerate(shards):
        dp = DataParallel(r, 3, torch.device("cpu"))
        assert [batch[dp.global_index(i)] for i in range(len(s))] == s


def test_plan_generator_depends_on_seed_step_and_index_only():
    def draw(*key):
        return torch.randint(0, 1 << 30, (4,), generator=plan_generator(*key)).tolist()

    assert draw(0, 3, 5) == draw(0, 3, 5)
    assert len({tuple(draw(*k)) for k in [(0, 3, 5), (1, 3, 5), (0, 4, 5), (0, 3, 6)]}) == 4


def test_dp_size_errors(tmp_path, target_path, greedy_data, capsys):
    train, hold = greedy_data
    with pytest.raises(ValueError, match="at least 1"):
        resolve_dp_devices(0, None)
    assert resolve_dp_devices(2, "cpu") == "cpu"
    assert baton_main(["train", "ablate", "--algorithm", "dspark", "--vary", "markov_rank=0,8", "--model-path",
                       target_path, "--train-data", train, "--holdout-data", hold, "--output", str(tmp_path / "abl"),
                       "--dp-size", "2", "--device", "cpu", "--target-device", "cpu"]) == 2
    assert "--dp-size is for `baton train nextn|dspark`" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_time_budget_stops_every_rank_at_the_same_step(tmp_path, target_path, greedy_data):
    """--time-budget under --dp-size: the ranks share the (max-reduced) step times, so they cut the run at the same
    step; a rank that kept going would wait in a collective for a peer that has left (gloo then raises)."""
    train, _ = greedy_data
    out = str(tmp_path / "cut")
    assert train_cli("dspark", target_path, train, out, "--steps", "40", "--batch-size", "4", "--time-budget",
                     "0.001", "--save-dtype", "float32", "--dp-size", "2", "--num-layers", "1", "--block-size", "4",
                     "--markov-rank", "8", "--num-anchors", "6") == 0
    assert len(_losses(out)) == 1  # the budget was spent by the first step: the run ends there on both ranks


@pytest.mark.timeout(300)
def test_a_failing_rank_is_reported_not_raised(tmp_path, target_path, capsys):
    """A rank's exception (here: training data that does not exist) ends the run with a message and exit code 1."""
    assert train_cli("dspark", target_path, str(tmp_path / "missing.jsonl"), str(tmp_path / "out"), "--steps", "1",
                     "--dp-size", "2") == 1
    assert "a rank failed" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_two_gpu_ranks_follow_one_gpu(tmp_path, target_path, greedy_data):
    """The same over NCCL on two GPUs (bf16 autocast: the two runs agree to bf16 rounding, not to 1e-4)."""
    train, _ = greedy_data
    args = ("--num-layers", "1", "--block-size", "4", "--markov-rank", "8", "--num-anchors", "6")

    def run(out: str, dp: int) -> int:
        return baton_main(["train", "dspark", "--model-path", target_path, "--target-device", "cuda", "--device",
                           "cuda", "--train-data", train, "--output", out, "--steps", "3", "--batch-size", "5",
                           "--lr", "3e-3", "--save-dtype", "float32", "--eval-prompts", "0", "--log-every", "1",
                           "--dp-size", str(dp), *args])

    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    assert run(one, 1) == 0 and run(two, 2) == 0
    torch.testing.assert_close(torch.tensor(_losses(two)), torch.tensor(_losses(one)), rtol=2e-2, atol=1e-3)
