"""`baton train data --backend hf`: batched transformers generation with the target's weights gives the engine
backend's greedy records (left padding, EOS, max_new_tokens and stop strings cut the same way)."""

from __future__ import annotations

import logging

import pytest
import torch

from baton.cli import main as baton_main
from baton.config import parse_model_config
from baton.train import data
from baton.train.common import read_jsonl
from baton.train.data import DataOptions, generate_records, generate_records_hf, plan_jobs
from tests.conftest import TINY_LING
from tests.speculative.conftest import make_engine
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


def _stop_string_jobs(engine, tmp_path, monkeypatch):
    """Four plain prompts and a stop string (now data.DEFAULT_STOP) cut from the middle of one greedy response,
    ending inside a token's text (IdTokenizer text: "<id> " per token)."""
    prompts = tmp_path / "q.txt"
    prompts.write_text("1 2 3\n40 50 60 70 80 90\n7\n11 12 13 14\n")
    monkeypatch.setattr(data, "DEFAULT_STOP", ("no such text",))
    jobs = _jobs(engine, tmp_path, extra_prompts=str(prompts), prompt_formats=("plain",))
    plain, _ = _both(engine, jobs)
    text = engine.tokenizer.decode(plain[2]["response_ids"])
    stop = text[6:12].strip() or text[:4]
    monkeypatch.setattr(data, "DEFAULT_STOP", (stop,))
    return jobs, stop


def test_greedy_matches_engine_with_stop_strings(engine, tmp_path, monkeypatch):
    jobs, stop = _stop_string_jobs(engine, tmp_path, monkeypatch)
    ref, got = _both(engine, jobs, batch_size=3)  # two batches
    assert got == ref
    assert any(r["finish_reason"] == {"type": "stop", "matched": stop} for r in got)
    assert any(len(r["response_ids"]) < MAX_NEW for r in got)


def _counting_generate(monkeypatch) -> list[tuple[int, int]]:
    """(new tokens returned, max_new_tokens) of every ``generate`` call of the hf backend."""
    from baton.models import hf_export

    calls, export = [], hf_export.to_hf_llama

    def to_hf_llama(*args, **kw):
        model = export(*args, **kw)
        generate = model.generate

        def counted(input_ids, **gkw):
            out = generate(input_ids, **gkw)
            calls.append((out.shape[1] - input_ids.shape[1], gkw["max_new_tokens"]))
            return out

        model.generate = counted
        return model

    monkeypatch.setattr(hf_export, "to_hf_llama", to_hf_llama)
    return calls


@pytest.mark.parametrize("every", [1, 5])
def test_periodic_stop_check_gives_the_engine_records(engine, tmp_path, monkeypatch, every):
    """Stop strings checked every ``every`` steps during generate (and the rest after it): the same cuts as the
    engine's token-by-token rule, wherever a check falls."""
    jobs, stop = _stop_string_jobs(engine, tmp_path, monkeypatch)
    monkeypatch.setattr(data, "STOP_CHECK_EVERY", every)
    ref, got = _both(engine, jobs, batch_size=3)
    assert got == ref
    assert any(r["finish_reason"] == {"type": "stop", "matched": stop} for r in got)


def test_batch_ends_at_the_check_after_every_row_stopped(engine, tmp_path, monkeypatch):
    """A stop string every row matches at its first token: generate ends at the first check, not at the budget."""
    prompts = tmp_path / "q.txt"
    prompts.write_text("1 2 3\n40 50 60 70 80 90\n7\n")
    monkeypatch.setattr(data, "DEFAULT_STOP", (" ",))  # IdTokenizer text: "<id> " per token
    monkeypatch.setattr(data, "STOP_CHECK_EVERY", 3)
    jobs = _jobs(engine, tmp_path, extra_prompts=str(prompts), prompt_formats=("plain",))
    calls = _counting_generate(monkeypatch)
    ref, got = _both(engine, jobs)
    assert got == ref
    assert all(len(r["response_ids"]) == 1 and r["finish_reason"] == {"type": "stop", "matched": " "} for r in got)
    assert calls == [(3, MAX_NEW)]


def test_eos_only_batches_run_without_host_criteria(engine, tmp_path, prompts_file, monkeypatch):
    """Prompts without stop strings (token-id prompts here, chat in practice): no stopping criteria of ours,
    EOS is transformers' own check on the device."""
    seen = []
    monkeypatch.setattr(data, "_periodic_rows_done", lambda *a: seen.append(a) or pytest.fail("criteria used"))
    jobs = _jobs(engine, tmp_path, extra_prompts=prompts_file, num_extra_prompts=4)
    ref, got = _both(engine, jobs)
    assert got == ref and not seen


def test_batches_keep_settings_and_formats_apart():
    """Within a sampling setting, prompts sorted by length; chat (short) and fewshot (long) never share a batch,
    so no chat row is padded to a few-shot prompt's length. The groups' batches are interleaved (first batch of
    each group, then the second of each, ...)."""
    item = data.PromptItem("p", "x", question="q")
    lens = {"chat": [5, 9, 3, 7, 30], "fewshot": [20, 40, 25]}  # a chat prompt longer than a fewshot one
    jobs = [data._HFJob(i, item, f, fmt, j, [0] * n, [], 4) for j in range(2) for f, fmt in enumerate(lens)
            for i, n in enumerate(lens[fmt])]
    batches = data._hf_batches(jobs, 2, 3)
    expect = [[("chat", 3), ("chat", 5), ("chat", 7)], [("chat", 9), ("chat", 30)],
              [("fewshot", 20), ("fewshot", 25), ("fewshot", 40)]]
    chat, fewshot = expect[:2], expect[2:]
    order = [(0, chat[0]), (0, fewshot[0]), (1, chat[0]), (1, fewshot[0]), (0, chat[1]), (1, chat[1])]
    assert [[(b.j, b.fmt, len(b.ids)) for b in batch] for batch in batches] == [
        [(j, *x) for x in batch] for j, batch in order]


def test_progress_line_per_batch(engine, tmp_path, prompts_file, caplog):
    jobs = _jobs(engine, tmp_path, extra_prompts=prompts_file, num_extra_prompts=5)
    with caplog.at_level(logging.INFO, logger="baton.train.data"):
        generate_records_hf(engine, jobs, MAX_NEW, 0, 2)
    lines = [r.getMessage() for r in caplog.records if r.name == "baton.train.data"]
    batch_lines = [m for m in lines if "batch " in m and "tokens/s" in m]
    assert [m.split(": batch ")[1].split(" ")[0] for m in batch_lines] == ["1/3", "2/3", "3/3"]
    assert "5/5 responses" in batch_lines[-1] and "elapsed" in batch_lines[-1]


def test_export_uses_sdpa_attention(engine):
    from baton.models.hf_export import to_hf_llama

    assert to_hf_llama(engine.model).config._attn_implementation == "sdpa"


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


def test_the_hf_backend_loads_a_gguf_on_the_cpu_dequantised():
    """`baton train data --backend hf` on the CPU builds its Hugging Face model from the target's tensors, so the
    embedded GGUF loads in fp32 there rather than as its Q4_1 / Q8_0 blocks (the default of --dtype auto)."""
    from baton.config import ServerArgs
    from baton.train.runner import dequantised_gguf

    assert dequantised_gguf(ServerArgs(device="cpu")).dtype == "float32"
    assert dequantised_gguf(ServerArgs(device="cpu", dtype="bfloat16")).dtype == "bfloat16"
    assert dequantised_gguf(ServerArgs(model_path="/some/dir", device="cpu")).dtype == "auto"
