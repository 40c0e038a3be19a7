"""Engine, TPEngine and the server tests' FakeEngine implement one interface (baton/engine/api.py), each with its
own members (TPEngine forwards nothing implicitly), and the observer hook reports what a request ran."""

from __future__ import annotations

import inspect

import pytest

from baton.engine.api import EngineAPI, RequestTrace
from baton.engine.tp import CallAll, FlushCache, Generate, Stop, TPEngine, _receive
from baton.types import Request, SamplingParams
from tests.server.fake_engine import FakeEngine
from tests.speculative.conftest import make_engine


def _check(engine: object) -> None:
    assert isinstance(engine, EngineAPI)
    for name in EngineAPI.__annotations__:
        assert hasattr(engine, name), name
    for name, fn in inspect.getmembers(EngineAPI, inspect.isfunction):
        if not name.startswith("_"):
            want = list(inspect.signature(fn).parameters)
            got = list(inspect.signature(getattr(engine, name)).parameters)
            assert got == want[1:], (type(engine).__name__, name, got)


def test_fake_engine_implements_the_api():
    _check(FakeEngine())


@pytest.fixture(scope="module")
def engine(ling_path):
    return make_engine(ling_path)


def test_engine_and_tp_engine_implement_the_api(engine):
    _check(engine)
    _check(TPEngine(engine))
    assert "__getattr__" not in vars(TPEngine)  # every member is TPEngine's own


def test_observer_sees_the_request(engine):
    traces: list[RequestTrace] = []
    engine.add_observer(traces.append)
    prompt = [5, 6, 7, 8]
    out = [t for o in engine.generate(Request(prompt, SamplingParams(max_new_tokens=6), rid="r1")) for t in o.token_ids]
    (trace,) = traces
    assert trace.rid == "r1" and trace.sequence[: len(prompt)] == prompt
    assert trace.sequence[len(prompt) : len(prompt) + len(out)] == out
    assert len(prompt) + len(out) - 1 <= trace.committed <= len(trace.sequence)


def test_followers_refuse_what_is_not_a_rank_message(monkeypatch):
    from baton import dist

    for msg in (Generate(Request([1], SamplingParams())), FlushCache(), CallAll(len, ()), Stop()):
        monkeypatch.setattr(dist, "broadcast_object", lambda _obj, m=msg: m)
        assert _receive() == msg
    monkeypatch.setattr(dist, "broadcast_object", lambda _obj: ("generate", None))
    with pytest.raises(TypeError, match="RankMessage"):
        _receive()
