"""Drafts shipped with baton for the embedded SmolLM2-135M-Instruct, and the rule that serves them by default.

``baton/drafts/smollm2-135m-instruct/`` holds a NEXTN head (``nextn/``) and a DSpark drafter (``dspark/``, with
its STS temperatures in ``sts.json``), trained by ``baton/train/recipe_smollm2.sh``, and ``defaults.json``: the
algorithm and verify window the embedded model is served with. ``baton generate``, ``serve``, ``eval`` and
``gate`` on the embedded model speculate with them unless ``--speculative-algorithm none`` is given; naming an
algorithm without ``--speculative-draft-model-path`` picks the shipped draft of that kind.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from importlib import resources

from baton.config import SpecConfig

log = logging.getLogger(__name__)

DISABLE = ("none", "off", "disable", "disabled")
_DIRS = {"NEXTN": "nextn", "EAGLE": "nextn", "DSPARK": "dspark", "DFLASH": "dspark"}


def shipped_root() -> str:
    return os.environ.get("BATON_SHIPPED_DRAFTS") or str(resources.files("baton") / "drafts" / "smollm2-135m-instruct")


def shipped_draft(algorithm: str) -> str | None:
    """The shipped draft directory for ``algorithm``, or None when this install has none."""
    sub = _DIRS.get(algorithm.upper())
    path = os.path.join(shipped_root(), sub) if sub else None
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else None


def is_shipped(path: str | None) -> bool:
    """Whether ``path`` is one of the shipped draft directories."""
    if not path:
        return False
    root = os.path.abspath(shipped_root())
    return os.path.commonpath([root, os.path.abspath(path)]) == root


def shipped_defaults() -> dict:
    fn = os.path.join(shipped_root(), "defaults.json")
    if not os.path.isfile(fn):
        return {}
    with open(fn) as f:
        return json.load(f)


def with_shipped_drafts(spec: SpecConfig, embedded: bool, requested: str | None,
                        device: str | None = None) -> SpecConfig:
    """Fill in the shipped drafts for the embedded model. ``requested`` is the raw ``--speculative-algorithm``
    (None when not given; one of DISABLE turns speculation off). ``device`` ("cpu", "cuda"): defaults.json's
    ``by_device`` entry for it overrides the default (on the CPU: plain decoding, where the drafts do not pay)."""
    if requested is not None and requested.lower() in DISABLE:
        return dataclasses.replace(spec, algorithm=None)
    if not embedded or spec.draft_model_path is not None:
        return with_draft_sts(spec)
    defaults = shipped_defaults()
    if spec.algorithm is None:
        if spec.simulate_accept_len is not None:
            return spec
        override = defaults.get("by_device", {}).get(device or "")
        if override is not None and "algorithm" in override:
            algorithm = override["algorithm"]
            if algorithm is None:
                log.info("plain decoding: %s (--speculative-algorithm %s speculates)", override.get("why", ""),
                         defaults.get("algorithm"))
                return spec
        else:
            algorithm = defaults.get("algorithm")
        if algorithm is None or shipped_draft(algorithm) is None:
            return spec
        spec = dataclasses.replace(spec, algorithm=algorithm)
        log.info("speculating with the shipped %s draft (--speculative-algorithm none: plain decoding)", algorithm)
    if (spec.algorithm == defaults.get("algorithm") and spec.num_draft_tokens is None and spec.num_steps is None
            and spec.simulate_accept_len is None):
        # the shipped setting of that draft (e.g. DSpark at gamma 8, not its whole trained block), also when the
        # algorithm was named on the command line without a depth
        spec = dataclasses.replace(spec, num_draft_tokens=defaults.get("num_draft_tokens"),
                                   num_steps=defaults.get("num_steps"))
    path = shipped_draft(spec.algorithm)
    if path is None:
        return spec
    spec = with_draft_sts(dataclasses.replace(spec, draft_model_path=path))
    return SpecConfig(**dataclasses.asdict(spec))  # re-validate (NEXTN steps / window)


def with_draft_sts(spec: SpecConfig) -> SpecConfig:
    """A DSpark draft directory's own confidence calibration: the ``sts.json`` that ``baton train calibrate`` (and
    the recipe) writes beside the checkpoint, when ``--speculative-dspark-confidence-sts-path`` names none. The
    shipped drafter and a freshly trained one are read alike."""
    if spec.algorithm != "DSPARK" or not spec.draft_model_path or spec.dspark_confidence_sts_path is not None:
        return spec
    sts = os.path.join(spec.draft_model_path, "sts.json")
    if not os.path.isfile(sts):
        return spec
    log.info("DSpark confidence calibration: %s (--speculative-dspark-confidence-sts-path overrides)", sts)
    return dataclasses.replace(spec, dspark_confidence_sts_path=sts)


__all__ = ["DISABLE", "is_shipped", "shipped_defaults", "shipped_draft", "shipped_root", "with_draft_sts",
           "with_shipped_drafts"]
