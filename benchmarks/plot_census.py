"""Where a decode step's time goes, as a picture: one stacked bar per configuration (the exclusive census of
``bench_ling_flash.py`` / ``baton census``, rank 0's at TP > 1), with the step's bandwidth floor marked.

    python benchmarks/plot_census.py benchmarks/results/h200-2026-11-30c/d/ling_flash_42l_*.json \\
        --output benchmarks/results/h200-2026-11-30c/d/census_tp2.png --title "Ling-3.0-flash, TP2, rank 0"

Each JSON is one bench_ling_flash.py result (its ``plain`` / ``nextn`` entries with a ``census``); a census JSONL
line of ``baton census --output-file`` works too. Bars are labelled "<quantization> <mode>".
"""

from __future__ import annotations

import argparse
import json

# the census categories, in stacking order (bottom first); anything else is drawn as "other"
CATEGORIES = ["MoE GEMM", "dense GEMM", "KDA", "MLA", "attention", "all-reduce", "router / activation / glue", "idle"]


def load_bars(paths: list[str]) -> list[dict]:
    """[{label, census (µs by category), step_ms, floor_ms}] from bench_ling_flash.py JSONs or census JSONL."""
    bars = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        records = [json.loads(line) for line in text.splitlines() if line.strip()] if path.endswith(".jsonl") \
            else [json.loads(text)]
        for rec in records:
            quant = rec.get("quantization") or "bf16"
            entries = [(mode, rec[mode]) for mode in ("plain", "nextn", "dspark") if isinstance(rec.get(mode), dict)]
            if "census_us" in rec:  # a bare census record
                entries = [(rec.get("label", "step"), {"census": rec})]
            for mode, entry in entries:
                census = entry.get("census")
                if not census or "census_us" not in census:
                    continue
                bars.append(dict(label=f"{quant} {mode}", census=census["census_us"],
                                 step_ms=census.get("step_ms_unprofiled"), floor_ms=census.get("floor_ms")))
    if not bars:
        raise SystemExit("no census in the given files (bench_ling_flash.py writes one per mode)")
    return bars


def plot(bars: list[dict], output: str, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(1.6 * len(bars) + 4, 5))
    names = CATEGORIES + ["other"]
    colors = plt.get_cmap("tab10").colors
    bottoms = [0.0] * len(bars)
    xs = range(len(bars))
    for i, name in enumerate(names):
        if name == "other":
            vals = [sum(v for k, v in b["census"].items() if k not in CATEGORIES) / 1000 for b in bars]
        else:
            vals = [b["census"].get(name, 0.0) / 1000 for b in bars]
        if not any(vals):
            continue
        ax.bar(xs, vals, bottom=bottoms, color=colors[i % len(colors)], label=name, width=0.6)
        bottoms = [b + v for b, v in zip(bottoms, vals, strict=True)]
    for x, b in zip(xs, bars, strict=True):
        if b["floor_ms"]:
            ax.hlines(b["floor_ms"], x - 0.35, x + 0.35, colors="black", linestyles="dashed",
                      label="floor (bytes / 4.2 TB/s)" if x == 0 else None)
        if b["step_ms"]:
            ax.annotate(f"{b['step_ms']:.2f} ms unprofiled", (x, bottoms[x]), ha="center", va="bottom", fontsize=9)
    ax.set_xticks(list(xs), [b["label"] for b in bars])
    ax.set_ylabel("ms per traced step (exclusive census)")
    ax.set_title(title or "decode step census")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(output, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("files", nargs="+", help="bench_ling_flash.py JSON results or census JSONL files")
    p.add_argument("--output", default="census.png")
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    plot(load_bars(args.files), args.output, args.title)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
