"""A/B of ``--speculative-token-map`` on the embedded model: two engines (the NEXTN drafts over the whole vocabulary,
and over the map), fixed depth, the same greedy request alternating between them; the decode time per verify
step, decode tok/s and the accept length of each (medians over the repeats).

    python -m benchmarks.bench_token_map --token-map runs/smollm2/token_map.pt --device cpu
    python -m benchmarks.bench_token_map --token-map map.pt --num-steps 3 --max-new-tokens 96 --repeats 6

Output is the same token for token (the verify is over the whole vocabulary), so only the step cost and the
drafts can differ. One JSON (``save``: $OUT or benchmarks/results).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a file: make the repository root importable (benchmarks.common)
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import env_card, save, timed_request  # noqa: E402

PROMPT = "Write a short story about a robot who learns to paint."


def main(argv: list[str] | None = None) -> int:
    from baton.config import ServerArgs, SpecConfig
    from baton.engine.engine import Engine
    from baton.speculative.shipped import shipped_draft

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--token-map", required=True, help="the map (`baton train token-map`)")
    p.add_argument("--draft-model-path", default=None, help="the NEXTN head (default: the shipped one)")
    p.add_argument("--num-steps", type=int, default=3)
    p.add_argument("--device", default=None)
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=96)
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--name", default="token_map_ab")
    ns = p.parse_args(argv)
    draft = ns.draft_model_path or shipped_draft("NEXTN")

    def engine(**kw):
        return Engine(ServerArgs(device=ns.device, spec=SpecConfig(algorithm="NEXTN", num_steps=ns.num_steps,
                                                                   adaptive=False, draft_model_path=draft, **kw)))

    engines = {"full vocabulary": engine(), "token map": engine(token_map=ns.token_map)}
    first = engines["full vocabulary"]
    ids = first.tokenizer.encode(first.tokenizer.apply_chat_template([{"role": "user", "content": ns.prompt}]))
    for e in engines.values():
        timed_request(e, ids, 16, ignore_eos=True)  # warm-up
    runs: dict[str, list[dict]] = {k: [] for k in engines}
    for _ in range(ns.repeats):
        for name, e in engines.items():
            r = timed_request(e, ids, ns.max_new_tokens, ignore_eos=True)
            dec = r["latency_s"] - r["ttft_ms"] / 1e3
            runs[name].append({"step_ms": 1e3 * dec / r["verify_steps"], "decode_tok_s": (r["output_tokens"] - 1) / dec,
                               "accept_length": r["output_tokens"] / r["verify_steps"]})
    rows = {name: {k: statistics.median(x[k] for x in v) for k in v[0]} for name, v in runs.items()}
    for name, r in rows.items():
        print(f"{name}: step {r['step_ms']:.2f} ms, {r['decode_tok_s']:.1f} tok/s, accept {r['accept_length']:.2f}")
    save(ns.name, {"env": env_card(), "device": str(first.device), "token_map": ns.token_map, "draft": draft,
                   "num_steps": ns.num_steps, "max_new_tokens": ns.max_new_tokens, "repeats": ns.repeats,
                   "draft_lm_head_bytes": {k: e.model.draft_lm_head_bytes() for k, e in engines.items()},
                   "median": rows, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
