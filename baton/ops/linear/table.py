"""Writing the linear kernels' per-GPU table (``tuned/<gpu name>.json``, which ``triton.pick_config`` reads through
``triton.read_table``) from the winners of a tuning sweep (``python -m benchmarks.ops.bench_linear --tune
--write-table``)."""

from __future__ import annotations

import json
import os

import torch

__all__ = ["dump_json", "write_table"]


def write_table(rows: list[dict], device_name: str, path: str = "default") -> str:
    """The winners of a tuning sweep (rows with ``m``, ``n_out``, ``k``, ``swiglu``, ``best`` (a LinearConfig's
    fields), ``best_us``, ``best_gbps``) as a table ``pick_config`` reads: M == 1 rows give the "gemv" entry, M > 1
    rows the entry of their bucket ("m4", "m8", "m16"; the largest M tuned wins when several share one). An
    existing table at the path is merged into: its entries for other shapes and kinds stay."""
    from baton.ops.linear import triton as fast

    out = fast.table_path(device_name) if path == "default" else path
    entries: dict[tuple, dict] = {}
    if os.path.isfile(out):
        with open(out) as f:
            for e in json.load(f).get("entries", []):
                entries[(e["kind"], e["n_out"], e["k"], e["swiglu"])] = e
    for r in sorted(rows, key=lambda r: r["m"]):
        kind = fast.table_kinds(r["m"])[0]
        entries[(kind, r["n_out"], r["k"], r["swiglu"])] = {
            "kind": kind, "n_out": r["n_out"], "k": r["k"], "swiglu": r["swiglu"], "config": r["best"],
            "us": round(r["best_us"], 2), "gbps": round(r["best_gbps"]), "m": r["m"]}
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    dump_json({"device": device_name, "torch": torch.__version__, "entries": list(entries.values())}, out)
    return str(out)


def dump_json(obj: object, path: str | os.PathLike) -> None:
    """JSON to ``path`` through a temporary file (a run killed mid-write leaves the previous file whole)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
    os.replace(tmp, path)
