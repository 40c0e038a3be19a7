"""--time-budget: training cuts its step count to what fits (and its learning-rate schedule follows the cut);
data generation stops starting requests / batches once the budget would be overrun."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from baton.train import common, data
from baton.train.common import Sample, TrainOptions, lr_at, replan, train_loop
from baton.train.data import DataOptions, generate_records, generate_records_hf, plan_jobs
from tests.speculative.conftest import make_engine
from tests.train.conftest import PROMPTS


def test_replan_fits_the_budget():
    # 20 steps in 20 s, the last 15 in 15 s: 1 s per step, 30 s left -> 50 steps in all
    assert replan(100, 20, 20.0, 15.0, 50.0) == 50
    assert replan(40, 20, 20.0, 15.0, 50.0) == 40  # never more than planned
    assert replan(100, 20, 60.0, 45.0, 50.0) == 20  # over budget: stop now
    assert replan(100, 3, 9.0, 9.0, 5.0) == 3  # spent before the estimate starts


class _Task:
    """A linear regression: one sample per row, weight 1."""

    def __init__(self) -> None:
        self.module = nn.Linear(4, 1)

    def plan(self, sample, gen):
        return type("P", (), {"weight_sum": 1.0})()

    def loss(self, sample, feats, plan):
        return ((self.module(feats) - 1.0) ** 2).sum(), {}

    def save(self, path):
        pass


def _batches(n: int):
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    return iter([[(Sample([1, 2], 1), x[i])] for i in range(n)])


@pytest.fixture
def fake_clock(monkeypatch):
    """Every optimiser step takes exactly one (fake) second."""
    now = [0.0]
    step = common._train_step

    def timed_step(*a, **kw):
        now[0] += 1.0
        return step(*a, **kw)

    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(common, "_train_step", timed_step)
    return now


def test_train_loop_cuts_steps_to_the_budget(fake_clock, tmp_path):
    opts = TrainOptions(output=str(tmp_path), time_budget=50.0, log_every=0)
    history = train_loop(_Task(), _batches(100), 100, opts, torch.device("cpu"))
    assert len(history.steps) == 50
    # the schedule was replanned for 50 steps: the last step's rate is the cosine's end of a 50-step run
    assert history.steps[-1]["lr"] == pytest.approx(lr_at(49, 50, opts))
    assert history.steps[-1]["lr"] < 0.01 * opts.lr


def test_a_later_faster_estimate_raises_the_count_an_early_one_cut(monkeypatch, tmp_path):
    """Steps 1-20 take 4 s, later ones 0.5 s: at step 20 the estimate cuts the run hard; from step 100 on it is
    raised again (never past the planned 2000), and the run ends near its 300 s budget, not at ~80 s."""
    now, calls = [0.0], [0]
    step = common._train_step

    def timed_step(*a, **kw):
        calls[0] += 1
        now[0] += 4.0 if calls[0] <= 20 else 0.5
        return step(*a, **kw)

    monkeypatch.setattr(common.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(common, "_train_step", timed_step)
    opts = TrainOptions(output=str(tmp_path), time_budget=300.0, log_every=0)
    n = 2000
    x = torch.randn(n, 4, generator=torch.Generator().manual_seed(0))
    history = train_loop(_Task(), iter([[(Sample([1, 2], 1), x[i])] for i in range(n)]), n, opts,
                         torch.device("cpu"))
    steps = len(history.steps)
    assert 20 + (300 - 80) / 0.5 * 0.9 < steps <= n  # about 460 steps fit; the first estimate allowed ~80
    assert now[0] <= 300.0 + 0.5
    assert history.steps[-1]["lr"] < 0.05 * opts.lr  # the schedule still ends at its floor


def test_train_loop_without_budget_runs_every_step(fake_clock, tmp_path):
    opts = TrainOptions(output=str(tmp_path), log_every=0)
    assert len(train_loop(_Task(), _batches(30), 30, opts, torch.device("cpu")).steps) == 30


def test_spent_budget_stops_after_one_step(tmp_path):
    opts = TrainOptions(output=str(tmp_path), time_budget=0.0, log_every=0)
    assert len(train_loop(_Task(), _batches(30), 30, opts, torch.device("cpu")).steps) == 1


@pytest.fixture(scope="module")
def engine(target_path):
    return make_engine(target_path)


def _jobs(engine, tmp_path, prompts_file):
    opts = DataOptions(output=str(tmp_path / "d.jsonl"), temperatures=(0.0,), extra_prompts=prompts_file)
    return plan_jobs(opts, engine.tokenizer)


def test_data_budget(engine, tmp_path, prompts_file):
    jobs = _jobs(engine, tmp_path, prompts_file)
    assert generate_records(engine, jobs, 4, 0, time_budget=0.0) == []
    assert generate_records_hf(engine, jobs, 4, 0, 2, time_budget=0.0) == []
    full = generate_records_hf(engine, jobs, 4, 0, 2)
    assert len(full) == len(PROMPTS)
    assert generate_records_hf(engine, jobs, 4, 0, 2, time_budget=1e9) == full
    assert generate_records(engine, jobs, 4, 0, time_budget=1e9) == generate_records(engine, jobs, 4, 0)


def test_hf_budget_skips_a_batch_that_would_overrun(engine, tmp_path, prompts_file, monkeypatch):
    """A batch of a format is not started when the slowest batch of that format so far would overrun."""
    jobs = _jobs(engine, tmp_path, prompts_file)
    now = [0.0]

    def clock():
        now[0] += 1.0  # every reading one second later: each batch takes a few seconds
        return now[0]

    monkeypatch.setattr(data.time, "perf_counter", clock)
    full = generate_records_hf(engine, jobs, 4, 0, 1)
    now[0] = 0.0
    cut = generate_records_hf(engine, jobs, 4, 0, 1, time_budget=6.0)
    assert 0 < len(cut) < len(full)
    assert cut == full[: len(cut)]
