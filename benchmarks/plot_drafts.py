"""Plot ``bench_drafts.py`` results: accept length and TPOT of every speculative config, greedy and sampled.

    python benchmarks/plot_drafts.py RESULT.json [MORE.json ...] --output drafts.png

Left: accept length per config (bars, one colour per temperature), with the issue's targets as dashed lines
(NEXTN 2.5 at 3 steps, DSpark 4.0 at gamma 8). Right: mean TPOT per config, plain decoding's as a line per
temperature. Several JSON files (e.g. the NEXTN and the DSpark halves of the recipe's report) go on one figure;
each config keeps its label and the file order.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

TARGETS = {"NEXTN (3,1,4)": 2.5, "DSPARK gamma=8": 4.0}


def load_rows(paths: list[str]) -> list[dict]:
    """Every row without an error, plain rows once per temperature (each file repeats them)."""
    rows, seen_plain = [], set()
    for path in paths:
        for r in json.loads(Path(path).read_text())["rows"]:
            if "error" in r:
                continue
            if r.get("algorithm") is None:
                if r["temperature"] in seen_plain:
                    continue
                seen_plain.add(r["temperature"])
            rows.append(r)
    return rows


def plot(rows: list[dict], output: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temps = sorted({r["temperature"] for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows if r.get("algorithm") is not None))
    by = {(r["config"], r["temperature"]): r for r in rows}
    width = 0.8 / max(1, len(temps))
    fig, (ax_a, ax_t) = plt.subplots(1, 2, figsize=(13, 4.8))
    for i, t in enumerate(temps):
        xs = [j + (i - (len(temps) - 1) / 2) * width for j in range(len(configs))]
        acc = [by.get((c, t), {}).get("accept_length") or 0.0 for c in configs]
        tpot = [by.get((c, t), {}).get("mean_tpot_ms") or 0.0 for c in configs]
        ax_a.bar(xs, acc, width, label=f"T = {t:g}")
        ax_t.bar(xs, tpot, width, label=f"T = {t:g}")
        plain = next((r for r in rows if r.get("algorithm") is None and r["temperature"] == t), None)
        if plain is not None and plain.get("mean_tpot_ms"):
            ax_t.axhline(plain["mean_tpot_ms"], ls=":", color=f"C{i}", label=f"plain, T = {t:g}")
    for j, c in enumerate(configs):
        if c in TARGETS:
            ax_a.hlines(TARGETS[c], j - 0.45, j + 0.45, colors="k", linestyles="--")
    for ax, label in ((ax_a, "accept length (tokens per verify)"), (ax_t, "mean TPOT (ms, log scale)")):
        ax.set_xticks(range(len(configs)))
        ax.set_xticklabels(configs, rotation=35, ha="right", fontsize=8)
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_a.set_title("accept length (dashed: the targets)")
    ax_t.set_title("TPOT per config")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("results", nargs="+", help="bench_drafts.py JSON files")
    p.add_argument("--output", default="drafts.png")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    plot(load_rows(args.results), args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
