"""The MoE kernels' tiles: ``MoETile`` / ``MoEConfig``, the per-GPU tables and ``get_config``, which picks one.

A table maps a kind to entries keyed by the largest token count T each serves (the first key >= T wins; past the
last key the last entry). Kinds: ``direct`` (the per-pair / per-token kernels, bf16), ``aligned`` (the
expert-grouped kernels, also hybrid's up-projection), ``fp8`` (direct over fp8 experts), ``fp8_aligned``
(aligned over fp8 experts: prefill), ``fp8_w8a8`` (fp8 experts x e4m3 activations, ``act_fp8=True``:
BLOCK_K is 128, the activation group; ``block_m`` the aligned row block) and ``fp8_f16`` (the same kernels with
fp16 activations: w8a16 on the fp16 MMA, ``mode="f16"``). ``fp8_f16`` competes with ``fp8``'s direct kernels for the
same calls: an entry's ``preferred`` says which the default takes at its T (the sweep's verdict; without a tuned
entry, the direct kernels). The current GPU's table is
``tuned/<gpu name>.json`` (the same naming as the linear kernels' tables, baton/ops/linear/tuned/), written by the
tile sweeps ``python -m benchmarks.ops.bench_moe --sweep --write-table`` and (kind ``fp8_w8a8``)
``python -m benchmarks.ops.bench_moe_w8a8 --sweep --write-table``. A GPU without a table, a kind its table lacks, and
the CPU (the Triton interpreter) take ``FALLBACK``: untuned tiles that are valid for every shape, fp8 included.

File format: ``{"device": name, "entries": [{"kind", "max_tokens", "up", "down", "block_m", "combine"}, ...]}``;
``up`` / ``down`` / ``combine`` are ``MoETile`` fields (block_n, block_k, num_warps, num_stages), ``max_tokens``
null is an entry for every larger T. Entries may carry more keys (the sweep's ``us``); they are not read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from baton import env

__all__ = ["FALLBACK", "KINDS", "MoEConfig", "MoETile", "get_config", "read_table", "table_path", "write_table"]


@dataclass(frozen=True)
class MoETile:
    """Tile of one projection: BLOCK_N output columns, BLOCK_K reduction step, warps and pipeline stages."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 4
    split_k: int = 1  # w8a8 up-projection only: K split over this many programs (partial sums, SwiGLU in down;
    # measured slower at T = 1 on the H200, so no table entry uses it)


@dataclass(frozen=True)
class MoEConfig:
    up: MoETile  # w13 [E, 2I, d]: N over I (gate and up rows together), K over d
    down: MoETile  # w2 [E, d, I]: N over d, K over I
    block_m: int = 16  # aligned mode: rows (same-expert pairs) per program; >= 16 for tl.dot
    combine: MoETile = MoETile(256, 1, 4, 1)  # aligned mode: combine kernel (block_n only)
    preferred: bool = True  # fp8_f16: the default for fp8 experts at these T (else the direct kernels)
    token_down: bool = False  # fp8_f16 / fp8_w8a8: direct at any T, the down kernel with the combine per token


KINDS = ("direct", "aligned", "fp8", "fp8_aligned", "fp8_w8a8", "fp8_f16")
ANY_T = 1 << 30  # the key of an entry that serves every larger T (null in a table file)

# Valid everywhere: fp8 tiles have BLOCK_N and BLOCK_K dividing the 128 x 128 scale blocks; the aligned prefill
# entry takes bigger row blocks (the torch alignment's shapes).
FALLBACK: dict[str, dict[int, MoEConfig]] = {
    "direct": {ANY_T: MoEConfig(up=MoETile(16, 256, 4, 4), down=MoETile(16, 256, 4, 4))},
    "aligned": {16: MoEConfig(up=MoETile(32, 128, 4, 4), down=MoETile(64, 128, 4, 3), block_m=16),
                ANY_T: MoEConfig(up=MoETile(64, 64, 4, 3), down=MoETile(64, 64, 4, 3), block_m=64)},
    "fp8": {ANY_T: MoEConfig(up=MoETile(32, 128, 4, 4), down=MoETile(32, 128, 4, 4))},
    "fp8_aligned": {ANY_T: MoEConfig(up=MoETile(64, 64, 4, 3), down=MoETile(64, 64, 4, 3), block_m=64)},
    # w8a8 (fp8 experts x e4m3 activations, act_fp8=True): BLOCK_K is the 128-column group, BLOCK_N divides 128
    "fp8_w8a8": {ANY_T: MoEConfig(up=MoETile(64, 128, 4, 4), down=MoETile(64, 128, 4, 4), block_m=16)},
    # w8a16 on the fp16 MMA: the w8a8 kernels' tiles; not the default without a tuned entry that prefers it
    "fp8_f16": {ANY_T: MoEConfig(up=MoETile(64, 128, 4, 4), down=MoETile(64, 128, 4, 4), block_m=16,
                                 preferred=False)},
}
TUNED_DIR = Path(__file__).with_name("tuned")


def table_path(device_name: str) -> Path:
    slug = "".join(c if c.isalnum() else "-" for c in device_name.lower()).strip("-")
    return TUNED_DIR / f"{slug}.json"


def _config(e: dict) -> MoEConfig:
    extra = {"combine": MoETile(**e["combine"])} if "combine" in e else {}
    return MoEConfig(up=MoETile(**e["up"]), down=MoETile(**e["down"]), block_m=int(e.get("block_m", 16)),
                     preferred=bool(e.get("preferred", True)), token_down=bool(e.get("token_down", False)),
                     **extra)


def read_table(path: str | os.PathLike) -> dict[str, dict[int, MoEConfig]]:
    """kind -> {max_tokens: MoEConfig} of a table file (only the kinds it has)."""
    with open(path) as f:
        data = json.load(f)
    table: dict[str, dict[int, MoEConfig]] = {}
    for e in data["entries"]:
        if e["kind"] not in KINDS:
            raise ValueError(f"{path}: unknown MoE table kind {e['kind']!r} (known: {', '.join(KINDS)})")
        key = ANY_T if e["max_tokens"] is None else int(e["max_tokens"])
        table.setdefault(e["kind"], {})[key] = _config(e)
    return table


def _entry(kind: str, max_tokens: int, cfg: MoEConfig, extra: dict | None = None) -> dict:
    tiles = dataclasses.asdict(cfg)
    for tile in tiles.values():  # split_k only where it is used
        if isinstance(tile, dict) and tile.get("split_k") == 1:
            del tile["split_k"]
    if tiles["preferred"]:  # written only where it says no
        del tiles["preferred"]
    if not tiles["token_down"]:  # written only where it says yes
        del tiles["token_down"]
    return {"kind": kind, "max_tokens": None if max_tokens >= ANY_T else max_tokens, **tiles, **(extra or {})}


def write_table(rows: list[dict], device_name: str, path: str | os.PathLike = "default") -> str:
    """Merge ``rows`` ({"kind", "max_tokens", "config": MoEConfig, any other keys kept as they are}) into the table
    at ``path`` (default: this GPU's, ``table_path``): a row replaces the entry of its (kind, max_tokens), the
    others stay. Written through a temporary file, so a run killed mid-write leaves the previous table whole."""
    out = table_path(device_name) if path == "default" else Path(path)
    entries: dict[tuple[str, int | None], dict] = {}
    if out.is_file():
        with open(out) as f:
            for e in json.load(f).get("entries", []):
                entries[(e["kind"], e["max_tokens"])] = e
    for r in rows:
        if r["kind"] not in KINDS:
            raise ValueError(f"unknown MoE table kind {r['kind']!r} (known: {', '.join(KINDS)})")
        extra = {k: v for k, v in r.items() if k not in ("kind", "max_tokens", "config")}
        e = _entry(r["kind"], int(r["max_tokens"]), r["config"], extra)
        entries[(e["kind"], e["max_tokens"])] = e
    order = sorted(entries.values(), key=lambda e: (KINDS.index(e["kind"]), e["max_tokens"] is None,
                                                    e["max_tokens"] or 0))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump({"device": device_name, "entries": order}, f, indent=1)
    os.replace(tmp, out)
    return str(out)


@functools.cache
def device_table(device_name: str | None) -> dict[str, dict[int, MoEConfig]]:
    """The table ``get_config`` reads for ``device_name``: its file's kinds, ``FALLBACK`` for the others (all of
    them for None, the CPU, and for a GPU without a file)."""
    path = None if device_name is None else table_path(device_name)
    tuned = read_table(path) if path is not None and path.is_file() else {}
    return {kind: tuned.get(kind) or FALLBACK[kind] for kind in KINDS}


@functools.cache
def _device_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def current_device_name() -> str | None:
    """The current GPU's name, read once per device; None on the CPU and in the Triton interpreter."""
    if env.triton_interpret() or not torch.cuda.is_available():
        return None
    return _device_name(torch.cuda.current_device())


def get_config(num_tokens: int, kind: str) -> MoEConfig:
    """The tiles for ``num_tokens`` tokens of ``kind`` (one of KINDS) on the current device."""
    table = device_table(current_device_name())[kind]
    for key in sorted(table):
        if num_tokens <= key:
            return table[key]
    return table[max(table)]
