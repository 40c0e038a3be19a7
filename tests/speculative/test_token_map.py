"""``--speculative-token-map`` (baton/speculative/token_map.py): the drafts' hot vocabulary. Greedy speculative output
still equals plain decoding token for token (fp32, CPU) with a map, for NEXTN on both tiny targets and DFlash, and
on the embedded GGUF model, whose quantized lm_head the map re-quantises; drafts come only from the map; the file
formats, the builder and bad maps."""

from __future__ import annotations

import json

import pytest
import torch

from baton.cli import main as baton_main
from baton.config import ConfigError
from baton.speculative.token_map import build_token_map, load_token_map, save_token_map
from tests.speculative.conftest import make_engine
from tests.speculative.test_spec_core import PROMPT, run


def _map(tmp_path, ids, name="map.pt"):
    path = str(tmp_path / name)
    save_token_map(list(ids), path)
    return path


@pytest.mark.parametrize("target", ["ling", "llama"])
def test_nextn_with_a_token_map_equals_plain(tmp_path, plain, ling_path, llama_path, llama_nextn_path, target):
    path = ling_path if target == "ling" else llama_path
    extra = {} if target == "ling" else {"draft_model_path": llama_nextn_path}
    engine = make_engine(path, algorithm="NEXTN", num_steps=3, **extra)
    vocab = engine.model.embed_tokens.vocab.valid
    hot = sorted({*plain[target][: len(plain[target]) // 2], *range(0, vocab, 3)})  # part of the answer, not all
    spec = make_engine(path, algorithm="NEXTN", num_steps=3, token_map=_map(tmp_path, hot), **extra)
    proposed = []
    greedy = spec.model.greedy_tokens

    def spy(hidden, draft=False):
        out = greedy(hidden, draft)
        if draft:
            proposed.extend(out.tolist())
        return out

    spec.model.greedy_tokens = spy
    tokens, verify = run(spec)
    assert tokens == plain[target] and verify > 0
    assert proposed and set(proposed) <= set(hot)  # every draft came from the map


def test_dflash_with_a_token_map_equals_plain(tmp_path, plain, llama_path):
    from tests.speculative.test_dspark import _draft_for

    draft = _draft_for(tmp_path, llama_path, "DFLASH")
    hot = list(range(0, 101, 2))  # the tiny vocabulary: every other id
    engine = make_engine(llama_path, algorithm="DFLASH", draft_model_path=draft, num_draft_tokens=5,
                         token_map=_map(tmp_path, hot, "map.json"))
    tokens, verify = run(engine)
    assert tokens == plain["llama"] and verify > 0


def test_the_embedded_gguf_model_with_a_token_map_equals_plain(tmp_path):
    """The quantized (Q8_0) lm_head of the embedded model: the map's rows re-quantised, the argmax in C; the
    shipped NEXTN head with the 4096 lowest ids plus the answer's half."""
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine
    from baton.speculative.shipped import shipped_draft

    nextn = shipped_draft("NEXTN")
    if nextn is None:
        pytest.skip("no shipped drafts in this install")

    def engine(**spec):
        return Engine(ServerArgs(device="cpu", context_length=256, spec=SpecConfig(**{"adaptive": False, **spec})))

    prompt = [1, 504, 3458, 282, 4649, 314]
    plain = engine()
    if plain.model.lm_head_quantized is None:
        pytest.skip("the embedded lm_head is not GGUF-quantized here")
    want, _ = run(plain, prompt, max_new_tokens=32)
    hot = sorted({*range(4096), *want[:16]})
    spec = engine(algorithm="NEXTN", num_steps=3, draft_model_path=nextn, token_map=_map(tmp_path, hot))
    assert spec.model.draft_lm_head_bytes() < spec.model.lm_head_quantized.nbytes / 8
    got, verify = run(spec, prompt, max_new_tokens=32)
    assert got == want and verify > 0


def test_files_and_the_builder(tmp_path):
    assert load_token_map(_map(tmp_path, [5, 3, 9])).tolist() == [5, 3, 9]
    (tmp_path / "obj.json").write_text(json.dumps({"token_ids": [1, 2]}))
    assert load_token_map(str(tmp_path / "obj.json")).tolist() == [1, 2]
    torch.save([7, 8], tmp_path / "list.pt")  # SGLang's files: torch.save of a list
    assert load_token_map(str(tmp_path / "list.pt")).tolist() == [7, 8]
    ids, cov = build_token_map([[5, 5, 5, 9, 2], [9, 7]], size=3, vocab_size=20)
    assert ids == [2, 5, 9] and cov == pytest.approx(6 / 7)  # by count, ties to the lower id: 7 left out
    ids, cov = build_token_map([[5]], size=4, vocab_size=20)
    assert ids == [0, 1, 2, 5] and cov == 1.0  # filled with the lowest ids


def test_bad_maps_are_refused(tmp_path, llama_path, llama_nextn_path):
    with pytest.raises(ConfigError, match="no such file"):
        load_token_map(str(tmp_path / "missing.pt"))
    (tmp_path / "bad.json").write_text('{"ids": 3}')
    with pytest.raises(ConfigError, match="not a list of token ids"):
        load_token_map(str(tmp_path / "bad.json"))
    with pytest.raises(ConfigError, match="below the vocabulary size"):
        make_engine(llama_path, algorithm="NEXTN", draft_model_path=llama_nextn_path,
                    token_map=_map(tmp_path, [1, 10**6]))


def test_train_token_map_command(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt_ids": [1, 2], "response_ids": r}) + "\n"
                            for r in ([4, 4, 6], [6, 6, 8])))
    out = str(tmp_path / "m.pt")
    assert baton_main(["train", "token-map", "--train-data", str(data), "--size", "2", "--vocab-size", "16",
                       "--output", out]) == 0
    assert load_token_map(out).tolist() == [4, 6]
    assert "covering 83.33% of the 6 response tokens" in capsys.readouterr().out


def test_the_cli_flag_reaches_the_spec():
    import argparse

    from baton.cli import add_engine_args, server_args_from

    p = argparse.ArgumentParser()
    add_engine_args(p)
    ns = p.parse_args(["--speculative-algorithm", "NEXTN", "--speculative-token-map", "hot.pt"])
    assert server_args_from(ns).spec.token_map == "hot.pt"


__all__ = ["PROMPT"]
