"""`baton train data --backend hf`: batched transformers generation with the target's weights gives the engine
backend's greedy records (left padding, EOS, max_new_tokens and stop strings cut the same way)."""

from __future__ import annotations

import pytest
import torch

from baton.cli import main as baton_main
from baton.config import parse_model_config
from baton.train import data
from baton.train.common import read_jsonl
from baton.train.data import DataOptions, generate_records, generate_records_hf, plan_jobs
from tests.conftest import TINY_LING
from tests.spec.conftest import make_engine
from tests.train.conftest import PROMPTS

pytest.importorskip("transformers")

MAX_NEW = 12


@pytest.fixture(scope="module")
def engine(target_path):
    return make_engine(target_path)


def _jobs(engine, tmp_path, **kw):
    opts = DataOptions(output=str(tmp_path / "d.jsonl"), temperatures=(0.0,), holdout_frac=0.25, **kw)
    return plan_jobs(opts, engine.tokenizer)


def _both(engine, jobs, batch_size=8):
    ref = sorted(generate_records(engine, jobs, MAX_NEW, 0), key=lambda r: r["order"])
    got = sorted(generate_records_hf(engine, jobs, MAX_NEW, 0, batch_size), key=lambda r: r["order"])
    return ref, got


def test_greedy_matches_engine_with_left_padding_and_eos(engine, tmp_path, prompts_file, monkeypatch):
    jobs = _jobs(engine, tmp_path, extra_prompts=prompts_file, num_extra_prompts=4)
    assert sorted({len(p) for p in PROMPTS[:4]}) == [3, 4, 5, 6]  # one batch of four lengths: left padding
    plain, _ = _both(engine, jobs)
    # make a token in the middle of one greedy response an EOS: that row stops there, the others run to the end
    eos = plain[1]["response_ids"][5]
    monkeypatch.setattr(engine, "eos_token_ids", {*engine.eos_token_ids, eos})
    ref, got = _both(engine, jobs)
    assert got == ref
    assert len(got) == 4 and {r["split"] for r in got} == {"train", "holdout"}
    reasons = [r["finish_reason"]["type"] for r in got]
    assert "length" in reasons and {"type": "stop", "matched": eos} in [r["finish_reason"] for r in got]
    for r in got:
        if r["finish_reason"]["type"] == "stop":  # the EOS is kept, as the engine keeps it
            assert r["response_ids"][-1] == eos and eos not in r["response_ids"][:-1]
        else:
            assert len(r["response_ids"]) == MAX_NEW


def test_greedy_matches_engine_with_stop_strings(engine, tmp_path, monkeypatch):
    prompts = tmp_path / "q.txt"
    prompts.write_text("1 2 3\n40 50 60 70 80 90\n7\n11 12 13 14\n")
    monkeypatch.setattr(data, "DEFAULT_STOP", ("no such text",))
    jobs = _jobs(engine, tmp_path, extra_prompts=str(prompts), prompt_formats=("plain",))
    plain, _ = _both(engine, jobs)
    # a stop string ending inside a token's text (IdTokenizer text: "<id> " per token)
    text = engine.tokenizer.decode(plain[2]["response_ids"])
    stop = text[6:12].strip() or text[:4]
    monkeypatch.setattr(data, "DEFAULT_STOP", (stop,))
    ref, got = _both(engine, jobs, batch_size=3)  # two batches
    assert got == ref
    assert any(r["finish_reason"] == {"type": "stop", "matched": stop} for r in got)
    assert any(len(r["response_ids"]) < MAX_NEW for r in got)


def test_cli_hf_backend_writes_the_engine_files(tmp_path, target_path, prompts_file):
    common = ["train", "data", "--model-path", target_path, "--device", "cpu", "--extra-prompts", prompts_file,
              "--num-extra-prompts", "5", "--temperatures", "0", "--max-new-tokens", "8", "--holdout-frac", "0.2"]
    a, b = str(tmp_path / "engine.jsonl"), str(tmp_path / "hf.jsonl")
    assert baton_main([*common, "--output", a]) == 0
    assert baton_main([*common, "--output", b, "--backend", "hf", "--gen-batch-size", "2"]) == 0
    for suffix in ("", ".holdout"):
        fa, fb = (p.replace(".jsonl", f"{suffix}.jsonl") for p in (a, b))
        assert open(fa).read() == open(fb).read()


def test_hf_sampling_is_reproducible(tmp_path, target_path, prompts_file):
    common = ["train", "data", "--model-path", target_path, "--device", "cpu", "--extra-prompts", prompts_file,
              "--num-extra-prompts", "3", "--temperatures", "1.0", "--samples-per-temperature", "2",
              "--max-new-tokens", "6", "--holdout-frac", "0", "--backend", "hf", "--gen-batch-size", "4"]
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    assert baton_main([*common, "--output", a]) == 0
    assert baton_main([*common, "--output", b]) == 0
    assert open(a).read() == open(b).read()
    rows = read_jsonl(a)
    assert len(rows) == 6 and all(r["temperature"] == 1.0 and r["seed"] is not None for r in rows)
    assert all(len(r["response_ids"]) == 6 or r["finish_reason"]["type"] == "stop" for r in rows)


def test_non_llama_target_is_refused():
    from baton.models.hf_export import to_hf_llama
    from baton.models.registry import model_class

    cfg = parse_model_config(TINY_LING)
    with torch.device("meta"):
        model = model_class(cfg)(cfg)
    with pytest.raises(ValueError, match="only available for llama-type targets"):
        to_hf_llama(model)


def test_importing_baton_does_not_import_transformers():
    import subprocess
    import sys

    code = "import sys, baton, baton.train.data, baton.models.hf_export; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
