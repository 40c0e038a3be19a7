"""The shipped-draft default of the embedded model: the CLI fills the algorithm and paths, `none` turns it off."""

from __future__ import annotations

import argparse
import json

import pytest

from baton.cli import add_engine_args, server_args_from
from baton.speculative.shipped import shipped_draft


def _args(*argv: str):
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return server_args_from(p.parse_args(list(argv)))


@pytest.fixture
def shipped(tmp_path, monkeypatch):
    root = tmp_path / "drafts"
    for sub in ("nextn", "dspark"):
        (root / sub).mkdir(parents=True)
        (root / sub / "config.json").write_text("{}")
    (root / "dspark" / "sts.json").write_text(json.dumps({"temperatures": [1.0] * 8}))
    (root / "defaults.json").write_text(json.dumps({"algorithm": "DSPARK", "num_draft_tokens": 9}))
    monkeypatch.setenv("BATON_SHIPPED_DRAFTS", str(root))
    return root


def test_embedded_speculates_by_default(shipped):
    spec = _args().spec
    assert spec.algorithm == "DSPARK" and spec.num_draft_tokens == 9
    assert spec.draft_model_path == str(shipped / "dspark")
    assert spec.dspark_confidence_sts_path == str(shipped / "dspark" / "sts.json")


@pytest.mark.parametrize("word", ["none", "NONE", "off"])
def test_none_turns_it_off(shipped, word):
    assert not _args("--speculative-algorithm", word).spec.enabled


def test_named_algorithm_takes_the_shipped_draft(shipped):
    spec = _args("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2").spec
    assert spec.algorithm == "NEXTN" and spec.num_steps == 2 and spec.num_draft_tokens == 3
    assert spec.draft_model_path == str(shipped / "nextn")


def test_named_default_algorithm_takes_the_shipped_depth(shipped):
    """`--speculative-algorithm DSPARK` alone gets the shipped gamma (defaults.json), not the drafter's whole trained
    block; an explicit depth wins; NEXTN, not the default here, keeps its own default of 3 steps."""
    assert _args("--speculative-algorithm", "DSPARK").spec.num_draft_tokens == 9
    assert _args("--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens", "5").spec.num_draft_tokens == 5
    nextn = _args("--speculative-algorithm", "NEXTN").spec
    assert nextn.num_steps == 3 and nextn.num_draft_tokens == 4


def test_explicit_paths_and_other_models_are_left_alone(shipped, tmp_path):
    spec = _args("--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", str(tmp_path)).spec
    assert spec.draft_model_path == str(tmp_path)
    assert not _args("--model-path", str(tmp_path)).spec.enabled


def test_a_dspark_draft_directory_brings_its_own_calibration(shipped, tmp_path):
    """A drafter trained by the recipe (or `baton train dspark` + `baton train calibrate`) has its sts.json beside
    the checkpoint: naming the directory uses it, as the shipped drafter's is, for the embedded model and any
    other; an explicit --speculative-dspark-confidence-sts-path wins; a directory without one has none."""
    draft = tmp_path / "my_dspark"
    draft.mkdir()
    (draft / "config.json").write_text("{}")
    (draft / "sts.json").write_text(json.dumps({"temperatures": [1.0] * 8}))
    for model in ((), ("--model-path", str(tmp_path))):
        spec = _args(*model, "--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft)).spec
        assert spec.dspark_confidence_sts_path == str(draft / "sts.json")
    other = tmp_path / "other.json"
    spec = _args("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft),
                 "--speculative-dspark-confidence-sts-path", str(other)).spec
    assert spec.dspark_confidence_sts_path == str(other)
    (draft / "sts.json").unlink()
    spec = _args("--speculative-algorithm", "DSPARK", "--speculative-draft-model-path", str(draft)).spec
    assert spec.dspark_confidence_sts_path is None
    nextn = _args("--speculative-algorithm", "NEXTN", "--speculative-draft-model-path", str(draft)).spec
    assert nextn.dspark_confidence_sts_path is None


def test_no_shipped_drafts_means_plain(tmp_path, monkeypatch):
    monkeypatch.setenv("BATON_SHIPPED_DRAFTS", str(tmp_path / "missing"))
    assert not _args().spec.enabled
    assert shipped_draft("NEXTN") is None


def test_sweep_config_repicks_the_shipped_draft(shipped):
    from baton.bench.sweep import SweepConfig

    base = _args()  # the embedded default: DSPARK with the shipped DSpark draft
    nextn = SweepConfig("NEXTN", 2, 3).apply(base)
    assert nextn.spec.algorithm == "NEXTN" and nextn.spec.draft_model_path == str(shipped / "nextn")
    dspark = SweepConfig("DSPARK", None, 5).apply(base)
    assert dspark.spec.draft_model_path == str(shipped / "dspark") and dspark.spec.num_draft_tokens == 5


def test_by_device_default_turns_speculation_off_where_it_does_not_pay(shipped):
    (shipped / "defaults.json").write_text(json.dumps({"algorithm": "DSPARK", "num_draft_tokens": 9,
                                                       "by_device": {"cpu": {"algorithm": None, "why": "measured"}}}))
    assert not _args("--device", "cpu").spec.enabled  # the CPU default: plain decoding
    named = _args("--device", "cpu", "--speculative-algorithm", "DSPARK").spec
    assert named.draft_model_path == str(shipped / "dspark")
    spec = _args("--device", "cuda").spec  # elsewhere: the top-level default
    assert spec.algorithm == "DSPARK" and spec.num_draft_tokens == 9


def test_the_shipped_defaults_say_why_the_cpu_decodes_plainly():
    from baton.speculative.shipped import shipped_defaults

    cpu = shipped_defaults().get("by_device", {}).get("cpu")
    if cpu is None:
        pytest.skip("no shipped defaults in this install")
    assert cpu["algorithm"] is None and "benchmarks/results" in cpu["why"]
