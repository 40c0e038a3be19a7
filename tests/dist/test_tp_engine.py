"""Tensor parallelism end to end on CPU: two gloo ranks give exactly the single-rank tokens, from the same
checkpoint directory, for Ling (plain, NEXTN, DSpark with its heads and the prefix rule, DFlash, simulated
acceptance; the step program) and Llama (plain, a NEXTN head), greedy and sampled; an abort
stops both ranks at the same step and the next request still agrees; ``baton generate`` and ``baton serve``
with ``--tp-size 2`` start the ranks themselves."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from baton.cli import main as baton_main
from baton.config import ServerArgs, SpecConfig, load_model_config
from baton.engine.engine import Engine
from baton.engine.tp import run_tp
from baton.models.dspark_checkpoint import write_random_dspark_draft
from tests.dist.ranks import call_on_all, generate_all, generate_all_fused
from tests.speculative.test_dspark import _memorise_bigrams

ROOT = Path(__file__).resolve().parents[2]
PROMPT = [3, 5, 7, 11, 13, 17, 19, 23]
GREEDY = dict(temperature=0.0, max_new_tokens=24, ignore_eos=True)
SAMPLED = dict(temperature=0.8, top_p=0.9, seed=7, max_new_tokens=16, ignore_eos=True)


def _args(path: str, tp: int, **spec) -> ServerArgs:
    return ServerArgs(model_path=path, device="cpu", context_length=256, tp_size=tp, spec=SpecConfig(**{"adaptive": False, **spec}))


def _copy(requests):
    return [(list(ids), dict(kw)) for ids, kw in requests]


def _both(path: str, requests, setup=None, leader=generate_all, **spec):
    """(single-rank results, two-rank results) of the same requests (``leader``: what rank 0 runs them with)."""
    engine = Engine(_args(path, 1, **spec))
    if setup is not None:
        setup(engine)
    want = leader(engine, _copy(requests))
    got = run_tp(_args(path, 2, **spec), leader, (_copy(requests),), setup=setup, rank0_in_caller=False,
                 timeout_s=60)
    return want, got


def test_ling_tp2_equals_tp1_greedy_sampled_and_abort(ling_path):
    requests = [(PROMPT, GREEDY), (PROMPT[:5], SAMPLED), (PROMPT, {**GREEDY, "abort_after": 0}),
                (PROMPT[2:], GREEDY)]
    want, got = _both(ling_path, requests)
    assert got[0] == want[0] and got[0][1] == "length"
    assert got[1] == want[1]
    tokens, reason, _ = got[2]
    assert reason == "abort" and 0 < len(tokens) < 24 and tokens == want[0][0][: len(tokens)]
    assert got[3] == want[3]


def test_ling_tp2_equals_tp1_nextn(ling_path):
    requests = [(PROMPT, {**GREEDY, "max_new_tokens": 30}), (PROMPT[:6], SAMPLED)]
    want, got = _both(ling_path, requests, algorithm="NEXTN", num_steps=3)
    assert got == want
    assert got[0][2] > 0  # verify steps ran


def test_call_all_runs_on_every_rank_and_the_ranks_stay_in_step(ling_path):
    engine = Engine(_args(ling_path, 1))
    want = generate_all(engine, [([3, 5, 7], dict(temperature=0.0, max_new_tokens=4, ignore_eos=True))])
    total, got = run_tp(_args(ling_path, 2), call_on_all, (10.0,), rank0_in_caller=False, timeout_s=60)
    assert total == (0 + 10.0) + (1 + 10.0)  # rank 1 ran it too: its all-reduce met rank 0's
    assert got == want


def test_ling_tp2_step_program_equals_tp1(ling_path):
    """Greedy and sampled requests through the step program (the sampled one draws from each rank's default
    generator, seeded alike per request)."""
    requests = [(PROMPT, {**GREEDY, "max_new_tokens": 27}), (PROMPT[:5], SAMPLED)]
    want, got = _both(ling_path, requests, algorithm="NEXTN", num_steps=4)
    assert got == want


def test_ling_tp2_fused_shared_expert_equals_tp1_unfused(ling_path):
    """The fused shared expert split over two ranks along its intermediate dim like the routed experts (each rank's
    pair of it a partial sum, one all-reduce), NEXTN too (its MoE fused as well): the tokens of one rank with the
    shared expert a separate MLP (``--disable-shared-experts-fusion``)."""
    requests = [(PROMPT, {**GREEDY, "max_new_tokens": 20})]
    spec = dict(algorithm="NEXTN", num_steps=3)
    want = generate_all(Engine(dataclasses.replace(_args(ling_path, 1, **spec), disable_shared_experts_fusion=True)),
                        _copy(requests))
    got = run_tp(_args(ling_path, 2, **spec), generate_all_fused, (_copy(requests),), rank0_in_caller=False, timeout_s=60)
    assert got == want and got[0][2] > 0


@pytest.fixture(scope="module")
def ling_drafts(ling_path, tmp_path_factory) -> dict[str, str]:
    """Random block drafts for the tiny Ling: DSpark with its heads (the Markov head memorises the bigrams of
    PROMPT's greedy continuation, so whole chains are accepted), DFlash without heads; and an SPS table whose
    every extra verify token costs 20%, with STS temperatures (the prefix rule verifies 2 to 4 of the 5 drafts
    of a greedy round, varying with the chain)."""
    root = tmp_path_factory.mktemp("tp_drafts")
    cfg = load_model_config(ling_path)
    plain = generate_all(Engine(_args(ling_path, 1)), [(PROMPT, {**GREEDY, "max_new_tokens": 40})])[0][0]
    dspark, dflash = str(root / "dspark"), str(root / "dflash")
    write_random_dspark_draft(cfg, dspark, seed=1, block_size=5, num_layers=2, markov_rank=64)
    _memorise_bigrams(dspark, PROMPT + plain)
    write_random_dspark_draft(cfg, dflash, seed=2, block_size=4, num_layers=1, with_heads=False)
    (root / "sps.json").write_text(json.dumps({"verify_tokens": list(range(1, 8)),
                                               "step_time_ms": [10 * 1.2**i for i in range(7)]}))
    (root / "sts.json").write_text(json.dumps({"temperatures": [0.3, 0.5, 1.0, 1.0, 2.0]}))
    return {"DSPARK": dspark, "DFLASH": dflash, "sps": str(root / "sps.json"), "sts": str(root / "sts.json")}


BLOCK_REQUESTS = [(PROMPT, GREEDY), (PROMPT[:5], SAMPLED)]


def test_ling_tp2_dspark_equals_tp1(ling_path, ling_drafts):
    """DSpark with the greedy Markov chain over the gathered base logits and the prefix rule decided on the device
    (rank 0's prefix broadcast), greedy and sampled verify."""
    want, got = _both(ling_path, BLOCK_REQUESTS, algorithm="DSPARK",
                      draft_model_path=ling_drafts["DSPARK"], dspark_sps_table_path=ling_drafts["sps"],
                      dspark_confidence_sts_path=ling_drafts["sts"])
    assert got == want
    tokens, reason, num_verify = got[0]  # greedy
    assert reason == "length" and len(tokens) == 24 and 0 < num_verify < 23  # chains were accepted


def test_ling_tp2_dflash_equals_tp1(ling_path, ling_drafts):
    want, got = _both(ling_path, BLOCK_REQUESTS, algorithm="DFLASH", draft_model_path=ling_drafts["DFLASH"])
    assert got == want
    assert got[0][2] > 0 and got[1][2] > 0


def test_ling_tp2_dspark_simulated_accept_equals_tp1(ling_path, ling_drafts):
    """Simulated acceptance commits the drafts themselves: the TP=2 chain must be the TP=1 chain."""
    want, got = _both(ling_path, BLOCK_REQUESTS[:1], algorithm="DSPARK",
                      draft_model_path=ling_drafts["DSPARK"], simulate_accept_len=3.5)
    assert got == want
    tokens, _, num_verify = got[0]
    assert num_verify < len(tokens) / 2  # about 3.5 tokens a verify step


def test_llama_tp2_equals_tp1_plain_and_nextn_head(llama_path, llama_nextn_path):
    requests = [(PROMPT, GREEDY), (PROMPT[:4], SAMPLED)]
    want, got = _both(llama_path, requests)
    assert got == want
    want, got = _both(llama_path, requests[:1], algorithm="NEXTN", num_steps=3, draft_model_path=llama_nextn_path)
    assert got == want


def _cli(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "BATON_NO_PROGRESS": "1"}
    return subprocess.run([sys.executable, "-m", "baton.cli", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=timeout)


def test_generate_cli_tp2_prints_the_tp1_text(ling_path, capsys):
    argv = ["generate", "--model-path", ling_path, "--device", "cpu", "--no-chat", "--prompt", "3 5 7 11",
            "--max-new-tokens", "12", "--ignore-eos", "--context-length", "128"]
    assert baton_main(argv) == 0
    want = capsys.readouterr().out
    proc = _cli(*argv, "--tp-size", "2")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == want


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_cli_tp2_answers_like_tp1_and_exits_cleanly(ling_path):
    want = generate_all(Engine(_args(ling_path, 1)), [(PROMPT, dict(GREEDY, max_new_tokens=10))])[0][0]
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "baton.cli", "serve", "--model-path", ling_path, "--device", "cpu", "--tp-size", "2",
         "--port", str(port), "--context-length", "256", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "BATON_NO_PROGRESS": "1"})
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"baton ready: http://127.0.0.1:{port}"), proc.stderr.read()
        body = {"input_ids": PROMPT, "sampling_params": {"temperature": 0, "max_new_tokens": 10, "ignore_eos": True}}
        for _ in range(2):
            r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
            assert r.status_code == 200 and r.json()["output_ids"] == want
    finally:
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err


def test_tp_size_the_model_cannot_split_is_a_clear_error_before_any_rank_starts(llama_path, capsys):
    argv = ["generate", "--model-path", llama_path, "--device", "cpu", "--tp-size", "4", "--max-new-tokens", "2"]
    assert baton_main(argv) == 2
    assert "num_attention_heads (6) is not divisible by --tp-size 4" in capsys.readouterr().err
