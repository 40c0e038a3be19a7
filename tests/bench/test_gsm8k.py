"""GSM8K evaluation: answer extraction, train-only few-shot prompts, the metrics, and ``baton eval gsm8k`` end
to end on the embedded model in process."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from baton.bench.gate import Completion
from baton.bench.gsm8k import (
    DEFAULT_STOP,
    EvalError,
    build_prompt,
    data_files,
    extract_answer,
    extract_label,
    few_shot_prefix,
    find_numbers,
    read_jsonl,
    run_gsm8k,
    same_number,
)
from baton.bench.sweep import InProcessLauncher, SweepConfig
from baton.cli import main as baton_main
from baton.config import ServerArgs, SpecConfig
from baton.speculative.shipped import with_shipped_drafts

DATA = Path("/work/shared/data/gsm8k")
needs_data = pytest.mark.skipif(not (DATA / "test.jsonl").is_file(), reason="GSM8K data not present")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 42.", 42.0),
        ("It costs $1,234 in total", 1234.0),
        ("She owes -3 dollars", -3.0),
        ("the temperature fell to -12.5 degrees", -12.5),
        ("10 - 3 = 7", 7.0),
        ("7-3=4", 4.0),
        ("He pays $2.50 per cup", 2.5),
        ("0.2 x 50 = $<<0.2*50=10>>10.", 10.0),
        ("numbers 1,2,3", 3.0),
        ("12,345,678 grains", 12345678.0),
        ("loses \u22125 points", -5.0),
        ("half is .5", 0.5),
        ("48/2 = <<48/2=24>>24 clips\n#### 72\n\n", 72.0),
        ("#### -1,200", -1200.0),
        ("So she has 5 left.\n#### 5 apples, 7 pears", 7.0),
    ],
)
def test_extract_answer(text: str, expected: float) -> None:
    assert extract_answer(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "no numbers here", "####", "the answer is x"])
def test_extract_answer_invalid(text: str) -> None:
    assert extract_answer(text) is None


def test_find_numbers_signs() -> None:
    assert find_numbers("from -2 to 3-4, (5)-6") == [-2.0, 3.0, 4.0, 5.0, 6.0]


def test_extract_label() -> None:
    assert extract_label("Natalia sold 48+24 = <<48+24=72>>72 clips.\n#### 72") == 72.0
    assert extract_label("...\n#### 1,000") == 1000.0
    assert extract_label("...\n#### -4") == -4.0
    assert extract_label("... #### 3.5") == 3.5
    with pytest.raises(EvalError):
        extract_label("#### none")


def test_same_number() -> None:
    assert same_number(72.0, 72.0) and same_number(2.5, 2.5000000001)
    assert not same_number(None, 3.0) and not same_number(3.0, 4.0)


@needs_data
def test_prompt_uses_train_only() -> None:
    test_path, train_path = data_files(str(DATA))
    test, train = read_jsonl(test_path), read_jsonl(train_path)
    prefix = few_shot_prefix(train, 5)
    for ex in train[:5]:
        assert f"Question: {ex['question']}\nAnswer: {ex['answer']}\n\n" in prefix
    assert not any(ex["question"] in prefix for ex in test)
    prompt = build_prompt(prefix, test[0]["question"])
    assert prompt.startswith(prefix) and prompt.endswith(f"Question: {test[0]['question']}\nAnswer:")
    assert prompt.count("Question:") == 6
    assert data_files(str(DATA / "test.jsonl")) == (test_path, train_path)


def test_data_files_errors(tmp_path: Path) -> None:
    with pytest.raises(EvalError, match="grade-school-math"):
        data_files(str(tmp_path))
    (tmp_path / "test.jsonl").write_text("")
    with pytest.raises(EvalError, match="train"):
        data_files(str(tmp_path / "test.jsonl"))
    with pytest.raises(EvalError, match="num-shots"):
        few_shot_prefix([{"question": "q", "answer": "#### 1"}], 2)


class ScriptedClient:
    """Answers from a table keyed by question; counts like a spec server (2 tokens per verify step)."""

    name = "scripted"

    def __init__(self, answers: dict[str, str]) -> None:
        self.answers = answers
        self.prompts: list[str] = []
        self.sampling: dict[str, Any] = {}

    def generate(self, prompt: str, sampling: dict[str, Any]) -> Completion:
        self.prompts.append(prompt)
        self.sampling = sampling
        question = prompt.rsplit("Question: ", 1)[1].split("\nAnswer:")[0]
        return Completion(self.answers[question], None, 10, 5)

    def server_accept_length(self) -> float | None:
        return None

    def close(self) -> None:
        pass


def test_run_gsm8k_metrics() -> None:
    train = [{"question": f"train q{i}", "answer": f"work\n#### {i}"} for i in range(3)]
    test = [{"question": f"test q{i}", "answer": f"...\n#### {v}"} for i, v in enumerate([5, -2, 1200, 7])]
    client = ScriptedClient({"test q0": " 2 + 3 = 5\n#### 5", "test q1": " so -2", "test q2": " $1,200.",
                             "test q3": " I do not know"})
    result = run_gsm8k(client, test, train, num_shots=2, max_new_tokens=32, parallel=3)
    assert result.accuracy == pytest.approx(0.75)
    assert result.invalid == pytest.approx(0.25)
    assert result.accept_length == pytest.approx(2.0)
    assert result.num_questions == 4 and result.latency > 0 and result.output_throughput > 0
    assert [d.correct for d in result.details] == [True, True, True, False]
    assert client.sampling == {"temperature": 0.0, "max_new_tokens": 32, "stop": list(DEFAULT_STOP)}
    assert all("train q1" in p and "train q2" not in p for p in client.prompts)


@needs_data
def test_eval_gsm8k_cli_embedded(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out_file = tmp_path / "gsm8k.json"
    argv = ["eval", "gsm8k", "--data-path", str(DATA), "--num-questions", "5", "--num-shots", "1",
            "--max-new-tokens", "24", "--output-file", str(out_file), "--output-details"]
    assert baton_main(argv) == 0
    printed = capsys.readouterr().out
    for label in ("Accuracy:", "Invalid:", "Latency:", "Output throughput:"):
        assert label in printed
    record = json.loads(out_file.read_text())
    assert record["task"] == "gsm8k" and record["num_questions"] == 5 and record["num_shots"] == 1
    assert 0.0 <= record["accuracy"] <= 1.0 and 0.0 <= record["invalid"] <= 1.0
    assert record["output_throughput"] > 0
    # the embedded model's default on this device (baton/speculative/shipped.py; on the CPU: plain decoding)
    if not with_shipped_drafts(SpecConfig(), True, None, device="cpu").enabled:
        assert record["accept_length"] is None
    else:
        assert record["accept_length"] >= 1.0
    assert len(record["details"]) == 5 and all(d["completion_tokens"] > 0 for d in record["details"])


def test_eval_gsm8k_cli_missing_data(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert baton_main(["eval", "gsm8k", "--data-path", str(tmp_path)]) == 2
    assert "test.jsonl" in capsys.readouterr().err


@needs_data
def test_eval_gsm8k_cli_server_with_spec(llama_path: str, llama_nextn_path: str, tmp_path: Path) -> None:
    launcher = InProcessLauncher(ServerArgs(model_path=llama_path, device="cpu", context_length=512,
                                            spec=SpecConfig(draft_model_path=llama_nextn_path)))
    out_file = tmp_path / "gsm8k.json"
    with launcher.launch(SweepConfig("NEXTN", 2, 3)) as url:
        argv = ["eval", "gsm8k", "--data-path", str(DATA / "test.jsonl"), "--base-url", url, "--num-questions", "3",
                "--num-shots", "0", "--max-new-tokens", "8", "--parallel", "2", "--output-file", str(out_file)]
        assert baton_main(argv) == 0
    record = json.loads(out_file.read_text())
    assert record["num_questions"] == 3 and record["server"] == url
    assert record["accept_length"] is not None and 1.0 <= record["accept_length"] <= 3.0
    assert "details" not in record
