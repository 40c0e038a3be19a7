"""Adaptive draft depth (baton/speculative/adaptive.py): the policy itself, and the invariant that greedy output
does not depend on the depth, for every drafter, with depth changes in the middle of a request (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from baton.speculative.adaptive import AdaptiveDepth, FixedDepth, ScheduledDepth, default_depths
from tests.speculative.conftest import make_engine
from tests.speculative.test_dspark import _draft_for, _memorise_bigrams
from tests.speculative.test_spec_core import PROMPT, run

# ---- the policy ----

TIMES = {0: 10.0, 1: 11.0, 2: 12.0, 4: 14.0, 8: 18.0}  # ms: a verify row costs 10% of a step


def _policy(**kw) -> AdaptiveDepth:
    return AdaptiveDepth(sorted(TIMES), TIMES, **kw)


def _feed(policy: AdaptiveDepth, accept, steps: int) -> list[int]:
    """Run ``steps`` steps, each accepting ``accept(depth)`` drafts; the depths chosen, in order."""
    chosen = []
    for _ in range(steps):
        d = policy.choose()
        chosen.append(d)
        policy.observe(d, accept(d))
    return chosen


def test_default_depths():
    assert default_depths(1) == (0, 1)
    assert default_depths(5) == (0, 1, 2, 4, 5)
    assert default_depths(8) == (0, 1, 2, 4, 8)
    assert default_depths(15) == (0, 1, 2, 4, 8, 15)


def test_expected_tokens_and_best_depth():
    p = _policy(prior=1.0)
    assert p.expected_tokens(0) == 1.0 and p.expected_tokens(4) == 5.0
    assert p.best() == 8  # every draft accepted: 9 tokens in 18 ms beats 1 in 10
    p = _policy(prior=0.0)
    assert p.best() == 0  # nothing accepted: plain decoding
    p = _policy(prior=0.5)  # E(d) = 2 - 0.5^d: 1, 1.5, 1.75, 1.94, 2.0 tokens in 10, 11, 12, 14, 18 ms
    assert [round(p.expected_tokens(d), 4) for d in sorted(TIMES)] == [1.0, 1.5, 1.75, 1.9375, 1.9961]
    assert p.best() == 2  # 0.1458 tokens / ms, the most


def test_drops_depth_on_rejections_and_regains_it_on_acceptances():
    p = _policy(prior=0.9)
    p.begin_request()
    assert p.choose() == 8
    chosen = _feed(p, lambda d: 0, 60)  # every draft rejected
    assert chosen[-1] == 0 and chosen[:3].count(8) >= 1  # starts deep, ends at plain decoding
    tail = chosen[20:]
    assert 0 < tail.count(8) <= len(tail) // 6  # it still probes, rarely (the interval backs off)
    chosen = _feed(p, lambda d: d, 80)  # now every draft is accepted
    assert chosen[-10:] == [8] * 10  # a probe saw it and the depth came back


def test_probe_interval_backs_off_and_resets():
    p = _policy(prior=0.0, probe_interval=4, max_probe_interval=16, probe_budget=None)
    p.begin_request()
    chosen = _feed(p, lambda d: 0, 100)
    probes = [i for i, d in enumerate(chosen) if d == 8]
    gaps = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert gaps == sorted(gaps) and gaps[-1] == 17  # 4, 8, 16 steps below the full depth between probes, then 16
    assert p.interval == 16


def test_a_request_starts_at_half_the_last_probe_interval():
    """After a request whose probes all failed, the next one probes sooner than the last back-off (half its
    interval), not at the base interval again; one whose probe paid starts at the base."""
    p = _policy(prior=0.0, probe_interval=4, max_probe_interval=32, probe_budget=None)
    p.begin_request()
    _feed(p, lambda d: 0, 200)
    assert p.interval == 32
    p.begin_request()
    assert p.interval == 16
    chosen = _feed(p, lambda d: 0, 17)
    assert chosen.index(8) == 16  # the first probe after 16 plain steps
    assert p.interval == 32  # that probe failed: backed off again
    p.begin_request()
    assert p.interval == 16
    _feed(p, lambda d: d, 40)  # a probe pays: speculation back, the interval reset
    p.begin_request()
    assert p.interval == 4


def test_probe_intervals_follow_the_step_times():
    """A failed probe costs t(max) / t(0) - 1 plain steps: the base interval keeps failed probes to ~3% of the
    decode time, and over a long run of rejections the probes' extra time stays near that."""
    p = _policy(prior=0.9)
    assert p.base_interval == 27 and p.max_interval == 108  # 0.8 steps lost a probe, 3% budget
    p.begin_request()
    chosen = _feed(p, lambda d: 0, 600)
    tail = chosen[30:]
    extra = sum(TIMES[d] - TIMES[0] for d in tail) / (len(tail) * TIMES[0])
    assert 0 < tail.count(8) and extra <= 0.03
    gpu = AdaptiveDepth([0, 1, 2, 4, 8], {0: 0.558, 1: 1.02, 2: 1.03, 4: 1.04, 8: 1.12})  # H100, DSpark gamma 8
    assert gpu.probing and gpu.base_interval == 34


def test_no_probes_where_speculation_cannot_pay():
    """Step times under which even every draft accepted gains < 5% (a 2-core CPU with NEXTN: depth 3 costs 5x a
    plain step): the policy settles on plain decoding and never probes; with cheap verifies it does probe."""
    cpu = {0: 4.96, 1: 9.65, 2: 14.26, 3: 25.15}
    p = AdaptiveDepth(sorted(cpu), cpu)
    assert not p.probing
    p.begin_request()
    chosen = _feed(p, lambda d: 0, 400)
    first0 = chosen.index(0)
    assert set(chosen[first0:]) == {0}
    p.begin_request()
    assert _feed(p, lambda d: d, 200) == [0] * 200  # nothing tells it otherwise: it never pays for a draft
    assert _policy().probing


def test_a_request_starts_from_what_earlier_requests_saw():
    p = _policy(prior=0.9)
    p.begin_request()
    _feed(p, lambda d: 0, 40)
    p.begin_request()
    assert p.choose() == 0  # the next request does not start by paying for deep drafts again


def test_online_step_times():
    p = _policy(prior=0.5, online_times=True, time_decay=0.5)
    p.observe_time(8, 30.0)
    assert p.step_ms[8] == 24.0
    q = _policy(prior=0.5)  # off: the start-up table stays
    q.observe_time(8, 30.0)
    assert q.step_ms[8] == 18.0


def test_bad_tables_are_refused():
    with pytest.raises(ValueError, match="step times"):
        AdaptiveDepth([0, 1, 2], {0: 1.0, 2: 1.0})
    with pytest.raises(ValueError, match="step times"):
        AdaptiveDepth([0, 1], {0: 1.0, 1: 0.0})


def test_fixed_depth():
    f = FixedDepth(5)
    f.begin_request()
    assert f.choose() == 5


def test_replay_of_a_recorded_request():
    """``replay`` (benchmarks/bench_adaptive_policy.py): the full depth reproduces the recording's steps; a shallower
    depth accepts min(a(n), d) where a(n) is what the recording accepted from position n (the rest of an accepted
    run inside it); the policy sees each step one step late, as in the engine."""
    from baton.speculative.adaptive import replay

    accepted = [3, 0, 1, 2, 3, 0]  # positions 0, 4, 5, 7, 10, 14; 15 tokens after the first
    tokens = 1 + sum(a + 1 for a in accepted)
    ms = {0: 1.0, 1: 2.0, 3: 4.0}
    assert replay(FixedDepth(3), accepted, tokens, ms) == (6, 24.0)
    # depth 1: positions 0 (a 3 -> 1), 2 (a 1), 4 (0), 5 (1), 7 (1), 9 (a(9) = 2 - 2 = 0), 10 (1), 12 (1), 14 (0)
    assert replay(FixedDepth(1), accepted, tokens, ms) == (9, 18.0)
    seen = []

    class Spy(ScheduledDepth):
        def observe(self, depth, accepted):
            seen.append((self.i, depth, accepted))  # self.i: the depths chosen so far

    replay(Spy([3, 0, 1]), accepted, tokens, ms)
    assert seen[:3] == [(2, 3, 3), (3, 0, 0), (4, 1, 1)]  # step k's outcome arrives after step k+1's depth


def test_adaptive_depth_follows_real_acceptance_in_replay():
    """Bursty acceptance (stretches of near-full acceptance between stretches of almost none, as the shipped drafts
    give on the held-out domains, seeded): at step times where a full-depth step costs twice a plain one the
    adaptive policy keeps most of what the best fixed depth gets (0.92x of it at 6acf2e2; its probes come every
    ~34 steps after a drop, so part of each good stretch is missed) and far more than plain; on acceptance that
    never pays it stays within 2% of plain, and on a 2-core CPU's step times, where speculation cannot pay, too."""
    import random

    from baton.speculative.adaptive import replay

    rng = random.Random(0)
    reqs = []
    for _ in range(12):
        acc, hi = [], False
        while sum(a + 1 for a in acc) < 127:
            hi = (not hi) if rng.random() < 0.05 else hi
            a = 0
            while a < 8 and rng.random() < (0.95 if hi else 0.1):
                a += 1
            acc.append(a)
        reqs.append((acc, 1 + sum(a + 1 for a in acc)))

    def speed(policy, ms):
        return sum(t - 1 for _, t in reqs) * ms[0] / sum(replay(policy, a, t, ms)[1] for a, t in reqs)

    gpu = {0: 0.5, 1: 0.8, 2: 0.85, 4: 0.9, 8: 1.0}
    fixed = max(speed(FixedDepth(d), gpu) for d in (1, 2, 4, 8))
    adaptive = speed(AdaptiveDepth(sorted(gpu), gpu), gpu)
    assert fixed > 1.5 and adaptive > 0.88 * fixed
    cpu = {0: 5.0, 1: 11.0, 2: 15.0, 4: 19.0, 8: 33.0}  # a 2-core CPU's DSpark step times: nothing pays
    assert speed(AdaptiveDepth(sorted(cpu), cpu), cpu) > 0.98
    reqs[:] = [([0] * 127, 128)] * 4  # nothing is ever accepted
    assert speed(AdaptiveDepth(sorted(gpu), gpu), gpu) > 0.98


# ---- greedy output does not depend on the depth ----

SCHEDULE = [4, 0, 1, 2, 4, 0, 0, 2, 1, 4, 4, 0]  # depth changes at every step, and runs of one depth


def _scheduled(engine, schedule=SCHEDULE) -> None:
    depths = set(engine.program.depths)
    engine.set_depth_policy(ScheduledDepth([d if d in depths else max(depths) for d in schedule]))


def _drafts(tmp_path, target: str, plain_tokens: list[int], **kw) -> str:
    draft = _draft_for(tmp_path, target, **kw)
    _memorise_bigrams(draft, PROMPT + plain_tokens)
    return draft


@pytest.mark.parametrize("target", ["ling", "llama"])
def test_nextn_with_depth_changes_equals_plain(plain, ling_path, llama_path, llama_nextn_path, target):
    path = ling_path if target == "ling" else llama_path
    extra = {} if target == "ling" else {"draft_model_path": llama_nextn_path}
    engine = make_engine(path, algorithm="NEXTN", num_steps=4, adaptive=True, **extra)
    assert engine.program.depths == (0, 1, 2, 4)
    _scheduled(engine)
    tokens, verify = run(engine)
    assert tokens == plain[target]
    assert verify > 0


@pytest.mark.parametrize("algorithm", ["DSPARK", "DFLASH"])
@pytest.mark.parametrize("target", ["ling", "llama"])
def test_block_drafts_with_depth_changes_equal_plain(tmp_path, plain, ling_path, llama_path, algorithm, target):
    path = ling_path if target == "ling" else llama_path
    draft = _drafts(tmp_path, path, plain[target], block_size=4, markov_rank=64)
    engine = make_engine(path, algorithm=algorithm, draft_model_path=draft, num_draft_tokens=5, adaptive=True)
    _scheduled(engine)
    tokens, _ = run(engine)
    assert tokens == plain[target]
    if algorithm == "DSPARK":
        assert engine.spec_stats.accept_histogram.keys() - {0}, "some drafts were accepted"


def test_dspark_prefix_rule_with_depth_changes_equals_plain(tmp_path, plain, ling_path):
    draft = _drafts(tmp_path, ling_path, plain["ling"], block_size=6, markov_rank=64)
    sps = tmp_path / "sps.json"
    sps.write_text(json.dumps({"verify_tokens": list(range(1, 8)), "step_time_ms": [10 * 1.05**i for i in range(7)]}))
    engine = make_engine(ling_path, algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=7,
                         dspark_sps_table_path=str(sps), adaptive=True)
    assert engine.program.depths == (0, 1, 2, 4, 6)
    _scheduled(engine, [6, 2, 0, 4, 6, 1])
    tokens, _ = run(engine)
    assert tokens == plain["ling"]


def test_the_adaptive_engine_equals_plain_and_follows_acceptance(tmp_path, plain, ling_path):
    """The engine's own policy (start-up step times, online updates) on a good draft and on a useless one: the
    output is plain decoding's either way; the useless draft ends at depth 0 (plain steps), the good one does not."""
    good = _drafts(tmp_path, ling_path, plain["ling"], block_size=4, markov_rank=64)
    engine = make_engine(ling_path, algorithm="DSPARK", draft_model_path=good, num_draft_tokens=5, adaptive=True)
    assert isinstance(engine.depth_policy, AdaptiveDepth)
    # the step times of a real deployment (a verify row costs little next to a step), so the test's decisions
    # do not hang on this machine's timings
    engine.set_depth_policy(AdaptiveDepth(engine.program.depths, {0: 10.0, 1: 10.5, 2: 11.0, 4: 12.0}))
    tokens, _ = run(engine, max_new_tokens=40)
    assert tokens == plain["ling"]
    assert engine.depth_policy.choice > 0

    useless = _draft_for(tmp_path, ling_path, name="useless", block_size=4, markov_rank=64)  # random drafts
    engine = make_engine(ling_path, algorithm="DSPARK", draft_model_path=useless, num_draft_tokens=5,
                         adaptive=True)
    engine.set_depth_policy(AdaptiveDepth(engine.program.depths, {0: 10.0, 1: 12.0, 2: 14.0, 4: 18.0}))
    tokens, _ = run(engine, max_new_tokens=40)
    assert tokens == plain["ling"]
    assert engine.depth_policy.choice == 0


def test_adaptive_off_and_simulated_acceptance_keep_the_full_depth(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=3, adaptive=False)
    assert isinstance(engine.depth_policy, FixedDepth) and engine.program.depths == (3,)
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=3, simulate_accept_len=2.5, adaptive=True)
    assert isinstance(engine.depth_policy, FixedDepth) and engine.program.depths == (3,)


def test_one_good_probe_is_enough_to_speculate_again():
    """After a run of rejections (depth 0), a probe whose drafts are all accepted brings speculation back at once:
    a probe is the only news about the deep positions, so it weighs more than a regular step."""
    p = _policy(prior=0.3, probe_interval=4)
    p.begin_request()
    _feed(p, lambda d: 0, 30)
    assert p.choice == 0
    d = p.choose()
    while d != 8:  # wait for the probe
        p.observe(d, 0)
        d = p.choose()
    p.observe(8, 8)
    assert p.choice >= 4  # (weighed like a regular step, the probe would bring back depth 1 only)


# ---- depth 0 is the plain decode step; the drafter catches up over the positions it skipped ----

# runs of depth 0 longer than the history ring (HISTORY = 32: a flush when it fills), short ones, and depths that
# draft right after them
LONG = [4] + [0] * 40 + [4, 2] + [0] * 3 + [1] + [0] * 70 + [4, 0, 4]
LONG_TOKENS = 150


def _long_case(tmp_path, case: str, ling_path, llama_path, llama_nextn_path) -> tuple[str, dict]:
    algorithm, target = case.split("-")
    path = ling_path if target == "ling" else llama_path
    if algorithm == "nextn":
        extra = {} if target == "ling" else {"draft_model_path": llama_nextn_path}
        return path, {"algorithm": "NEXTN", "num_steps": 4, **extra}
    draft = _draft_for(tmp_path, path, block_size=4, markov_rank=64)
    return path, {"algorithm": algorithm.upper(), "draft_model_path": draft, "num_draft_tokens": 5}


def _drafter_rows(engine, upto: int) -> list:
    return [t[:upto].clone() for t, _ in engine.drafter.prefix_buffers()]


@pytest.mark.parametrize("case", ["nextn-ling", "nextn-llama", "dspark-ling", "dflash-llama"])
def test_long_plain_runs_equal_plain_and_leave_the_drafter_whole(tmp_path, ling_path, llama_path, llama_nextn_path,
                                                                  case):
    """Depth-0 steps of a drafter that defers its extends are the plain decode body; greedy output over long runs of
    them (past the history ring) equals plain decoding, and after the catch-ups the drafter's context rows equal
    those of a run that drafted (and extended) at every step."""
    from baton.engine.relay import HISTORY

    path, spec = _long_case(tmp_path, case, ling_path, llama_path, llama_nextn_path)
    reference, _ = run(make_engine(path), max_new_tokens=LONG_TOKENS)
    deferred = make_engine(path, adaptive=True, **spec)
    program = deferred.program
    assert program.defers and program._replays[0] == [program._decode]  # depth 0: the plain step, nothing else
    _scheduled(deferred, LONG)
    flushed = []
    flush = program.flush
    program.flush = lambda: (flushed.append(program.gap), flush())
    tokens, _ = run(deferred, max_new_tokens=LONG_TOKENS)
    assert tokens == reference
    assert flushed.count(HISTORY) >= 3 and set(flushed) - {HISTORY}, flushed  # full rings, and shorter gaps

    full = make_engine(path, adaptive=True, **spec)
    _scheduled(full, [4])
    tokens, _ = run(full, max_new_tokens=LONG_TOKENS)
    assert tokens == reference
    program.flush()  # the tail's deferred positions
    upto = min(int(program.relay.pos), int(full.program.relay.pos)) - 1
    for a, b in zip(_drafter_rows(deferred, upto), _drafter_rows(full, upto), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def test_a_drafter_that_cannot_defer_verifies_at_depth_0(monkeypatch, plain, ling_path):
    """Without deferred inputs (a drafter whose rows are not a function of their own inputs), a depth-0 step
    verifies the anchor alone and extends at once, as before."""
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=4, adaptive=True)
    monkeypatch.setattr(type(engine.drafter), "deferred_inputs", ())
    engine.set_drafter(engine.drafter)
    assert not engine.program.defers and len(engine.program._replays[0]) == 2  # verify, extend
    _scheduled(engine)
    assert run(engine)[0] == plain["ling"]
