"""``baton bench``'s prefix-cache datasets against the fake SGLang server of test_serving: SGLang's
``generated-shared-prefix`` shape, and ``multi-turn`` (each turn resends the conversation so far, sent cached
then cold after /flush_cache, TTFT per turn)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from baton.bench.serving import add_bench_args, build_dataset
from tests.bench.test_serving import FakeServer, TinyTokenizer, _run, fake_server, server  # noqa: F401


def test_generated_shared_prefix_shape() -> None:
    argv = ["--dataset-name", "generated-shared-prefix", "--gsp-num-groups", "3", "--gsp-prompts-per-group", "4",
            "--gsp-system-prompt-len", "20", "--gsp-question-len", "5", "--gsp-output-len", "7", "--tokenize-prompt"]
    args = add_bench_args(argparse.ArgumentParser()).parse_args(argv)
    np.random.seed(0)
    rows = build_dataset(args, TinyTokenizer())
    assert len(rows) == 12 and all(r.prompt_len == 25 and r.output_len == 7 for r in rows)
    for g in range(3):
        group = rows[4 * g : 4 * g + 4]
        assert all(r.prompt[:20] == group[0].prompt[:20] for r in group)  # one system prompt per group
    assert rows[0].prompt[:20] != rows[4].prompt[:20]


def test_multi_turn_resends_the_conversation(server: FakeServer, tmp_path: Path) -> None:  # noqa: F811
    argv = ["--base-url", server.url, "--dataset-name", "multi-turn", "--num-prompts", "2", "--random-input-len",
            "16", "--random-output-len", "6", "--multi-turn-num-turns", "3", "--multi-turn-user-len", "4",
            "--tokenize-prompt", "--disable-tqdm", "--output-file", str(tmp_path / "mt.jsonl")]
    record = _run(add_bench_args(argparse.ArgumentParser()).parse_args(argv))
    turns = record["turns"]
    assert [(t["conversation"], t["turn"]) for t in turns] == [(c, t) for c in range(2) for t in range(3)]
    generated = [ids for path, body in server.payloads if (ids := body.get("input_ids")) is not None]
    timed = generated[1:]  # after the warmup
    assert timed[0] == timed[1] and len(timed) == 12  # each turn twice: cached, then cold
    first, second = timed[0], timed[2]
    assert second[: len(first)] == first and len(second) > len(first) + 4  # + the answer + 4 new tokens
    assert server.flushes == 2 + 6  # one per conversation, one before each cold run
    assert all(t["ttft_cold_ms"] > 0 and t["ttft_cached_ms"] > 0 for t in turns)
    assert json.loads((tmp_path / "mt.jsonl").read_text())["dataset_name"] == "multi-turn"
