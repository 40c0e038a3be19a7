"""benchmarks/bench_domains.py's summary: the held-out mean and the table (pure functions, no engine)."""

from benchmarks.bench_domains import heldout_mean, table


def _acc(tok_s, accept, speedup=None):
    return {"decode_tok_s": tok_s, "accept_length": accept, "speedup": speedup}


def test_heldout_mean_leaves_out_gsm8k_and_random_ids():
    rows = {
        "writing": {"plain": _acc(100, None), "fixed": _acc(120, 3.0, 1.2), "adaptive": _acc(110, 2.0, 1.1)},
        "code": {"plain": _acc(100, None), "fixed": _acc(140, 4.0, 1.4), "adaptive": _acc(130, 3.0, 1.3)},
        "gsm8k": {"plain": _acc(100, None), "fixed": _acc(300, 9.0, 3.0), "adaptive": _acc(300, 9.0, 3.0)},
        "random ids": {"plain": _acc(100, None), "fixed": _acc(50, 1.0, 0.5), "adaptive": _acc(99, 1.0, 0.99)},
    }
    mean = heldout_mean(rows)
    assert abs(mean["fixed"]["speedup"] - 1.3) < 1e-12 and mean["fixed"]["accept_length"] == 3.5
    assert mean["fixed"]["domains"] == 2
    assert abs(mean["adaptive"]["speedup"] - 1.2) < 1e-12 and mean["adaptive"]["accept_length"] == 2.5
    text = table({"rows": rows, "heldout_mean": mean})
    assert text.splitlines()[-1] == "| held-out mean (2 domains) | | | 3.50 | 1.30 | | 2.50 | 1.20 |"
    assert len(text.splitlines()) == 2 + 4 + 1
