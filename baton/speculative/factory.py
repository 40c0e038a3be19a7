"""Build the drafter an Engine asks for from its SpecConfig."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.config import ConfigError, SpecConfig
from baton.speculative.base import Drafter

if TYPE_CHECKING:
    from baton.engine.engine import Engine


def build_drafter(engine: Engine, spec: SpecConfig) -> Drafter:
    max_len = engine.context_length + spec.num_draft_tokens + 1
    if spec.algorithm == "NEXTN":
        from baton.speculative.nextn import NextNDrafter

        head = getattr(engine.model, "mtp", None)
        if spec.draft_model_path:
            from baton.models.nextn_checkpoint import load_nextn_head

            head = load_nextn_head(spec.draft_model_path, engine.model, engine.device, engine.dtype)
        if head is None:
            raise ConfigError("--speculative-algorithm NEXTN needs the target's MTP layer "
                              "(num_nextn_predict_layers > 0) or --speculative-draft-model-path to a NEXTN head")
        return NextNDrafter(engine.model, head, spec.num_steps, max_len, engine.dtype, engine.device)
    if spec.algorithm in ("DSPARK", "DFLASH"):
        from baton.speculative.dspark import build_dspark_drafter

        return build_dspark_drafter(engine, spec, max_len)
    raise ConfigError(f"unknown speculative algorithm {spec.algorithm}")
