"""``baton sweep`` end to end on a tiny Llama with a random NEXTN head: servers per config in process (and one
as a ``baton serve`` subprocess), a running server measured as one config, the table and the JSONL lines."""

from __future__ import annotations

import argparse
import io
import json
import re
from pathlib import Path

import pytest

from baton.bench.sweep import (
    InProcessLauncher,
    SubprocessLauncher,
    SweepConfig,
    SweepResult,
    SweepRow,
    dspark_configs,
    format_table,
    nextn_configs,
    parse_int_list,
    run_sweep,
)
from baton.cli import main as baton_main
from baton.config import ServerArgs, SpecConfig
from baton.tokenizer import IdTokenizer

VOCAB = 101  # TINY_LLAMA


def id_tokenizer(path: str | None) -> IdTokenizer:
    return IdTokenizer(VOCAB, eos_token_id=1)


BENCH_FLAGS = ["--dataset-name", "random-ids", "--num-prompts", "2", "--random-input-len", "12",
               "--random-output-len", "8", "--random-range-ratio", "1", "--disable-tqdm"]


def bench_args(**overrides) -> argparse.Namespace:
    values = dict(dataset_name="random-ids", num_prompts=2, random_input_len=16, random_output_len=10,
                  random_range_ratio=1.0, max_concurrency=1, flush_cache=True, disable_tqdm=True)
    return argparse.Namespace(**(values | overrides))


@pytest.fixture(scope="module")
def launcher(llama_path, llama_nextn_path) -> InProcessLauncher:
    return InProcessLauncher(ServerArgs(model_path=llama_path, device="cpu", context_length=512,
                                        spec=SpecConfig(draft_model_path=llama_nextn_path)))


def test_sweep_in_process_steps(launcher: InProcessLauncher, tmp_path: Path) -> None:
    output = tmp_path / "sweep.jsonl"
    out = io.StringIO()
    result = run_sweep(nextn_configs([1, 2]), bench_args(), launcher, str(output), id_tokenizer, out=out)
    assert not result.failed
    assert [r.label for r in result.rows] == ["1 / 2", "2 / 3"]
    for row in result.rows:
        assert row.accept_length is not None and 1.0 <= row.accept_length <= row.config.num_draft_tokens
        assert row.mean_tpot_ms > 0
        assert row.step_time_ms == pytest.approx(row.mean_tpot_ms * row.accept_length)
        assert row.steady_state_tok_s == pytest.approx(1000 / row.mean_tpot_ms)
        assert row.record["completed"] == 2
        assert row.record["server_info"]["speculative_num_steps"] == row.config.num_steps
    table = out.getvalue()
    assert "| config | accept length | mean TPOT (ms) | step time (ms, derived) | steady-state tok/s |" in table
    assert f"best: {result.best.label}" in table
    lines = [json.loads(line) for line in output.read_text().splitlines()]
    assert [x["speculative_num_steps"] for x in lines] == [1, 2]
    assert [x["speculative_num_draft_tokens"] for x in lines] == [2, 3]
    assert sum(x["best"] for x in lines) == 1
    assert all(x["bench"]["completed"] == 2 and "itls" not in x["bench"] for x in lines)


def test_sweep_cli_running_server(launcher: InProcessLauncher, tmp_path: Path,
                                  capsys: pytest.CaptureFixture[str]) -> None:
    output = tmp_path / "sweep.jsonl"
    with launcher.launch(SweepConfig("NEXTN", 3, 4)) as url:
        assert baton_main(["sweep", "--base-url", url, *BENCH_FLAGS, "--output-file", str(output)]) == 0
    printed = capsys.readouterr().out
    # the random checkpoint has no tokenizer files: its server reports token-ids, and the bench counts with them
    assert "no tokenizer at" not in printed
    assert "| 3 / 4 |" in printed and "best: 3 / 4" in printed
    (line,) = output.read_text().splitlines()
    assert json.loads(line)["bench"]["max_concurrency"] == 1


@pytest.mark.parametrize("mode", ["--in-process", "subprocess"])
def test_sweep_cli_launches_servers(llama_path, llama_nextn_path, mode: str, tmp_path: Path,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    server_args = (f"--model-path {llama_path} --device cpu --context-length 256 "
                   f"--speculative-draft-model-path {llama_nextn_path}")
    output = tmp_path / "sweep.jsonl"
    argv = ["sweep", "--steps", "2", "--server-args", server_args, *BENCH_FLAGS, "--output-file", str(output)]
    assert baton_main(argv + ([mode] if mode.startswith("--") else [])) == 0
    assert "best: 2 / 3" in capsys.readouterr().out
    (line,) = output.read_text().splitlines()
    assert json.loads(line)["accept_length"] >= 1.0


def test_subprocess_command() -> None:
    launcher = SubprocessLauncher(["--model-path", "m"], timeout_s=120)
    assert launcher.command(SweepConfig("NEXTN", 2, 3), 1234)[-10:] == [
        "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "2", "--speculative-num-draft-tokens", "3",
        "--host", "127.0.0.1", "--port", "1234"]
    launcher = SubprocessLauncher(["--speculative-algorithm", "EAGLE"])
    assert "NEXTN" not in launcher.command(SweepConfig("NEXTN", 2, 3), 1)


def test_sweep_reports_a_server_that_fails(tmp_path: Path) -> None:
    launcher = SubprocessLauncher(["--model-path", str(tmp_path / "missing"), "--device", "cpu"], timeout_s=120)
    out = io.StringIO()
    result = run_sweep(nextn_configs([1]), bench_args(), launcher, None, id_tokenizer, out=out)
    (row,) = result.failed
    assert "exited" in row.error and "server log tail" in row.error
    log = re.search(r"server log tail \((.+?)\)", row.error)[1]
    assert "missing" in Path(log).read_text()
    Path(log).unlink()
    assert "failed:" in out.getvalue() and "best" not in out.getvalue()


def test_configs_and_table() -> None:
    assert parse_int_list("1,2, 3") == [1, 2, 3]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_int_list("0,1")
    gamma = dspark_configs([4, 8])
    assert [c.num_draft_tokens for c in gamma] == [5, 9] and gamma[0].label == "gamma 4"
    assert gamma[0].flags() == ["--speculative-algorithm", "DSPARK", "--speculative-num-draft-tokens", "5"]
    rows = [SweepRow("3 / 4", None, {"accept_length": 3.11, "mean_tpot_ms": 1.51}),
            SweepRow("4 / 5", None, {"accept_length": 3.37, "mean_tpot_ms": 1.45}),
            SweepRow("5 / 6", None, {"accept_length": 3.45, "mean_tpot_ms": 1.55})]
    table = format_table(SweepResult(rows))
    assert "| 4 / 5 | 3.37 | 1.450 | 4.886 | 690 |" in table
    assert table.endswith("best: 4 / 5 (lowest mean TPOT, 1.450 ms)")


def test_sweep_cli_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert baton_main(["sweep", "--num-prompts", "1"]) == 2
    assert "--steps" in capsys.readouterr().err
    assert baton_main(["sweep", "--steps", "1,2", "--base-url", "http://127.0.0.1:1"]) == 2
    assert "one configuration" in capsys.readouterr().err
