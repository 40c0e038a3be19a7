"""benchmarks/bench_decode_gemm.py's table writers: a tune's winners replace the entries of the shapes it tuned and
nothing else. A w8a16 tune (``--tune --write-table``) once dropped the fp8 table's w8a8 (``"act": "fp8"``) entries
of the same shapes (seen on the H200 at 6acf2e2); each writer now replaces only its own kind of entry."""

from __future__ import annotations

import json

import pytest

from baton.ops.linear import triton as lt
from benchmarks import bench_decode_gemm as bdg

CFG = {"block_n": 16, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 1, "dot": True}


def _entry(kind, n_out, k, us, act=None):
    e = {"kind": kind, "n_out": n_out, "k": k, "swiglu": False, "config": dict(CFG), "us": us, "m": 1}
    if act:
        e["act"] = act
    return e


def _row(us):
    return {"impl": "tune", "config": dict(CFG, block_n=32), "us": us, "tbps": 1.0, "M": 4, "shape": "x"}


@pytest.fixture
def tables(tmp_path, monkeypatch):
    bf16, fp8 = tmp_path / "linear", tmp_path / "fp8"
    bf16.mkdir()
    fp8.mkdir()
    monkeypatch.setattr(lt, "TUNED_DIR", bf16)
    monkeypatch.setattr(lt, "TUNED_FP8_DIR", fp8)
    yield lambda fp8_table: lt.table_path("Fake GPU", fp8 if fp8_table else bf16)
    lt._device_table.cache_clear()


def test_w8a16_tune_keeps_the_w8a8_entries_of_its_shapes(tables):
    path = tables(True)
    path.write_text(json.dumps({"device": "Fake GPU", "w8a8_written_by": "w8a8 tune", "entries": [
        _entry("m4", 2560, 4096, 9.0), _entry("m4", 2560, 4096, 7.0, act="fp8"),
        _entry("m1", 2560, 4096, 6.9, act="fp8"), _entry("m4", 768, 2560, 5.0)]}))
    bdg.write_tables({(True, 2560, 4096, False, "m4"): _row(8.0)}, "Fake GPU")
    data = json.loads(path.read_text())
    got = {(e["kind"], e["n_out"], e.get("act")): e["us"] for e in data["entries"]}
    assert got == {("m4", 2560, None): 8.0, ("m4", 2560, "fp8"): 7.0, ("m1", 2560, "fp8"): 6.9,
                   ("m4", 768, None): 5.0}
    assert data["w8a8_written_by"] == "w8a8 tune"  # the table's other keys stay
    assert data["written_by"].startswith("benchmarks/bench_decode_gemm.py")


def test_w8a8_tune_keeps_the_w8a16_entries(tables):
    path = tables(True)
    path.write_text(json.dumps({"entries": [_entry("m4", 2560, 4096, 9.0),
                                            _entry("m4", 2560, 4096, 7.0, act="fp8")]}))
    bdg.write_w8a8_table({(2560, 4096, False, "m4"): _row(6.5)}, "Fake GPU")
    got = {(e["kind"], e.get("act")): e["us"] for e in json.loads(path.read_text())["entries"]}
    assert got == {("m4", None): 9.0, ("m4", "fp8"): 6.5}


def test_bf16_tune_replaces_every_bucket_of_its_shape(tables):
    path = tables(False)
    path.write_text(json.dumps({"entries": [_entry("dot", 576, 576, 2.2), _entry("m4", 576, 576, 2.3),
                                            _entry("gemv", 960, 576, 1.6)]}))
    bdg.write_tables({(False, 576, 576, False, "m8"): _row(2.0)}, "Fake GPU")
    got = {(e["kind"], e["n_out"]): e["us"] for e in json.loads(path.read_text())["entries"]}
    assert got == {("m8", 576): 2.0, ("gemv", 960): 1.6}
