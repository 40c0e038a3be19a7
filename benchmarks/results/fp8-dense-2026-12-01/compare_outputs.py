"""Per-question comparison of two bench_drafts runs (the same questions, greedy): how many outputs are identical, the
mean number of leading words they share, accuracy and accept length per config.

    python benchmarks/results/fp8-dense-2026-12-01/compare_outputs.py REF.json TEST.json
"""

from __future__ import annotations

import json
import sys


def main(ref_path: str, test_path: str) -> None:
    ref, test = json.load(open(ref_path)), json.load(open(test_path))
    rows = {r["config"].split(" [")[0]: r for r in test["rows"]}
    ref_rows = {r["config"]: r for r in ref["rows"]}
    ref_plain = ref["runs"]["plain T=0"]
    print("| config | accuracy (ref -> test) | accept length (ref -> test) | outputs identical to the ref's plain | "
          "mean shared leading words |")
    print("| --- | --- | --- | --- | --- |")
    for label, runs in test["runs"].items():
        config = label.rsplit(" T=", 1)[0].split(" [")[0]
        same = sum(a["output"] == b["output"] for a, b in zip(ref_plain, runs, strict=True))
        shared = []
        for a, b in zip(ref_plain, runs, strict=True):
            ta, tb = a["output"].split(), b["output"].split()
            n = next((i for i, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), min(len(ta), len(tb)))
            shared.append(n)
        r, t = ref_rows.get(config, {}), rows.get(config, {})
        acc = f"{r.get('accuracy', float('nan')):.3f} -> {t.get('accuracy', float('nan')):.3f}"
        fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
        al = f"{fmt(r.get('accept_length'))} -> {fmt(t.get('accept_length'))}"
        print(f"| {config} | {acc} | {al} | {same} / {len(runs)} | {sum(shared) / len(shared):.1f} |")


if __name__ == "__main__":
    main(*sys.argv[1:3])
