"""DSpark / DFlash drafters: checkpoint IO in both namings, the Markov chain, confidence + STS, the batch-1
prefix rule, and the greedy invariant end to end on tiny Llama and Ling targets (fp32, CPU)."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from baton.config import ConfigError, ServerArgs, SpecConfig, load_model_config, parse_model_config
from baton.engine.engine import Engine
from baton.models.checkpoint import CheckpointError, hf_layout
from baton.models.dspark import DSparkDraftModel, MarkovHead
from baton.models.dspark_checkpoint import (
    build_target_layer_ids,
    load_dspark_weights,
    parse_dspark_config,
    read_dspark_config,
    write_random_dspark_draft,
)
from baton.speculative.dspark import (
    SpsTable,
    load_sts_temperatures,
    markov_propose,
    prefix_len,
    prefix_len_device,
    resolve_dspark_spec,
    survival,
)
from baton.types import Request, SamplingParams
from tests.conftest import TINY_LING, TINY_LLAMA

ARCHS = {"llama": TINY_LLAMA, "ling": TINY_LING}


@pytest.fixture(scope="module")
def targets(llama_path, ling_path) -> dict[str, str]:
    """Random HF checkpoint directories of the tiny architectures (tests/speculative/conftest.py)."""
    return {"llama": llama_path, "ling": ling_path}


def _engine(model_path: str, spec: SpecConfig | None = None) -> Engine:
    # the full depth: these tests check acceptance statistics (depth changes: tests/speculative/test_adaptive.py)
    spec = dataclasses.replace(spec, adaptive=False) if spec is not None else SpecConfig()
    return Engine(ServerArgs(model_path=model_path, device="cpu", context_length=256, spec=spec))


def _generate(engine: Engine, prompt: list[int], temperature: float = 0.0, seed: int | None = None) -> list[int]:
    sp = SamplingParams(temperature=temperature, max_new_tokens=40, ignore_eos=True, seed=seed)
    return [t for step in engine.generate(Request(prompt, sp)) for t in step.token_ids]


PROMPT = [5, 17, 42, 8, 3, 60, 11, 29, 33]


# ---- checkpoint config and IO ----


def test_round_trip_dspark_names(tmp_path):
    target_cfg = parse_model_config(TINY_LLAMA)
    path = str(tmp_path / "draft")
    model = write_random_dspark_draft(target_cfg, path, seed=3, block_size=6, num_layers=2, markov_rank=16)
    with open(os.path.join(path, "config.json")) as f:
        data = json.load(f)
    assert data["model_type"] == "baton_dspark"
    assert data["dspark_block_size"] == 6 and data["dspark_markov_rank"] == 16
    assert data["dspark_noise_token_id"] == TINY_LLAMA["vocab_size"] - 1
    assert data["dspark_target_layer_ids"] == build_target_layer_ids(3, 2) == [1, 0]
    tensors = load_file(os.path.join(path, "model.safetensors"))
    h, r, v = TINY_LLAMA["hidden_size"], 16, TINY_LLAMA["vocab_size"]
    assert tensors["fc.weight"].shape == (h, 2 * h)
    assert tensors["markov_head.w1.weight"].shape == (v, r) and tensors["markov_head.w2.weight"].shape == (v, r)
    assert tensors["confidence_head.weight"].shape == (1, h + r) and tensors["confidence_head.bias"].shape == (1,)
    for name in ("hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
                 "layers.1.self_attn.k_norm.weight", "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight",
                 "layers.0.input_layernorm.weight", "layers.0.self_attn.o_proj.weight"):
        assert name in tensors, name
    cfg = read_dspark_config(path)
    assert cfg == model.config
    loaded = DSparkDraftModel(cfg, with_heads=True)
    load_dspark_weights(loaded, path, ignore_heads=False)
    params = dict(loaded.named_parameters())
    layout = hf_layout(loaded, [])
    assert set(layout) == set(tensors)
    for name, slot in layout.items():
        assert torch.equal(slot.view(params), tensors[name]), name


def test_dflash_naming_parses_to_the_same_config(tmp_path):
    target_cfg = parse_model_config(TINY_LING)
    path = str(tmp_path / "draft")
    write_random_dspark_draft(target_cfg, path, block_size=5, num_layers=2, with_heads=False, mask_token_id=7)
    with open(os.path.join(path, "config.json")) as f:
        ours = json.load(f)
    theirs = {k: v for k, v in ours.items() if not k.startswith("dspark_")}
    theirs.update(model_type="qwen3", architectures=["DFlashDraftModel"], block_size=5,
                  dflash_config={"target_layer_ids": ours["dspark_target_layer_ids"], "mask_token_id": 7})
    assert parse_dspark_config(theirs, "dflash") == parse_dspark_config(ours, "ours")
    cfg = parse_dspark_config(theirs, "dflash")
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids, cfg.markov_rank) == (5, 7, [1, 3], 0)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(theirs, f)
    model = DSparkDraftModel(read_dspark_config(path), with_heads=False)
    load_dspark_weights(model, path, ignore_heads=True)


def test_config_missing_fields_named():
    with pytest.raises(ConfigError, match="dspark_block_size"):
        parse_dspark_config({"vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                             "intermediate_size": 16, "dspark_noise_token_id": 9}, "cfg")


def test_bad_tensor_fails_with_name_and_shapes(tmp_path):
    path = str(tmp_path / "draft")
    write_random_dspark_draft(parse_model_config(TINY_LLAMA), path)
    fn = os.path.join(path, "model.safetensors")
    tensors = load_file(fn)
    tensors["markov_head.w2.weight"] = torch.zeros(3, 3)
    save_file(tensors, fn)
    model = DSparkDraftModel(read_dspark_config(path), with_heads=True)
    with pytest.raises(CheckpointError, match=r"markov_head\.w2\.weight: expected shape \(101, 32\), found \(3, 3\)"):
        load_dspark_weights(model, path, ignore_heads=False)


# ---- Markov head, confidence, prefix rule ----


def _markov(v: int = 23, r: int = 5) -> MarkovHead:
    head = MarkovHead(v, r)
    torch.nn.init.normal_(head.w1.weight, std=2.0)
    torch.nn.init.normal_(head.w2.weight, std=2.0)
    return head


def test_markov_logits_chain_left_to_right_greedy():
    head, gamma = _markov(), 6
    base = torch.randn(gamma, 23)
    anchor = torch.tensor([4])
    with torch.no_grad():
        prop = markov_propose(base, anchor, head, SamplingParams(temperature=0.0), None)
        assert prop.probs is None
        prev = 4
        for k in range(gamma):
            expect = base[k] + head.w2(head.w1(torch.tensor(prev)))
            torch.testing.assert_close(prop.logits[k], expect)
            assert int(prop.tokens[k]) == int(expect.argmax())
            torch.testing.assert_close(prop.prev_emb[k], head.w1.weight[prev])
            prev = int(prop.tokens[k])
    # the bias really changes the chain: the plain argmax of U differs somewhere
    assert not torch.equal(prop.tokens, base.argmax(-1))


def test_markov_sampled_keeps_probs_of_the_chain():
    head, gamma, temp = _markov(), 5, 0.7
    base = torch.randn(gamma, 23)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        prop = markov_propose(base, torch.tensor([2]), head, SamplingParams(temperature=temp), gen)
        prevs = [2] + prop.tokens[:-1].tolist()
        for k, prev in enumerate(prevs):
            logits = base[k] + head.w2(head.w1(torch.tensor(prev)))
            torch.testing.assert_close(prop.probs[k], torch.softmax(logits / temp, -1))
            assert prop.probs[k, prop.tokens[k]] > 0


def test_confidence_survival_with_sts(tmp_path):
    z = torch.tensor([2.0, -1.0, 0.5, 3.0])
    temps = torch.tensor([1.0, 2.0, 0.5, 4.0])
    a = survival(z, temps)
    c = [1 / (1 + torch.exp(-z[i] / temps[i])) for i in range(4)]
    expect = torch.tensor([c[0], c[0] * c[1], c[0] * c[1] * c[2], c[0] * c[1] * c[2] * c[3]])
    torch.testing.assert_close(a, expect)
    torch.testing.assert_close(survival(z, None), torch.sigmoid(z).cumprod(0))
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [1.0, 2.0, 0.5, 4.0], "ece_before": 0.05}))
    torch.testing.assert_close(load_sts_temperatures(str(sts), 4), temps)
    with pytest.raises(ConfigError, match="gamma = 5"):
        load_sts_temperatures(str(sts), 5)


def test_sts_longer_than_gamma_is_truncated_shorter_errors(tmp_path):
    """A file calibrated at block size B serves any gamma <= B with its first gamma temperatures."""
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [0.5, 1.0, 2.0, 4.0, 8.0, 0.25, 1.5, 3.0]}))
    got = load_sts_temperatures(str(sts), 4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, torch.tensor([0.5, 1.0, 2.0, 4.0]))
    torch.testing.assert_close(load_sts_temperatures(str(sts), 1), torch.tensor([0.5]))
    assert load_sts_temperatures(str(sts), 8).shape == (8,)
    with pytest.raises(ConfigError, match=r"at least gamma = 9 entries.*found 8"):
        load_sts_temperatures(str(sts), 9)
    sts.write_text(json.dumps({"temperatures": [1.0, -1.0, 2.0]}))  # a bad entry past gamma is not read
    torch.testing.assert_close(load_sts_temperatures(str(sts), 1), torch.tensor([1.0]))
    with pytest.raises(ConfigError, match="must be > 0"):
        load_sts_temperatures(str(sts), 2)
    sts.write_text(json.dumps({"ece_before": 0.1}))
    with pytest.raises(ConfigError, match="found None"):
        load_sts_temperatures(str(sts), 1)


def test_confidence_head_input_is_hidden_and_prev_embedding():
    cfg = parse_dspark_config({"vocab_size": 11, "hidden_size": 8, "num_hidden_layers": 1, "num_attention_heads": 2,
                               "intermediate_size": 16, "dspark_block_size": 3, "dspark_noise_token_id": 10,
                               "dspark_target_layer_ids": [0], "dspark_markov_rank": 4}, "cfg")
    model = DSparkDraftModel(cfg, with_heads=True)
    assert model.confidence_head.weight.dtype == torch.float32
    h, e = torch.randn(3, 8), torch.randn(3, 4)
    with torch.no_grad():
        got = model.confidence_logits(h, e)
        w, b = model.confidence_head.weight[0], model.confidence_head.bias[0]
        torch.testing.assert_close(got, torch.cat([h, e], -1) @ w + b)


def test_prefix_rule_verifies_all_without_a_table():
    assert prefix_len([0.9, 0.1, 0.01, 0.0], None) == 4


def test_prefix_rule_flat_table_admits_positive_survivals():
    flat = SpsTable([1], [10.0])  # floor lookup: every count costs the same
    assert flat.sps(7) == 100.0
    assert prefix_len([0.9, 0.5, 0.2], flat) == 3
    assert prefix_len([0.9, 0.5, 0.0], flat) == 2


def test_prefix_rule_stops_where_step_time_jumps():
    table = SpsTable([1, 2, 3, 4, 5], [10.0, 10.0, 10.0, 13.0, 13.0])  # 4 tokens cost 30% more than 3
    # j = 3 needs a_3 / (1 + a_1 + a_2) > 0.3: 0.7 / 2.7 fails, so two drafts are verified
    assert prefix_len([0.9, 0.8, 0.7, 0.6, 0.5], table) == 2
    # 0.97 / 2.97 passes; past the jump the table is flat again, so the rest is admitted
    assert prefix_len([0.99, 0.98, 0.97, 0.96, 0.95], table) == 5


def test_prefix_rule_stops_early_even_if_a_later_draft_would_pass():
    # step time spikes at 3 tokens and recovers at 4: j = 2 fails, j = 3 alone would pass (SPS(4) > SPS(3))
    table = SpsTable([1, 2, 3, 4], [10.0, 10.0, 30.0, 10.0])
    a = [0.9, 0.8, 0.7]
    assert (1 + a[0] + a[1] + a[2]) * table.sps(4) > (1 + a[0] + a[1]) * table.sps(3)
    assert prefix_len(a, table) == 1


def test_prefix_rule_matches_the_ratio_form():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        a = torch.rand(6, generator=gen).cumprod(0).tolist()
        times = (10 + torch.rand(7, generator=gen) * 5).sort().values.tolist()
        table = SpsTable(list(range(1, 8)), times)
        tau, expect = 1.0, 6
        for j in range(1, 7):  # admit j iff a_j / tau_{j-1} > t(j+1)/t(j) - 1
            if not a[j - 1] / tau > times[j] / times[j - 1] - 1:
                expect = j - 1
                break
            tau += a[j - 1]
        assert prefix_len(a, table) == expect
        sps = torch.tensor([table.sps(n) for n in range(1, 8)], dtype=torch.float64)
        assert int(prefix_len_device(torch.tensor(a), sps)) == expect  # the device rule is the same rule


def test_device_prefix_rule_equals_the_reference_on_random_survivals():
    """``prefix_len_device`` (no host value: what the step program runs) against the host reference."""
    gen = torch.Generator().manual_seed(1)
    for trial in range(300):
        gamma = int(torch.randint(1, 17, (1,), generator=gen))
        a = torch.rand(gamma, generator=gen).pow(0.3).cumprod(0)
        times = (10 + torch.rand(gamma + 1, generator=gen) * 8).sort().values.tolist()
        if trial % 3 == 0:
            times = [10.0] * (gamma + 1)  # flat: every draft with a_j > 0 admitted
        table = SpsTable(list(range(1, gamma + 2)), times)
        sps = torch.tensor([table.sps(n) for n in range(1, gamma + 2)], dtype=torch.float64)
        assert int(prefix_len_device(a, sps)) == prefix_len(a.tolist(), table)


def test_sps_table_floor_lookup_and_format(tmp_path):
    fn = tmp_path / "sps.json"
    fn.write_text(json.dumps({"verify_tokens": [1, 4, 8], "step_time_ms": [10.0, 12.5, 20.0]}))
    table = SpsTable.load(str(fn))
    assert [table.sps(n) for n in (1, 3, 4, 7, 8, 30)] == [100.0, 100.0, 80.0, 80.0, 50.0, 50.0]
    fn.write_text(json.dumps({"verify_tokens": [1, 1], "step_time_ms": [10.0, 12.0]}))
    with pytest.raises(ConfigError, match="strictly increasing"):
        SpsTable.load(str(fn))


# ---- end to end through the engine ----


@pytest.fixture(scope="module")
def plain(targets) -> dict[str, list[int]]:
    """Plain greedy decoding of PROMPT, per architecture."""
    return {arch: _generate(_engine(path), PROMPT) for arch, path in targets.items()}


def _draft_for(tmp_path, target_path: str, name: str = "draft", **kw) -> str:
    path = str(tmp_path / name)
    write_random_dspark_draft(load_model_config(target_path), path, seed=1, **kw)
    return path


def _memorise_bigrams(draft_path: str, tokens: list[int], scale: float = 8.0) -> None:
    """Overwrite the Markov head so that its bias (scale^2 on the remembered successor of prev) makes the
    draft chain follow the first-seen bigrams of ``tokens``: a draft the target accepts often, but not always."""
    fn = os.path.join(draft_path, "model.safetensors")
    tensors = load_file(fn)
    w1 = torch.zeros_like(tensors["markov_head.w1.weight"])  # [V, r]
    w2 = torch.zeros_like(tensors["markov_head.w2.weight"])  # [V, r]
    successor: dict[int, int] = {}
    for prev, nxt in zip(tokens, tokens[1:], strict=False):
        successor.setdefault(prev, nxt)
    assert len(successor) <= w1.shape[1]
    for i, (prev, nxt) in enumerate(successor.items()):
        w1[prev, i], w2[nxt, i] = scale, scale
    tensors["markov_head.w1.weight"], tensors["markov_head.w2.weight"] = w1, w2
    save_file(tensors, fn)


def _accepted_drafts(engine: Engine) -> int:
    stats = engine.spec_stats
    return stats.num_accepted_tokens - stats.num_verify_steps


@pytest.mark.parametrize("arch", list(ARCHS))
@pytest.mark.parametrize("gamma", [4, 8])
def test_greedy_dspark_equals_plain_decoding(tmp_path, targets, plain, arch, gamma):
    draft = _draft_for(tmp_path, targets[arch], block_size=gamma, num_layers=2, markov_rank=64)
    _memorise_bigrams(draft, PROMPT + plain[arch])
    spec = SpecConfig(algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=gamma + 1)
    engine = _engine(targets[arch], spec)
    assert engine.drafter.num_draft_tokens == gamma + 1
    assert _generate(engine, PROMPT) == plain[arch]
    assert len(plain[arch]) == 40
    assert _accepted_drafts(engine) > 0  # accepted chains, not only corrections, went through extend


@pytest.mark.parametrize("arch", list(ARCHS))
def test_block_8_draft_served_at_gamma_4_equals_plain(tmp_path, targets, plain, arch, caplog):
    """A draft trained at block size B runs with fewer slots (gamma < B): blocks of [anchor, MASK x 3], the
    Markov chain and the confidence head over 4 slots, an 8-entry STS file cut to 4; greedy stays exact."""
    draft = _draft_for(tmp_path, targets[arch], block_size=8, num_layers=2, markov_rank=64)
    _memorise_bigrams(draft, PROMPT + plain[arch])
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [0.5, 1.0, 1.0, 2.0, 9.0, 9.0, 9.0, 9.0]}))
    sps = tmp_path / "sps.json"  # flat: every draft with a_j > 0 is admitted
    sps.write_text(json.dumps({"verify_tokens": [1], "step_time_ms": [10.0]}))
    spec = SpecConfig(algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=5,
                      dspark_sps_table_path=str(sps), dspark_confidence_sts_path=str(sts))
    with caplog.at_level("INFO", logger="baton.speculative.dspark"):
        engine = _engine(targets[arch], spec)
    assert [r.levelname for r in caplog.records if "block size 8" in r.getMessage()] == ["INFO"]
    drafter = engine.drafter
    assert drafter.gamma == 4 and drafter.num_draft_tokens == 5 and drafter.model.config.block_size == 8
    torch.testing.assert_close(drafter.sts_temperatures, torch.tensor([0.5, 1.0, 1.0, 2.0]))
    lengths = []
    draft_fn = drafter.draft

    def recording_draft(relay, arange):
        draft_fn(relay, arange)
        lengths.append(int(relay.num_drafts))

    drafter.draft = recording_draft
    assert _generate(engine, PROMPT) == plain[arch]
    assert lengths and max(lengths) <= 4
    assert _accepted_drafts(engine) > 0


def test_gamma_above_the_block_size_is_an_error(tmp_path, targets):
    draft = _draft_for(tmp_path, targets["llama"], block_size=8)
    for algorithm in ("DSPARK", "DFLASH"):
        spec = SpecConfig(algorithm=algorithm, draft_model_path=draft, num_draft_tokens=10)
        with pytest.raises(ConfigError, match=r"gamma 9, more than the block size 8.*num-draft-tokens <= 9"):
            _engine(targets["llama"], spec)
    engine = _engine(targets["llama"], SpecConfig(algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=9))
    assert engine.drafter.gamma == 8  # gamma == block size is the trained setting


@pytest.mark.parametrize("arch", list(ARCHS))
def test_greedy_dflash_on_a_dspark_checkpoint_equals_plain(tmp_path, targets, plain, arch):
    draft = _draft_for(tmp_path, targets[arch], block_size=4)
    spec = SpecConfig(algorithm="DFLASH", draft_model_path=draft, num_draft_tokens=5)
    engine = _engine(targets[arch], spec)
    assert engine.drafter.model.markov_head is None
    assert _generate(engine, PROMPT) == plain[arch]


def test_greedy_with_sps_truncation_equals_plain(tmp_path, targets, plain):
    draft = _draft_for(tmp_path, targets["ling"], block_size=6, markov_rank=64)
    _memorise_bigrams(draft, PROMPT + plain["ling"])
    sps = tmp_path / "sps.json"  # each extra token costs 5% more: admit j while a_j / tau_{j-1} > 0.05
    sps.write_text(json.dumps({"verify_tokens": list(range(1, 8)), "step_time_ms": [10 * 1.05**i for i in range(7)]}))
    sts = tmp_path / "sts.json"
    sts.write_text(json.dumps({"temperatures": [0.3, 0.5, 1.0, 1.0, 2.0, 2.0]}))
    spec = SpecConfig(algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=7,
                      dspark_sps_table_path=str(sps), dspark_confidence_sts_path=str(sts))
    engine = _engine(targets["ling"], spec)
    lengths = []
    draft_fn = engine.drafter.draft

    def recording_draft(relay, arange):
        draft_fn(relay, arange)
        lengths.append(int(relay.num_drafts))

    engine.drafter.draft = recording_draft
    from baton.layers.moe import SparseMoE

    moe = next(m for m in engine.model.modules() if isinstance(m, SparseMoE))
    route_fn, routed = moe.route, []

    def recording_route(x, active_rows=None):
        ids, weights = route_fn(x, active_rows)
        if active_rows is not None:
            routed.append((int(active_rows), ids.clone()))
        return ids, weights

    moe.route = recording_route
    assert _generate(engine, PROMPT) == plain["ling"]
    assert min(lengths) < 6, lengths  # the rule really truncated some rounds
    assert routed and any(n < 7 for n, _ in routed)  # the verify told the MoE its active rows
    for n, ids in routed:  # rows past the prefix take no routed expert; the rows before it all route
        assert (ids[n:, : moe.top_k] == -1).all() and (ids[:n] >= 0).all()
        if moe.shared_id is not None:  # the fused shared expert: every row, past the prefix too
            assert ids.shape[1] == moe.top_k + 1 and (ids[:, -1] == moe.shared_id).all()
    hist = engine.spec_stats.accept_histogram
    assert max(hist) <= max(lengths)  # no round accepted past its prefix
    assert _accepted_drafts(engine) > 0


def test_sampled_dspark_runs_with_truncation(tmp_path, targets):
    draft = _draft_for(tmp_path, targets["llama"], block_size=4)
    sps = tmp_path / "sps.json"
    sps.write_text(json.dumps({"verify_tokens": [1, 2, 3, 4, 5], "step_time_ms": [10, 12, 14, 17, 20]}))
    spec = SpecConfig(algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=5,
                      dspark_sps_table_path=str(sps))
    engine = _engine(targets["llama"], spec)
    out = _generate(engine, PROMPT, temperature=0.8, seed=5)
    assert len(out) == 40 and all(0 <= t < TINY_LLAMA["vocab_size"] for t in out)
    assert out == _generate(engine, PROMPT, temperature=0.8, seed=5)  # seeded: reproducible


def test_resolve_spec_fills_num_draft_tokens(tmp_path, targets):
    draft = _draft_for(tmp_path, targets["llama"], block_size=5)
    spec = resolve_dspark_spec(SpecConfig(algorithm="DFLASH", draft_model_path=draft))
    assert spec.num_draft_tokens == 6 and spec.gamma == 5
    engine = _engine(targets["llama"], spec)
    assert engine.drafter.gamma == 5


def test_vocab_mismatch_is_an_error(tmp_path, targets):
    path = str(tmp_path / "draft")
    write_random_dspark_draft(parse_model_config({**TINY_LLAMA, "vocab_size": 120}), path)
    spec = SpecConfig(algorithm="DSPARK", draft_model_path=path, num_draft_tokens=9)
    with pytest.raises(ConfigError, match="vocabulary of 120 tokens"):
        _engine(targets["llama"], spec)


def test_missing_draft_path_is_an_error(targets):
    with pytest.raises(ConfigError, match="needs --speculative-draft-model-path"):
        _engine(targets["llama"], SpecConfig(algorithm="DSPARK", num_draft_tokens=9))
    with pytest.raises(ConfigError, match="needs --speculative-draft-model-path"):
        resolve_dspark_spec(SpecConfig(algorithm="DFLASH"))


def test_dspark_on_a_checkpoint_without_heads_is_an_error(tmp_path, targets):
    draft = _draft_for(tmp_path, targets["ling"], with_heads=False)
    spec = SpecConfig(algorithm="DSPARK", draft_model_path=draft, num_draft_tokens=9)
    with pytest.raises(ConfigError, match="Markov and confidence heads"):
        _engine(targets["ling"], spec)


def test_draft_is_whole_on_every_tensor_parallel_rank(tmp_path, targets):
    """Under TP the draft is replicated (built at size 1): full MLP and attention shapes, nothing that reduces;
    only the target's lm_head is vocab-parallel (tests/dist/test_tp_engine.py runs it at TP=2)."""
    from types import SimpleNamespace

    from baton import dist
    from baton.speculative.dspark import build_dspark_drafter

    draft = _draft_for(tmp_path, targets["ling"], block_size=4, num_layers=2, markov_rank=16)
    engine = SimpleNamespace(model=_engine(targets["ling"]).model, dtype=torch.float32, device=torch.device("cpu"))
    spec = SpecConfig(algorithm="DSPARK", draft_model_path=draft)
    with dist.layout_context(1, 2):
        model = build_dspark_drafter(engine, spec, 64).model
    cfg, whole = model.config, DSparkDraftModel(model.config, with_heads=True)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in whole.state_dict().items()}
    mlp = model.layers[0].mlp
    assert mlp.gate_up_proj.weight.shape == (2 * cfg.intermediate_size, cfg.hidden_size)
    assert mlp.down_proj.tp_size == 1  # never all-reduces


def test_tapping_the_last_target_layer_is_an_error(tmp_path, targets):
    draft = _draft_for(tmp_path, targets["llama"], target_layer_ids=[2])
    spec = SpecConfig(algorithm="DFLASH", draft_model_path=draft, num_draft_tokens=9)
    with pytest.raises(ConfigError, match="target layer id 2"):
        _engine(targets["llama"], spec)
