"""Before / after on one GPU: the same command in two source trees, alternating, so drift between rounds shows
as a difference between rounds rather than between trees (the ab-* jobs of benchmarks/device/jobs.py).

    python -m benchmarks.device.ab [--trees .old .new] [--rounds N] -- CMD ...
    python -m benchmarks.device.ab --summary ab.jsonl     # bench_tpot.py's records: one line each

Each run's working directory is the tree (made here by ``python -m benchmarks.device.parts trees OLD NEW``),
with only that tree's ``baton`` importable (PYTHONPATH: the tree, then the carried wheels; not this checkout),
BATON_COMMIT from its commit.txt and OUT=$OUT/<old|new>/ (what ``benchmarks.common.save`` writes stays apart).
In CMD, ``{tree}`` becomes old / new and ``{root}`` this checkout (to run its script in both trees). Exit status:
the first failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_in_tree(tree: Path, cmd: list[str]) -> int:
    label = tree.name.lstrip(".")
    env = dict(os.environ)
    keep = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([str(tree), *keep])  # this checkout's baton out of the way
    env["BATON_COMMIT"] = (tree / "commit.txt").read_text().strip()
    out = Path(env.get("OUT", "/tmp/out")) / label
    out.mkdir(parents=True, exist_ok=True)
    env["OUT"] = str(out)
    argv = [a.replace("{tree}", label).replace("{root}", str(ROOT)) for a in cmd]
    print(f"== {label} ({env['BATON_COMMIT']}): {' '.join(argv)}", flush=True)
    return subprocess.run(argv, cwd=tree, env=env).returncode


def summary(path: Path) -> None:
    for line in path.read_text().splitlines():
        r = json.loads(line)
        t = r["tpot_ms"]
        print(f"{r['label']:28s} {r['commit']:>12s}  TPOT ms median {t['median']:.4f} min {t['min']:.4f} "
              f"max {t['max']:.4f}  accept {r['accept_length']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs=2, default=[Path(".old"), Path(".new")], type=Path)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--summary", type=Path, default=None, help="print bench_tpot.py's JSON lines in FILE")
    ap.add_argument("cmd", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    if args.summary:
        summary(args.summary)
        return 0
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        ap.error("no command after --")
    status = 0
    for _ in range(args.rounds):
        for tree in args.trees:
            rc = run_in_tree(tree.resolve(), cmd)
            status = status or rc
    return status


if __name__ == "__main__":
    sys.exit(main())
