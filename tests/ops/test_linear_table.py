"""The per-GPU tuned table of the linear kernels: written from tuning rows, read back by pick_config."""

from __future__ import annotations

import torch

from baton.ops.linear import triton as fast
from baton.ops.linear.table import write_table


def _row(m: int, n_out: int, k: int, block_n: int, swiglu: bool = False) -> dict:
    cfg = fast.LinearConfig(block_n, 512, 1, 4, 1)
    return {"name": "x", "m": m, "n_out": n_out, "k": k, "swiglu": swiglu, "best": cfg.__dict__, "best_us": 3.0,
            "best_gbps": 1000.0}


def test_table_round_trip_and_pick(tmp_path, monkeypatch):
    monkeypatch.setattr(fast, "TUNED_DIR", tmp_path)
    rows = [_row(1, 2560, 4096, 8), _row(6, 2560, 4096, 16), _row(16, 2560, 4096, 32), _row(1, 768, 2560, 4, True)]
    path = write_table(rows, "Fake GPU 9000")
    assert path == str(tmp_path / "fake-gpu-9000.json")
    table = fast.read_table(tmp_path / "fake-gpu-9000.json")
    assert table[("gemv", 2560, 4096, False)].block_n == 8
    assert table[("m8", 2560, 4096, False)].block_n == 16  # M = 5..8
    assert table[("m16", 2560, 4096, False)].block_n == 32
    assert table[("gemv", 768, 2560, True)].block_n == 4

    monkeypatch.setattr(fast, "_current_device_name", lambda: "Fake GPU 9000")
    assert fast.pick_config(1, 2560, 4096) == fast.LinearConfig(8, 512, 1, 4, 1)
    assert fast.pick_config(6, 2560, 4096) == fast.LinearConfig(16, 512, 1, 4, 1)
    assert fast.pick_config(12, 2560, 4096) == fast.LinearConfig(32, 512, 1, 4, 1)
    assert fast.pick_config(4, 2560, 4096) == fast._heuristic_config(4, 2560, 4096, False)  # no m4, no dot entry
    assert fast.pick_config(1, 1234, 4096) == fast._heuristic_config(1, 1234, 4096, False)  # not in the table
    monkeypatch.setitem(fast.TUNED, ("gemv", 2560, 4096, False), fast.LinearConfig(2, 256))
    assert fast.pick_config(1, 2560, 4096).block_n == 2  # entries set in code take precedence

    write_table([_row(1, 2560, 4096, 4), _row(3, 576, 576, 16)], "Fake GPU 9000")  # a later tune merges in
    table = fast.read_table(tmp_path / "fake-gpu-9000.json")
    assert table[("gemv", 2560, 4096, False)].block_n == 4 and table[("m4", 576, 576, False)].block_n == 16
    assert table[("m16", 2560, 4096, False)].block_n == 32 and len(table) == 5  # the others stay


def test_row_buckets_fall_back_to_a_dot_entry_which_never_takes_the_gemv_form(tmp_path, monkeypatch):
    import json

    monkeypatch.setattr(fast, "TUNED_DIR", tmp_path)
    entry = {"kind": "dot", "n_out": 576, "k": 576, "swiglu": False, "config": fast.LinearConfig(32, 128).__dict__}
    (tmp_path / "fake-gpu-9001.json").write_text(json.dumps({"entries": [entry]}))  # a table from before buckets
    monkeypatch.setattr(fast, "_current_device_name", lambda: "Fake GPU 9001")
    assert [fast.pick_config(m, 576, 576).block_n for m in (2, 4, 9, 16)] == [32, 32, 32, 32]
    few = fast.LinearConfig(4, 256, 1, 4, 1, dot=False)
    monkeypatch.setitem(fast.TUNED, ("m4", 576, 576, False), few)
    assert fast.pick_config(4, 576, 576) == few and fast.pick_config(5, 576, 576).block_n == 32
    monkeypatch.setitem(fast.TUNED, ("dot", 999, 576, False), few)  # a "dot" entry is always tl.dot
    assert fast.pick_config(12, 999, 576) == fast._heuristic_config(12, 999, 576, False)
    assert fast.table_kinds(1) == ("gemv",) and fast.table_kinds(3) == ("m4", "dot")
    assert fast.table_kinds(8) == ("m8", "dot") and fast.table_kinds(16) == ("m16", "dot")


def test_no_table_means_heuristics(monkeypatch):
    if not torch.cuda.is_available():
        assert fast._current_device_name() is None  # CPU / interpreter runs never read a table
    monkeypatch.setattr(fast, "_current_device_name", lambda: None)  # as on CPU, where no table is read
    monkeypatch.setattr(fast, "TUNED", {})
    assert fast.pick_config(1, 2560, 4096) == fast._heuristic_config(1, 2560, 4096, False)


def test_ling_tp_shapes_are_one_ranks_shards():
    from benchmarks.ops.bench_linear import LING_SHAPES, ling_tp_shapes

    whole = {s.name.split(".")[-1]: s for s in LING_SHAPES}
    tp2 = {s.name.split(".")[-1]: s for s in ling_tp_shapes(2)}
    assert (tp2["o_proj"].n, tp2["o_proj"].k) == (2560, 2048)  # row-parallel: K halved
    assert tp2["dense_gate_up"].n == whole["dense_gate_up"].n // 2 and tp2["dense_gate_up"].swiglu
    assert tp2["lm_head"].n == whole["lm_head"].n // 2  # vocab-parallel
    assert tp2["mla_in_proj"].n == 3072 + 576 + 16  # q and the gate split by heads; kv_a (576) replicated
    assert (tp2["router"].n, tp2["router"].k) == (512, 2560)  # replicated, whole
    assert all(s.name.startswith("ling.tp2.") for s in tp2.values())


def test_skip_tuned_leaves_only_the_missing_pairs():
    """``--skip-tuned`` (a tune cut short by its limit goes on): the committed table's TP2 M=6 entries are skipped;
    what is left is exactly the (M, shape) pairs without an entry of their own bucket."""
    from benchmarks.ops.bench_linear import ling_tp_shapes, untuned

    shapes = ling_tp_shapes(2)
    table = fast.read_table(fast.table_path("NVIDIA H200"))
    work = untuned(shapes, (6,), table)
    key = lambda m, s: (fast.table_kinds(m)[0], s.n // 2 if s.swiglu else s.n, s.k, s.swiglu)  # noqa: E731
    assert all(key(m, s) not in table for m, s in work)
    assert {s.name for _, s in work} | {s.name for s in shapes if key(6, s) in table} == {s.name for s in shapes}
    assert "ling.tp2.kda_in_proj" not in {s.name for _, s in work}  # tuned on 2026-11-30
    assert untuned(shapes, (6, 1), {}) == [(6, s) for s in shapes] + [(1, s) for s in shapes]  # M-major
