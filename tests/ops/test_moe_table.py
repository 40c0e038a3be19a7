"""The MoE kernels' per-GPU tile tables (baton/ops/moe/tuned/<gpu>.json): the committed H200 table holds the tiles
the kernels were tuned with, every (kind, T) the kernels ask for resolves, fp8 tiles fit the scale blocks, an
unknown GPU and the CPU take the fallback, and a sweep's rows written back read back."""

from __future__ import annotations

import json

import pytest
import torch

from baton.ops.moe import table
from baton.ops.moe.table import ANY_T, FALLBACK, KINDS, MoEConfig, MoETile


def _cfg(up, down, block_m=16) -> MoEConfig:
    return MoEConfig(up=MoETile(*up), down=MoETile(*down), block_m=block_m)


# The tiles the kernels used when they were constants in baton/ops/moe/triton.py (DIRECT_CONFIGS, ALIGNED_CONFIGS,
# FP8_CONFIGS, FP8_ALIGNED_CONFIG), tuned on the H200.
H200 = {
    "direct": {1: _cfg((16, 256, 4, 4), (16, 256, 4, 4)), 2: _cfg((16, 256, 4, 4), (16, 256, 4, 4)),
               4: _cfg((16, 256, 4, 4), (16, 256, 4, 4)), 8: _cfg((32, 128, 4, 4), (16, 256, 4, 4)),
               16: _cfg((32, 128, 4, 4), (16, 256, 4, 4))},
    "aligned": {4: _cfg((32, 128, 4, 4), (64, 128, 4, 3)), 16: _cfg((32, 256, 4, 3), (64, 128, 4, 3)),
                1 << 30: _cfg((64, 64, 4, 3), (64, 64, 4, 3), 64)},
    "fp8": {1: _cfg((16, 256, 8, 3), (32, 128, 4, 4)), 6: _cfg((32, 256, 8, 3), (64, 128, 8, 3)),
            16: _cfg((32, 128, 4, 4), (32, 128, 4, 4))},
    "fp8_aligned": {1 << 30: _cfg((64, 64, 4, 3), (64, 64, 4, 3), 64)},
    # w8a8 (act_fp8=True), swept on the H200 2026-12-02 (benchmarks/results/moe-2026-12-02/)
    "fp8_w8a8": {1: _cfg((64, 128, 4, 5), (128, 128, 4, 4)), 2: _cfg((64, 128, 4, 5), (128, 128, 4, 4)),
                 8: _cfg((64, 128, 4, 3), (128, 128, 8, 3)), 1 << 30: _cfg((128, 128, 8, 3), (128, 128, 8, 3))},
}
TOKENS = [*range(1, 18), 64, 300, 4096]  # decode, verify (DSpark's 17 rows), prefill


def test_h200_table_is_the_tuned_tiles():
    assert table.read_table(table.table_path("NVIDIA H200")) == H200


def test_table_files_are_package_data():
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / "pyproject.toml").read_text().splitlines()
    package_data = lines[lines.index("[tool.setuptools.package-data]") + 1]
    assert package_data.startswith("baton = [") and '"ops/moe/tuned/*.json"' in package_data
    assert list(table.TUNED_DIR.glob("*.json")), "no table next to baton/ops/moe/table.py"


@pytest.mark.parametrize("device", ["NVIDIA H200", "Fake GPU 9000", None])
def test_every_kind_and_token_count_resolves(device, monkeypatch):
    monkeypatch.setattr(table, "current_device_name", lambda: device)
    for kind in KINDS:
        for t in TOKENS:
            cfg = table.get_config(t, kind)
            assert isinstance(cfg, MoEConfig)
            if kind in ("aligned", "fp8_aligned"):
                assert cfg.block_m >= 16  # tl.dot rows
            if kind.startswith("fp8"):  # a program's rows in one scale row; chunks within or across 128 columns
                for tile in (cfg.up, cfg.down):
                    assert 128 % tile.block_n == 0
                    assert 128 % tile.block_k == 0 or tile.block_k % 128 == 0
                    if kind == "fp8_aligned":
                        assert 128 % tile.block_k == 0


def test_lookup_takes_the_first_key_at_or_past_t(monkeypatch):
    monkeypatch.setattr(table, "current_device_name", lambda: "NVIDIA H200")
    assert table.get_config(3, "direct") == H200["direct"][4]
    assert table.get_config(5, "fp8") == H200["fp8"][6]
    assert table.get_config(17, "fp8") == H200["fp8"][16]  # past the last key: the last entry
    assert table.get_config(17, "aligned") == H200["aligned"][1 << 30]


def test_unknown_gpu_and_cpu_take_the_fallback(monkeypatch):
    if not torch.cuda.is_available():
        assert table.current_device_name() is None  # CPU / interpreter runs never read a table
    for device in ("Fake GPU 9000", None):
        monkeypatch.setattr(table, "current_device_name", lambda device=device: device)
        for kind in KINDS:
            assert table.get_config(1, kind) == FALLBACK[kind][min(FALLBACK[kind])]
            assert table.get_config(4096, kind) == FALLBACK[kind][max(FALLBACK[kind])]


def test_kernels_take_the_table(monkeypatch):
    """The Triton module's get_config (hybrid's up-projection is aligned) reads the same table."""
    pytest.importorskip("triton")
    from tests.ops.triton_support import interpreted_module

    mt = interpreted_module("baton.ops.moe.triton")
    monkeypatch.setattr(table, "current_device_name", lambda: "NVIDIA H200")
    assert mt.get_config(1, "direct") == H200["direct"][1]
    assert mt.get_config(6, "hybrid") == mt.get_config(6, "aligned") == H200["aligned"][16]
    assert mt.get_config(2, "fp8") == H200["fp8"][6]


def test_sweep_rows_write_and_merge(tmp_path, monkeypatch):
    monkeypatch.setattr(table, "TUNED_DIR", tmp_path)
    cfg = _cfg((8, 512, 4, 3), (16, 128, 8, 4))
    path = table.write_table([{"kind": "direct", "max_tokens": 1, "config": cfg, "us": 12.5}], "Fake GPU 9001")
    assert path == str(tmp_path / "fake-gpu-9001.json")
    assert json.loads((tmp_path / "fake-gpu-9001.json").read_text())["entries"][0]["us"] == 12.5
    big = _cfg((64, 64, 4, 3), (64, 64, 4, 3), 64)
    table.write_table([{"kind": "aligned", "max_tokens": ANY_T, "config": big},
                       {"kind": "direct", "max_tokens": 6, "config": cfg}], "Fake GPU 9001")  # merges in
    got = table.read_table(path)
    assert got == {"direct": {1: cfg, 6: cfg}, "aligned": {ANY_T: big}}
    assert json.loads((tmp_path / "fake-gpu-9001.json").read_text())["entries"][-1]["max_tokens"] is None

    monkeypatch.setattr(table, "current_device_name", lambda: "Fake GPU 9001")
    table.device_table.cache_clear()
    try:
        assert table.get_config(3, "direct") == cfg
        assert table.get_config(1, "fp8") == FALLBACK["fp8"][ANY_T]  # a kind the file lacks
    finally:
        table.device_table.cache_clear()
    with pytest.raises(ValueError, match="unknown MoE table kind"):
        table.write_table([{"kind": "hybrid", "max_tokens": 1, "config": cfg}], "Fake GPU 9001")
