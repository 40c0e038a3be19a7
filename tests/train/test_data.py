"""`baton train data`: records made by the target, deterministic given the seeds, split by prompt."""

from __future__ import annotations

import json

from baton.cli import main as baton_main
from baton.train.common import read_jsonl, read_samples
from baton.train.data import parse_settings, sample_seed, split_prompts
from baton.types import Request, SamplingParams
from tests.speculative.conftest import make_engine
from tests.train.conftest import PROMPTS


def _run(target_path: str, prompts_file: str, out: str) -> None:
    assert baton_main(["train", "data", "--model-path", target_path, "--device", "cpu", "--extra-prompts",
                       prompts_file, "--num-extra-prompts", "4", "--temperatures", "0,0.8", "--top-p", "0.9",
                       "--samples-per-temperature", "2", "--max-new-tokens", "12", "--holdout-frac", "0.25",
                       "--data-seed", "3", "--output", out]) == 0


def test_data_is_deterministic_and_split_by_prompt(tmp_path, target_path, prompts_file):
    a, b = str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")
    _run(target_path, prompts_file, a)
    _run(target_path, prompts_file, b)
    for suffix in ("", ".holdout"):
        fa, fb = a.replace(".jsonl", f"{suffix}.jsonl"), b.replace(".jsonl", f"{suffix}.jsonl")
        assert open(fa).read() == open(fb).read()
    train, hold = read_jsonl(a), read_jsonl(a.replace(".jsonl", ".holdout.jsonl"))
    assert len(train) + len(hold) == 4 * 3  # 4 prompts x (greedy + 2 samples at T = 0.8)
    assert len(hold) == 3 and {r["prompt_id"] for r in hold}.isdisjoint({r["prompt_id"] for r in train})
    assert all(r["split"] == "train" for r in train) and all(r["split"] == "holdout" for r in hold)
    assert sorted({r["temperature"] for r in train}) == [0.0, 0.8]
    for r in train + hold:  # max_new_tokens, or stopped at the EOS (id 1)
        assert len(r["response_ids"]) == 12 or r["response_ids"][-1] == 1
    assert {tuple(r["prompt_ids"]) for r in train + hold} == {tuple(p) for p in PROMPTS[:4]}
    sampled = [r for r in train if r["temperature"] > 0]
    assert len({r["seed"] for r in sampled}) == len(sampled)  # one seed per response
    summary = json.load(open(a + ".summary.json"))
    assert summary["num_train"] == len(train) and summary["num_holdout"] == len(hold)


def test_responses_are_the_targets_own(tmp_path, target_path, prompts_file):
    out = str(tmp_path / "d.jsonl")
    _run(target_path, prompts_file, out)
    engine = make_engine(target_path)
    for row in read_jsonl(out)[:3]:
        sp = SamplingParams(temperature=row["temperature"], top_p=row["top_p"], max_new_tokens=12, seed=row["seed"])
        got = [t for o in engine.generate(Request(row["prompt_ids"], sp)) for t in o.token_ids]
        assert got == row["response_ids"]
    samples = read_samples(out)
    assert samples[0].ids == read_jsonl(out)[0]["prompt_ids"] + read_jsonl(out)[0]["response_ids"]
    assert samples[0].prompt_len == len(read_jsonl(out)[0]["prompt_ids"])


def test_settings_seeds_and_split_helpers():
    settings = parse_settings([0.0, 0.7, 1.0], 0.9, 3)
    assert [(s.temperature, s.top_p, s.index) for s in settings][:2] == [(0.0, 1.0, 0), (0.7, 0.9, 0)]
    assert len(settings) == 1 + 3 + 3
    assert sample_seed(0, 1, 2) == sample_seed(0, 1, 2) != sample_seed(0, 2, 1)
    assert split_prompts(100, 0.1, 0) == split_prompts(100, 0.1, 0) and len(split_prompts(100, 0.1, 0)) == 10
    assert split_prompts(100, 0.1, 0) != split_prompts(100, 0.1, 1)
    assert split_prompts(5, 0.0, 0) == set() and len(split_prompts(5, 0.01, 0)) == 1


def test_workers_write_the_same_files(tmp_path, target_path, prompts_file):
    one, two = str(tmp_path / "one.jsonl"), str(tmp_path / "two.jsonl")
    common = ["train", "data", "--model-path", target_path, "--device", "cpu", "--extra-prompts", prompts_file,
              "--num-extra-prompts", "3", "--temperatures", "0,1", "--max-new-tokens", "6", "--holdout-frac", "0.34"]
    assert baton_main([*common, "--output", one]) == 0
    assert baton_main([*common, "--output", two, "--num-workers", "2"]) == 0
    for suffix in ("", ".holdout"):
        a, b = (open(p.replace(".jsonl", f"{suffix}.jsonl")).read() for p in (one, two))
        assert a == b
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["one.jsonl", "one.holdout.jsonl", "one.jsonl.summary.json", "two.jsonl", "two.holdout.jsonl",
         "two.jsonl.summary.json"])


def test_data_generation_is_plain_decoding_even_for_the_embedded_model():
    """The embedded model speculates with its shipped drafts by default; `baton train data` must not (the recipe's
    data step refused to run, 2026-11-30), and still refuses an explicit speculative request."""
    from baton.cli import build_parser
    from baton.train.cli import data_server_args

    parser = build_parser()
    ns = parser.parse_args(["train", "data", "--output", "x.jsonl", "--device", "cpu"])
    args = data_server_args(ns)
    assert args is not None and args.is_embedded and not args.spec.enabled
    ns = parser.parse_args(["train", "data", "--output", "x.jsonl", "--speculative-algorithm", "NEXTN"])
    assert data_server_args(ns) is None
    assert baton_main(["train", "data", "--output", "x.jsonl", "--speculative-algorithm", "NEXTN"]) == 2


def test_skip_prompts_starts_later_in_gsm8k(tmp_path):
    """--skip-prompts K --num-prompts N: GSM8K prompts K..K+N-1, keeping their GSM8K ids (so files of two runs merge
    without clashing ids)."""
    from baton.train.data import DataOptions, plan_jobs

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(10)))
    jobs = plan_jobs(DataOptions(output=str(tmp_path / "o.jsonl"), data_path=str(path), skip_prompts=6,
                                 num_prompts=3, prompt_formats=("plain",)), tokenizer=None)
    assert [it.prompt_id for it in jobs.items] == ["gsm8k/6", "gsm8k/7", "gsm8k/8"]
    assert [it.question for it in jobs.items] == ["q6", "q7", "q8"]


def test_holdout_seed_keeps_the_split_across_data_seeds(tmp_path):
    """--holdout-seed fixes the train / held-out split whatever --data-seed is (a second round of data with fresh
    samples holds out the same prompts, so its held-out prompts were not trained on in the first); without it the
    data seed sets both."""
    from baton.train.data import DataOptions, plan_jobs

    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": f"a{i}"}) + "\n" for i in range(200)))

    def split(**kw):
        opts = DataOptions(output=str(tmp_path / "o.jsonl"), data_path=str(path), prompt_formats=("plain",),
                           holdout_frac=0.1, **kw)
        return plan_jobs(opts, tokenizer=None).holdout

    assert split(seed=1, holdout_seed=0) == split(seed=0) == split(seed=7, holdout_seed=0)
    assert split(seed=1) != split(seed=0)
    assert len(split(seed=3, holdout_seed=0)) == 20
