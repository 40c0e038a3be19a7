"""The gate with the drafts shipped for the embedded model (CPU, fp32): greedy speculative output equals plain
decoding token for token. Skipped while baton/drafts/smollm2-135m-instruct/ holds no drafts."""

from __future__ import annotations

import pytest

from baton.config import ServerArgs, SpecConfig
from baton.speculative.shipped import shipped_draft
from tests.speculative.test_spec_core import run

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [1, 9707, 30, 2683, 314, 216, 34, 1232, 216, 34, 47]]


def _engine(**spec):
    from baton.engine.engine import Engine

    return Engine(ServerArgs(device="cpu", dtype="float32", context_length=256,
                             spec=SpecConfig(**{"adaptive": False, **spec})))


@pytest.mark.parametrize("algorithm", ["NEXTN", "DSPARK"])
def test_gate_with_shipped_drafts(algorithm):
    path = shipped_draft(algorithm)
    if path is None:
        pytest.skip("no shipped drafts in this install (baton/train/recipe_smollm2.sh makes them)")
    spec = {"algorithm": algorithm, "draft_model_path": path}
    if algorithm == "NEXTN":
        spec["num_steps"] = 3
    else:
        spec["num_draft_tokens"] = 9  # gamma 8, the report's middle setting
    plain, spec_engine = _engine(), _engine(**spec)
    for prompt in PROMPTS:
        want, _ = run(plain, prompt, max_new_tokens=48)
        got, verify = run(spec_engine, prompt, max_new_tokens=48)
        assert got == want and verify > 0
