"""benchmarks/ops/sass_linear.py: the decode GEMM compiled for sm_90 from the launch plan a call would use (no GPU),
its K loop found in the SASS and counted. Runs the tool in a process of its own (the test session interprets the
kernels); needs Triton's NVIDIA backend tools (ptxas, cuobjdump), skipped without them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.ops import sass_linear

pytestmark = pytest.mark.skipif(not sass_linear.available(), reason="Triton has no NVIDIA ptxas / cuobjdump here")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, "-m", "benchmarks.ops.sass_linear", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_loops_are_found_and_counted(tmp_path):
    """A bf16 swap form with its config named, an fp8 one from the bucket rules (no table on this machine)."""
    out = tmp_path / "sass.json"
    p = _run("smol_down:bf16:4:swap-32x128-s1-w4-st1", "o_proj:fp8:6", "--json", str(out), "--dump", str(tmp_path))
    assert p.returncode == 0, p.stderr
    bf16, fp8 = json.loads(out.read_text())
    assert bf16["config"] == "swap-32x128-s1-w4-st1" and bf16["registers"] > 0
    assert bf16["weights_per_trip"] == 32 * 128 / 128
    assert 0 < bf16["loop_instructions"] < bf16["kernel_instructions"]
    assert bf16["histogram"].get("HMMA", 0) + bf16["histogram"].get("HGMMA", 0) > 0  # the MMA sits in the loop
    assert fp8["config"].startswith("swap-") and fp8["histogram"].get("F2FP", 0) > 0  # the e4m3 tile is widened
    assert 0 < fp8["per_weight"] < 50
    assert (tmp_path / "o_proj_fp8_6.sass").is_file() and (tmp_path / "o_proj_fp8_6.ttgir").is_file()
    assert "| smol_down:bf16:4:swap-32x128-s1-w4-st1 |" in p.stdout


def test_bad_specs_are_refused():
    for spec in ("nope:bf16:4", "o_proj:int4:4", "o_proj:bf16"):
        with pytest.raises(SystemExit):
            sass_linear.analyse(spec)
    p = _run("o_proj:bf16:4", "--help")
    assert p.returncode == 0 and "SHAPE:DTYPE:M" in p.stdout
