"""The correctness gate on a tiny Llama with a random NEXTN head: it passes in process (baseline written, then
checked), over HTTP against two servers, and fails with the divergence printed when verify is broken."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
import torch

import baton.engine.step as step_module
from baton.bench.gate import (
    FAIL,
    PASS,
    SKIP,
    Completion,
    EngineClient,
    GateError,
    NativeClient,
    _spec_overrides,
    describe_divergence,
    first_difference,
    run_gate,
)
from baton.bench.sweep import InProcessLauncher, SweepConfig
from baton.cli import main as baton_main
from baton.config import ServerArgs, SpecConfig
from baton.speculative.verify import Verdict
from tests.speculative.conftest import make_engine

NUM_TOKENS = 40
PROMPTS = ["The history of the printing press", "def add(a, b):"]


def _cli(llama: str, nextn: str, *extra: str) -> list[str]:
    spec = f"--speculative-algorithm NEXTN --speculative-num-steps 3 --speculative-draft-model-path {nextn}"
    return ["gate", "--model-path", llama, "--device", "cpu", "--context-length", "512", "--spec-args", spec,
            "--num-tokens", str(NUM_TOKENS), "--num-sampled", "1", "--sampled-tokens", "16", *extra]


def test_gate_cli_passes_and_checks_baseline(llama_path, llama_nextn_path, tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    baseline = tmp_path / "gate.json"
    assert baton_main(_cli(llama_path, llama_nextn_path, "--baseline", str(baseline), "--write-baseline")) == 0
    written = json.loads(baseline.read_text())["accept_length"]
    assert written >= 1.0
    out = capsys.readouterr().out
    assert "WRITTEN" in out and "gate: PASS" in out

    assert baton_main(_cli(llama_path, llama_nextn_path, "--baseline", str(baseline))) == 0
    out = capsys.readouterr().out
    assert "greedy parity (a vs b)          PASS" in out and "FAIL" not in out

    baseline.write_text(json.dumps({"accept_length": written + 0.2}))
    assert baton_main(_cli(llama_path, llama_nextn_path, "--baseline", str(baseline))) == 1
    out = capsys.readouterr().out
    assert "accept length" in out and "FAIL" in out and "gate: FAIL" in out


def test_gate_api_texts_equal(llama_path, llama_nextn_path) -> None:
    result = run_gate(lambda: EngineClient(make_engine(llama_path)),
                      lambda: EngineClient(make_engine(llama_path, algorithm="NEXTN", num_steps=2,
                                                       draft_model_path=llama_nextn_path)),
                      PROMPTS, NUM_TOKENS, num_sampled=2, sampled_tokens=8, out=False)
    assert result.passed and result.exit_code == 0
    assert [c.status for c in result.checks] == [PASS, SKIP, PASS]
    assert [c.text for c in result.reference] == [c.text for c in result.candidate] == [c.text for c in result.repeat]
    assert all(c.completion_tokens == NUM_TOKENS for c in result.candidate)
    assert result.accept_length is not None and result.accept_length >= 1.0


def _accept_everything(draft_tokens: torch.Tensor, predict: torch.Tensor, limit=None) -> Verdict:
    """A broken verify: every draft is accepted whatever the target says."""
    k = draft_tokens.shape[0]
    bonus = predict[k]
    return Verdict(torch.tensor(k), bonus, torch.cat([draft_tokens, bonus.reshape(1)]))


def test_gate_fails_on_broken_verify(llama_path, llama_nextn_path, monkeypatch) -> None:
    monkeypatch.setattr(step_module, "greedy_verify_tokens", _accept_everything)
    out = io.StringIO()
    result = run_gate(lambda: EngineClient(make_engine(llama_path)),
                      lambda: EngineClient(make_engine(llama_path, algorithm="NEXTN", num_steps=3,
                                                       draft_model_path=llama_nextn_path)),
                      PROMPTS, NUM_TOKENS, num_sampled=1, sampled_tokens=8, out=out)
    assert not result.passed and result.exit_code == 1
    assert result.checks[0].status == FAIL
    assert result.accept_length == pytest.approx(4.0)
    printed = out.getvalue()
    assert "diverges at token" in printed and "gate: FAIL" in printed
    assert "common" in printed and "\n    a " in printed and "\n    b " in printed


def test_gate_over_http(llama_path, llama_nextn_path, tmp_path: Path) -> None:
    launcher = InProcessLauncher(ServerArgs(model_path=llama_path, device="cpu", context_length=512,
                                            spec=SpecConfig(draft_model_path=llama_nextn_path)))
    baseline = str(tmp_path / "gate.json")
    with launcher.launch(None) as url_a, launcher.launch(SweepConfig("NEXTN", 2, 3)) as url_b:
        for write in (True, False):
            result = run_gate(lambda: NativeClient(url_a), lambda: NativeClient(url_b), PROMPTS, NUM_TOKENS,
                              baseline, write, num_sampled=1, sampled_tokens=8, out=False)
            assert result.passed, result.checks
        assert result.candidate[0].output_ids is not None
        assert len(result.candidate[0].output_ids) == NUM_TOKENS


def test_first_difference_and_description() -> None:
    assert first_difference("abc", "abc") is None
    assert first_difference("abc", "abd") == 2
    assert first_difference([1, 2], [1, 2, 3]) == 2
    a = Completion("hello world, plain", [1, 2, 3, 4], 4, 0)
    b = Completion("hello world, spec!", [1, 2, 9, 4], 4, 2)
    text = describe_divergence("prompt", a, b)
    assert "token 2 (3 vs 9)" in text and "char 13" in text
    assert "'plain'" in text and "'spec!'" in text and "hello world, " in text


def test_spec_args_only_take_speculative_flags() -> None:
    assert _spec_overrides("--speculative-algorithm NEXTN --speculative-num-steps 2") == {
        "speculative_algorithm": "NEXTN", "speculative_num_steps": 2}
    with pytest.raises(GateError, match="speculative"):
        _spec_overrides("--speculative-algorithm NEXTN --dtype float16")


def test_gate_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert baton_main(["gate", "--base-url-a", "http://127.0.0.1:1"]) == 2
    assert "both" in capsys.readouterr().err
    assert baton_main(["gate", "--model-path", "x", "--write-baseline"]) == 2
    assert baton_main(["gate", "--model-path", "x"]) == 2
    assert "no speculation" in capsys.readouterr().err
