"""Speculation over domains: accept length and decode tok/s against plain decoding for each domain of the held-out
general prompt set (baton/train/prompts.py), GSM8K questions and random token ids; the drafter at its full depth
("fixed", --speculative-adaptive off) and with adaptive depth ("adaptive"), all in one run on the same engine
flags. Greedy, each request ends at EOS or --max-new-tokens (as a user's would).

    python benchmarks/bench_domains.py                                   # the embedded model and its drafts
    python benchmarks/bench_domains.py --per-domain 3 --max-new-tokens 128 --gsm8k ../shared/data/gsm8k/test.jsonl
    python benchmarks/bench_domains.py --speculative-algorithm NEXTN --plot results/domains.png

Decode tok/s is (tokens - 1) / (time after the first token), summed over a workload's requests; accept length is
tokens / verify steps. The three engines run each request in turn (plain, fixed, adaptive), so load drifts affect
all of them alike; each engine is warmed up on one request first. One JSON (``save``: $OUT or
benchmarks/results), the markdown table, and with --plot (matplotlib, the ``plot`` extra) a bar chart.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a file: make the repository root importable (benchmarks.common)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_card, save, timed_request  # noqa: E402

CONFIGS = ("plain", "fixed", "adaptive")


def _request(engine: Any, ids: list[int], max_new_tokens: int) -> dict:
    r = timed_request(engine, ids, max_new_tokens, ignore_eos=False)
    ttft_s = r["ttft_ms"] / 1e3
    return {"tokens": r["output_tokens"], "verify_steps": r["verify_steps"], "ttft_s": ttft_s,
            "decode_s": r["latency_s"] - ttft_s}


def workloads(tokenizer: Any, vocab: int, per_domain: int, gsm8k: str | None, num_random: int,
              seed: int) -> dict[str, list[list[int]]]:
    """Prompt token ids by workload: each held-out domain (chat template), GSM8K questions, random ids."""
    from baton.train.prompts import heldout_prompts

    out: dict[str, list[list[int]]] = {}
    for domain, prompts in heldout_prompts(per_domain).items():
        out[domain] = [tokenizer.encode(tokenizer.apply_chat_template(p.chat)) for p in prompts]
    if gsm8k:
        with open(gsm8k) as f:
            questions = [json.loads(line)["question"] for line in f if line.strip()][:per_domain]
        out["gsm8k"] = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]))
                        for q in questions]
    rng = random.Random(seed)
    out["random ids"] = [[rng.randrange(vocab) for _ in range(64)] for _ in range(num_random)]
    return out


def run(ns: argparse.Namespace) -> dict:
    from baton.args import server_args_from
    from baton.config import SpecConfig
    from baton.engine.engine import Engine

    base = server_args_from(ns)
    if not base.spec.enabled:
        raise SystemExit("no drafter: pass --speculative-algorithm (the embedded model has its shipped drafts)")
    args = {"plain": dataclasses.replace(base, spec=SpecConfig()),
            "fixed": dataclasses.replace(base, spec=dataclasses.replace(base.spec, adaptive=False)),
            "adaptive": dataclasses.replace(base, spec=dataclasses.replace(base.spec, adaptive=True))}
    engines = {name: Engine(a) for name, a in args.items()}
    plain = engines["plain"]
    loads = workloads(plain.tokenizer, plain.model_config.vocab_size, ns.per_domain, ns.gsm8k, ns.num_random,
                      ns.seed)
    warm = next(iter(loads.values()))[0]
    for e in engines.values():
        _request(e, warm, 16)
    rows: dict[str, dict[str, dict]] = {}
    for name, prompts in loads.items():
        acc = {c: {"tokens": 0, "verify_steps": 0, "decode_s": 0.0, "ttft_s": 0.0, "requests": 0} for c in CONFIGS}
        for ids in prompts:
            for c in CONFIGS:
                r = _request(engines[c], ids, ns.max_new_tokens)
                for k in ("tokens", "verify_steps", "decode_s", "ttft_s"):
                    acc[c][k] += r[k]
                acc[c]["requests"] += 1
        for c in CONFIGS:
            a = acc[c]
            a["decode_tok_s"] = (a["tokens"] - a["requests"]) / a["decode_s"] if a["decode_s"] > 0 else None
            a["accept_length"] = a["tokens"] / a["verify_steps"] if a["verify_steps"] else None
        for c in ("fixed", "adaptive"):
            p, s = acc["plain"]["decode_tok_s"], acc[c]["decode_tok_s"]
            acc[c]["speedup"] = s / p if p and s else None
        rows[name] = acc
        print(f"{name}: " + ", ".join(f"{c} {acc[c]['decode_tok_s']:.1f} tok/s" for c in CONFIGS), flush=True)
    policy = engines["adaptive"].depth_policy
    return {"env": env_card(), "device": str(plain.device), "spec": dataclasses.asdict(base.spec),
            "max_new_tokens": ns.max_new_tokens, "per_domain": ns.per_domain, "rows": rows,
            "heldout_mean": heldout_mean(rows), "adaptive_step_ms": getattr(policy, "step_ms", None)}


def add_workload_args(p: argparse.ArgumentParser, per_domain: int = 2, max_new_tokens: int = 96) -> None:
    """The flags of ``workloads`` and the requests' length (this script's and bench_adaptive_policy's)."""
    p.add_argument("--per-domain", type=int, default=per_domain,
                   help="held-out prompts per domain (and GSM8K questions)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    p.add_argument("--gsm8k", default=None, help="a GSM8K jsonl (its first --per-domain questions)")
    p.add_argument("--num-random", type=int, default=2, help="prompts of 64 random token ids (drawn with --seed)")


def heldout_names(rows: dict) -> list[str]:
    """The held-out general domains among the workloads: every one but GSM8K and random ids."""
    return [n for n in rows if n not in ("gsm8k", "random ids")]


def heldout_mean(rows: dict[str, dict[str, dict]]) -> dict[str, dict[str, float | None]]:
    """Per config, the mean over the held-out general domains (every workload but GSM8K and random ids) of the
    speedup against plain and of the accept length: the issue's "held-out general chat set, mean"."""
    names = heldout_names(rows)
    out: dict[str, dict[str, float | None]] = {}
    for c in ("fixed", "adaptive"):
        sp = [rows[n][c]["speedup"] for n in names if rows[n][c]["speedup"] is not None]
        al = [rows[n][c]["accept_length"] for n in names if rows[n][c]["accept_length"] is not None]
        out[c] = {"speedup": sum(sp) / len(sp) if sp else None, "accept_length": sum(al) / len(al) if al else None,
                  "domains": len(names)}
    return out


def table(record: dict) -> str:
    lines = ["| workload | plain tok/s | fixed tok/s | fixed accept | fixed x plain | adaptive tok/s | adaptive accept "
             "| adaptive x plain |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]

    def f(x, fmt="{:.1f}"):
        return "-" if x is None else fmt.format(x)

    for name, acc in record["rows"].items():
        p, fx, ad = acc["plain"], acc["fixed"], acc["adaptive"]
        lines.append(f"| {name} | {f(p['decode_tok_s'])} | {f(fx['decode_tok_s'])} | {f(fx['accept_length'], '{:.2f}')}"
                     f" | {f(fx['speedup'], '{:.2f}')} | {f(ad['decode_tok_s'])} | {f(ad['accept_length'], '{:.2f}')}"
                     f" | {f(ad['speedup'], '{:.2f}')} |")
    mean = record.get("heldout_mean")
    if mean:
        fx, ad = mean["fixed"], mean["adaptive"]
        lines.append(f"| held-out mean ({fx['domains']} domains) | | | {f(fx['accept_length'], '{:.2f}')} | "
                     f"{f(fx['speedup'], '{:.2f}')} | | {f(ad['accept_length'], '{:.2f}')} | "
                     f"{f(ad['speedup'], '{:.2f}')} |")
    return "\n".join(lines)


def plot(record: dict, path: str) -> None:
    from baton.plotting import can_plot

    if not can_plot("--plot"):
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(record["rows"])
    x = range(len(names))
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(names)), 3.5))
    for i, c in enumerate(("fixed", "adaptive")):
        ax.bar([j + 0.4 * i - 0.2 for j in x], [record["rows"][n][c]["speedup"] or 0 for n in names], width=0.4,
               label=c)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(list(x), names, rotation=30, ha="right")
    ax.set_ylabel("decode tok/s / plain")
    ax.set_title(f"{record['spec']['algorithm']} on {record['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main(argv: list[str] | None = None) -> int:
    from baton.args import add_engine_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    add_engine_args(p)
    add_workload_args(p)
    p.add_argument("--name", default="bench_domains", help="the result file's name")
    p.add_argument("--plot", default=None, metavar="PNG", help="a bar chart of the speedups (needs matplotlib)")
    ns = p.parse_args(argv)
    record = run(ns)
    record["table"] = table(record)
    print(record["table"])
    save(ns.name, record)
    if ns.plot:
        plot(record, ns.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
