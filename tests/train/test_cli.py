"""`baton train` on the command line: help for every step, and a small ablation grid end to end."""

from __future__ import annotations

import json
import os

import pytest

from baton.cli import main as baton_main


def test_help_lists_every_step(capsys):
    with pytest.raises(SystemExit):
        baton_main(["train", "--help"])
    out = capsys.readouterr().out
    for step in ("data", "nextn", "dspark", "calibrate", "ablate", "SplitServe"):
        assert step in out
    for step, flag in (("data", "--temperatures"), ("nextn", "--unroll-steps"), ("dspark", "--num-anchors"),
                       ("calibrate", "--mode"), ("ablate", "--vary")):
        with pytest.raises(SystemExit):
            baton_main(["train", step, "--help"])
        assert flag in capsys.readouterr().out


@pytest.mark.timeout(150)
def test_ablate_markov_rank(tmp_path, target_path, greedy_data, capsys):
    train, hold = greedy_data
    out = str(tmp_path / "ablate")
    assert baton_main(["train", "ablate", "--algorithm", "dspark", "--vary", "markov-rank=0,8", "--model-path",
                       target_path, "--target-device", "cpu", "--device", "cpu", "--train-data", train,
                       "--holdout-data", hold, "--output", out, "--steps", "12", "--batch-size", "6",
                       "--block-size", "3", "--num-layers", "1", "--num-anchors", "8", "--eval-prompts", "2",
                       "--eval-max-new-tokens", "16"]) == 0
    results = json.load(open(os.path.join(out, "ablation.json")))["results"]
    assert [r["variant"] for r in results] == ["markov_rank=0", "markov_rank=8"]
    assert all(r["accept_length"] >= 1.0 and r["steps"] == 12 for r in results)
    with open(os.path.join(out, "markov_rank=0", "config.json")) as f:
        assert json.load(f)["dspark_markov_rank"] == 0  # rank 0 is a DFlash draft
    assert os.path.getsize(os.path.join(out, "ablation.png")) > 1000
    # --init is one option for both draft kinds (ablate carries both groups): None means the kind's default
    from baton.train.cli import _dspark_options

    parser = __import__("baton.cli", fromlist=["build_parser"]).build_parser()
    ns = parser.parse_args(["train", "ablate", "--vary", "init=random,target", "--train-data", train, "--output", out])
    assert ns.init is None and _dspark_options(ns).init == "random"
    ns = parser.parse_args(["train", "dspark", "--init", "target", "--train-data", train, "--output", out])
    assert _dspark_options(ns).init == "target"
    assert baton_main(["train", "ablate", "--algorithm", "dspark", "--vary", "no_such_option=1,2", "--train-data",
                       train, "--output", out]) == 2
