"""baton serve runs warm-up requests before it listens (SGLang's --skip-server-warmup skips them)."""

from __future__ import annotations

import pytest

from baton.config import ServerArgs
from baton.engine.api import warm_up_requests
from baton.server import app as app_module
from tests.server.fake_engine import FakeEngine


def test_warm_up_requests():
    short_only = warm_up_requests(1000, 32768, long_prompt=False)
    assert [r.rid for r in short_only] == ["warmup-short"]
    both = warm_up_requests(1000, 32768, long_prompt=True)
    assert [len(r.input_ids) for r in both] == [16, 8192]
    assert all(0 <= t < 1000 for r in both for t in r.input_ids)
    assert len(warm_up_requests(1000, 600, long_prompt=True)[1].input_ids) == 584  # fits the context
    assert len(warm_up_requests(1000, 30, long_prompt=True)) == 1


@pytest.mark.parametrize("skip", [False, True])
def test_run_server_warms_up_before_it_listens(monkeypatch, skip):
    engine = FakeEngine()
    listened = []
    monkeypatch.setattr(app_module.BatonServer, "run", lambda self: listened.append(engine.warm_ups))
    app_module.run_server(ServerArgs(model_path="fake-model", skip_server_warmup=skip), lambda args: engine)
    assert listened == [0 if skip else 1]  # the warm-up ran before uvicorn started


def test_engine_warm_up_runs_requests_and_forgets_them(ling_path):
    from tests.speculative.conftest import make_engine

    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=2)
    seen = []
    engine.add_observer(lambda t: seen.append(t.rid))
    engine.warm_up()
    assert seen == ["warmup-short"]  # the CPU: no long prompt
    assert engine.spec_stats.num_verify_steps == 0  # flushed: the warm-up leaves no statistics behind
