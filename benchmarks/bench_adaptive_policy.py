"""The adaptive depth policy against real acceptance: record what a drafter accepts at its full depth, step by step,
over the held-out domains (the prompts of benchmarks/bench_domains.py), then replay those traces through depth
policies with a device's step times, with no model in the loop.

    python -m benchmarks.bench_adaptive_policy record --speculative-algorithm NEXTN --speculative-num-steps 3 \\
        --speculative-num-draft-tokens 4 --per-domain 3 --max-new-tokens 128 --name traces_nextn
    python -m benchmarks.bench_adaptive_policy replay benchmarks/results/<dir>/traces_nextn.json \\
        --step-ms h200=benchmarks/results/h200-2026-12-07-finetune/finetune-drafts/train/domains_nextn.json \\
        --step-ms cpu=0:5.05,1:11.39,2:15.14,3:18.83 --variant slow:decay=0.05

``record`` runs one engine at the full depth (``--speculative-adaptive off``) and keeps, per request, the accepted
count of every verify step and the step's start position. Greedy acceptance does not depend on the device, so a
CPU recording serves every device's replay. ``replay`` (``baton.speculative.adaptive.replay``) decodes each trace
again under each policy: at position n a step at depth d accepts min(a(n), d), where a(n) is what the full-depth
run accepted from n (a position inside an accepted run of the recording accepts the rest of that run); it costs
t(d) from the device's table (``--step-ms``: a bench_domains JSON's ``adaptive_step_ms`` or ``depth:ms`` pairs).
The table: tokens per ms against plain decoding for plain, each fixed depth, the best fixed depth of each workload
(an oracle no policy can beat on average), and each adaptive variant (``--variant NAME:key=value,...``: keyword
arguments of ``AdaptiveDepth``; "adaptive" is the shipped default). One JSON (``save``: $OUT or
benchmarks/results) and the markdown tables.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable (benchmarks.common)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_card, save  # noqa: E402


class Recorder:
    """A FixedDepth policy that keeps each request's (depth, accepted) steps."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.requests: list[list[int]] = []

    def begin_request(self) -> None:
        self.requests.append([])

    def choose(self) -> int:
        return self.max_depth

    def observe(self, depth: int, accepted: int) -> None:
        self.requests[-1].append(accepted)

    def observe_time(self, depth: int, step_ms: float) -> None:
        pass


def record(ns: argparse.Namespace) -> dict:
    from baton.args import server_args_from
    from baton.engine.engine import Engine
    from benchmarks.bench_domains import workloads
    from benchmarks.common import timed_request

    args = server_args_from(ns)
    if not args.spec.enabled:
        raise SystemExit("no drafter: pass --speculative-algorithm (the embedded model has its shipped drafts)")
    args = dataclasses.replace(args, spec=dataclasses.replace(args.spec, adaptive=False))
    engine = Engine(args)
    rec = Recorder(engine.program.max_depth)
    engine.set_depth_policy(rec)
    loads = workloads(engine.tokenizer, engine.model_config.vocab_size, ns.per_domain, ns.gsm8k, ns.num_random,
                      ns.seed)
    traces: dict[str, list[dict]] = {}
    for name, prompts in loads.items():
        traces[name] = []
        for ids in prompts:
            r = timed_request(engine, ids, ns.max_new_tokens, ignore_eos=False)
            traces[name].append({"tokens": r["output_tokens"], "accepted": rec.requests[-1]})
        steps = sum(len(t["accepted"]) for t in traces[name])
        toks = sum(t["tokens"] for t in traces[name])
        print(f"{name}: {len(prompts)} requests, {toks} tokens, {steps} steps, accept {toks / max(1, steps):.2f}",
              flush=True)
    return {"env": env_card(), "device": str(engine.device), "spec": dataclasses.asdict(args.spec),
            "max_depth": engine.program.max_depth, "max_new_tokens": ns.max_new_tokens, "traces": traces}


def step_table(spec: str) -> dict[int, float]:
    """``depth:ms,...`` or a JSON file with ``adaptive_step_ms`` (benchmarks/bench_domains.py)."""
    if Path(spec).is_file():
        return {int(d): float(t) for d, t in json.loads(Path(spec).read_text())["adaptive_step_ms"].items()}
    return {int(d): float(t) for d, t in (kv.split(":") for kv in spec.split(","))}


def parse_variant(spec: str) -> tuple[str, dict]:
    name, _, kvs = spec.partition(":")
    kw = {}
    for kv in filter(None, kvs.split(",")):
        k, v = kv.split("=")
        kw[k] = None if v == "none" else (int(v) if v.isdigit() else float(v))
    return name, kw


def replay_all(rec: dict, tables: dict[str, dict[int, float]], variants: dict[str, dict]) -> dict:
    from baton.speculative.adaptive import AdaptiveDepth, FixedDepth, replay
    from benchmarks.bench_domains import heldout_names

    out: dict[str, dict] = {}
    for dev, step_ms in tables.items():
        depths = sorted(step_ms)
        if depths[-1] != rec["max_depth"]:
            raise SystemExit(f"--step-ms {dev}: depths {depths} end below the traces' full depth {rec['max_depth']}")
        rows: dict[str, dict[str, float]] = {}
        for name, reqs in rec["traces"].items():
            plain = sum(t["tokens"] - 1 for t in reqs) * step_ms[0]  # ms: a step a token after the first
            row = {}
            for d in depths[1:]:
                row[f"fixed {d}"] = plain / sum(replay(FixedDepth(d), t["accepted"], t["tokens"], step_ms)[1]
                                                for t in reqs)
            row["best fixed"] = max([1.0] + [row[f"fixed {d}"] for d in depths[1:]])
            for vname, kw in variants.items():
                policy = AdaptiveDepth(depths, step_ms, **kw)  # one policy over the workload: it carries across
                row[vname] = plain / sum(replay(policy, t["accepted"], t["tokens"], step_ms)[1] for t in reqs)
            rows[name] = row
        held = heldout_names(rows)
        cols = list(next(iter(rows.values())))
        rows["held-out mean"] = {c: sum(rows[n][c] for n in held) / len(held) for c in cols}
        out[dev] = {"step_ms": step_ms, "x_plain": rows}
    return out


def tables_md(result: dict) -> str:
    parts = []
    for dev, r in result.items():
        rows = r["x_plain"]
        cols = list(next(iter(rows.values())))
        lines = [f"{dev} (step ms {r['step_ms']}): tokens per ms against plain decoding",
                 "| workload | " + " | ".join(cols) + " |", "| --- |" + " --- |" * len(cols)]
        lines += [f"| {n} | " + " | ".join(f"{row[c]:.3f}" for c in cols) + " |" for n, row in rows.items()]
        parts.append("\n".join(lines))
    return "\n\n".join(parts)


def main(argv: list[str] | None = None) -> int:
    from baton.args import add_engine_args
    from benchmarks.bench_domains import add_workload_args

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="traces of accepted counts at the full depth over the domains")
    add_engine_args(r)
    add_workload_args(r, per_domain=3, max_new_tokens=128)
    r.add_argument("--name", default="adaptive_traces", help="the result file's name")
    y = sub.add_parser("replay", help="the traces through the depth policies with each device's step times")
    y.add_argument("traces", help="a JSON written by `record`")
    y.add_argument("--step-ms", action="append", required=True, metavar="DEVICE=TABLE",
                   help="DEVICE=depth:ms,... or DEVICE=<bench_domains JSON> (its adaptive_step_ms); repeatable")
    y.add_argument("--variant", action="append", default=[], metavar="NAME:key=value,...",
                   help="an AdaptiveDepth with these keyword arguments beside the default ('adaptive')")
    y.add_argument("--name", default="adaptive_replay", help="the result file's name")
    ns = p.parse_args(argv)
    if ns.cmd == "record":
        save(ns.name, record(ns))
        return 0
    rec = json.loads(Path(ns.traces).read_text())
    tables = dict((dev, step_table(spec)) for dev, spec in (s.split("=", 1) for s in ns.step_ms))
    variants = {"adaptive": {}} | dict(parse_variant(v) for v in ns.variant)
    result = replay_all(rec, tables, variants)
    md = tables_md(result)
    print(md)
    save(ns.name, {"env": env_card(), "traces": ns.traces, "variants": variants, "result": result, "table": md})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
