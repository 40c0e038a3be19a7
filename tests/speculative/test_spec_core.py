"""The speculative-decoding invariants on CPU in fp32: greedy speculative output equals plain decoding,
committed KDA states equal those of plain decoding, a sampled request leaves no trace, flag errors."""

from __future__ import annotations

import pytest
import torch

from baton.config import ConfigError, SpecConfig
from baton.layers.context import ModelRunner
from baton.speculative.base import Drafter
from baton.types import ForwardMode, Request, SamplingParams
from tests.speculative.conftest import make_engine

PROMPT = [5, 17, 3, 42, 8, 23, 11, 60, 2 + 7, 31, 4, 19]


def run(engine, prompt=PROMPT, max_new_tokens=40, **sp) -> tuple[list[int], int]:
    params = SamplingParams(temperature=sp.pop("temperature", 0.0), max_new_tokens=max_new_tokens,
                            ignore_eos=True, **sp)
    tokens, verify = [], 0
    for out in engine.generate(Request(list(prompt), params)):
        tokens.extend(out.token_ids)
        verify = out.num_verify_steps
    return tokens, verify


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_nextn_greedy_equals_plain_ling(plain, ling_path, steps):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=steps)
    tokens, verify = run(engine)
    assert tokens == plain["ling"]
    assert verify > 0 and len(tokens) / verify >= 1.0


@pytest.mark.parametrize("steps", [1, 3, 5])
def test_nextn_greedy_equals_plain_llama(plain, llama_path, llama_nextn_path, steps):
    engine = make_engine(llama_path, algorithm="EAGLE", num_steps=steps, draft_model_path=llama_nextn_path)
    tokens, _ = run(engine)
    assert tokens == plain["llama"]


class OracleDrafter(Drafter):
    """Proposes the target's own greedy continuation: every draft is accepted (the maximum). It reads ``pos`` on
    the host, so it runs uncaptured only (the CPU); it stands in for ``like`` (its tapped layers, its features)."""

    def __init__(self, sequence: list[int], k: int, like: Drafter) -> None:
        self.sequence, self.num_draft_tokens = sequence, k + 1
        self.k = k
        self.like = like
        self.capture_layer_ids, self.feature_dim = like.capture_layer_ids, like.feature_dim

    def reset(self) -> None:
        pass

    def begin(self, *args) -> None:
        pass

    def draft(self, relay, arange) -> None:
        pos = int(relay.pos)
        nxt = self.sequence[pos + 1 : pos + 1 + self.k]
        relay.draft_tokens.copy_(torch.tensor(nxt + [0] * (self.k - len(nxt))))

    def extend(self, relay, arange) -> None:
        pass

    def features(self, captured):
        return self.like.features(captured)


@pytest.mark.parametrize("target", ["ling", "llama"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_oracle_draft_accepts_everything(plain, ling_path, llama_path, llama_nextn_path, target, k):
    path = ling_path if target == "ling" else llama_path
    extra = {} if target == "ling" else {"draft_model_path": llama_nextn_path}
    engine = make_engine(path, algorithm="NEXTN", num_steps=k, **extra)
    engine.set_drafter(OracleDrafter(PROMPT + plain[target], k, engine.drafter))
    tokens, verify = run(engine)
    assert tokens == plain[target]
    assert engine.spec_stats.accept_histogram.get(k, 0) == verify - 1 or verify * (k + 1) >= len(tokens)
    assert verify == -(-(len(tokens) - 1) // (k + 1))  # every step commits k + 1 tokens


def _plain_decode_states(engine, sequence: list[int], prompt_len: int):
    """KDA states after plain decoding of ``sequence``: prefill the prompt, then one token at a time."""
    model = engine.model
    runner = ModelRunner(model.make_cache(len(sequence) + 4, torch.float32, "cpu"), torch.device("cpu"))
    with torch.inference_mode():
        model(torch.tensor(sequence[:prompt_len]), runner.context(ForwardMode.PREFILL, 0, prompt_len))
        for t in range(prompt_len, len(sequence)):
            model(torch.tensor(sequence[t : t + 1]), runner.context(ForwardMode.DECODE, t, 1))
    return runner.cache.kda_states()


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).norm() / want.norm()).item()


@pytest.mark.parametrize("steps", [2, 5])
def test_committed_kda_state_equals_plain(ling_path, steps):
    """After a speculative run the committed recurrent and conv states equal plain decoding's, to 1e-5
    (relative, Frobenius): fp32 GEMMs over T verify rows round differently from T single-row ones."""
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=steps)
    traces = []
    engine.add_observer(traces.append)
    run(engine, max_new_tokens=37)
    (trace,) = traces
    committed = trace.sequence[: trace.committed]
    reference = _plain_decode_states(engine, committed, len(PROMPT))
    for got, want in zip(engine.runner.cache.kda_states(), reference, strict=True):
        assert _rel_err(got.recurrent, want.recurrent) < 1e-5
        assert _rel_err(got.conv, want.conv) < 1e-5


def test_sampled_request_leaves_no_trace(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=3)
    first, _ = run(engine)
    sampled, _ = run(engine, temperature=1.0, seed=7)
    assert sampled != first
    again, _ = run(engine)
    assert again == first


def test_seeded_sampling_reproducible(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=3)
    a, _ = run(engine, temperature=0.8, top_p=0.9, seed=123)
    b, _ = run(engine, temperature=0.8, top_p=0.9, seed=123)
    assert a == b


def test_simulated_accept_length(ling_path):
    engine = make_engine(ling_path, algorithm="NEXTN", num_steps=5, simulate_accept_len=3.25)
    tokens, verify = run(engine, max_new_tokens=400)
    assert abs(engine.spec_stats.avg_accept_length - 3.25) < 0.15
    outs = list(engine.generate(Request(PROMPT, SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True))))
    assert all(o.simulated for o in outs)


def test_flag_errors(llama_path, tmp_path):
    with pytest.raises(ConfigError, match="topk"):
        SpecConfig(algorithm="NEXTN", num_steps=3, eagle_topk=4)
    with pytest.raises(ConfigError, match="steps \\+ 1"):
        SpecConfig(algorithm="NEXTN", num_steps=3, num_draft_tokens=5)
    with pytest.raises(ConfigError, match="MTP layer|draft-model-path"):
        make_engine(llama_path, algorithm="NEXTN", num_steps=2)


def test_draft_for_other_vocab_is_refused(ckpt_root, llama_path):
    from baton.cli import main as baton_main
    from tests.conftest import TINY_LLAMA
    from tests.speculative.conftest import write_checkpoint

    other = write_checkpoint(ckpt_root, "llama_other_vocab", {**TINY_LLAMA, "vocab_size": 77})
    out = str(ckpt_root / "other_nextn")
    assert baton_main(["convert", "random-draft", "--target", other, "--output", out]) == 0
    with pytest.raises(ConfigError, match="vocabulary"):
        make_engine(llama_path, algorithm="NEXTN", num_steps=2, draft_model_path=out)


@pytest.fixture(scope="module")
def random_dspark(ckpt_root, ling_path, llama_path):
    from baton.config import load_model_config
    from baton.models.dspark_checkpoint import write_random_dspark_draft

    out = {}
    for name, path in (("ling", ling_path), ("llama", llama_path)):
        out[name] = str(ckpt_root / f"random_dspark_{name}")
        write_random_dspark_draft(load_model_config(path), out[name], seed=11, block_size=8, markov_rank=16)
    return out


@pytest.mark.parametrize("target", ["ling", "llama"])
@pytest.mark.parametrize("gamma", [4, 8])
@pytest.mark.parametrize("algorithm", ["DSPARK", "DFLASH"])
def test_random_block_draft_greedy_equals_plain(plain, ling_path, llama_path, random_dspark, target, gamma,
                                                algorithm):
    path = ling_path if target == "ling" else llama_path
    engine = make_engine(path, algorithm=algorithm, draft_model_path=random_dspark[target],
                         num_draft_tokens=gamma + 1)
    tokens, verify = run(engine)
    assert tokens == plain[target]
    assert verify > 0


@pytest.mark.parametrize("gamma", [4, 8])
def test_oracle_block_draft_accepts_everything(plain, ling_path, random_dspark, gamma):
    engine = make_engine(ling_path, algorithm="DSPARK", draft_model_path=random_dspark["ling"],
                         num_draft_tokens=gamma + 1)
    engine.set_drafter(OracleDrafter(PROMPT + plain["ling"], gamma, engine.drafter))
    tokens, verify = run(engine)
    assert tokens == plain["ling"]
    assert verify == -(-(len(tokens) - 1) // (gamma + 1))
