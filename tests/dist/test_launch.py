"""``launch_ranks``: the ranks run and rank 0's result comes back; a rank that raises, dies or hangs ends the
whole run within the timeout, with an error naming the rank, both when the caller only supervises (TPError)
and when rank 0 runs in the caller, as in ``baton serve`` (the process exits with status 1)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from baton import dist
from tests.dist.ranks import fail_on, sum_ranks

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 3.0


def test_ranks_run_and_rank0_result_returns():
    assert dist.launch_ranks(sum_ranks, 2, (5,), backend="gloo", rank0_in_caller=False, timeout_s=30) == 3.0
    assert dist.tp_size() == 1  # the caller never joined the group


@pytest.mark.parametrize(("how", "message"), [("raise", "ValueError: boom on rank 1"), ("exit", "exited with code 3"),
                                              ("hang", "no progress")])
def test_a_failing_rank_fails_the_run_naming_it(how, message):
    start = time.monotonic()
    with pytest.raises(dist.TPError) as err:
        dist.launch_ranks(fail_on, 2, (1, how), backend="gloo", rank0_in_caller=False, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < 30
    text = str(err.value)
    assert "rank 1" in text.splitlines()[0], text
    if how == "hang":  # the collective timeout or the progress check, whichever fires first, names a rank
        assert "no progress" in text or "rank 1 failed" in text or "Timed out" in text, text
    else:
        assert message in text, text


SCRIPT = """
from baton import dist
from tests.dist.ranks import fail_on
dist.launch_ranks(fail_on, 2, ({rank}, {how!r}), backend="gloo", timeout_s={timeout})
print("not reached")
"""


@pytest.mark.parametrize(("rank", "how"), [(1, "hang"), (1, "raise"), (0, "hang")])
def test_rank0_in_the_caller_exits_nonzero_when_a_rank_fails(rank, how):
    code = SCRIPT.format(rank=rank, how=how, timeout=TIMEOUT_S)
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert proc.returncode != 0
    assert time.monotonic() - start < 45
    assert "not reached" not in proc.stdout
    assert "baton: tensor-parallel run failed: rank" in proc.stderr, proc.stderr
    assert f"rank {rank}" in proc.stderr
