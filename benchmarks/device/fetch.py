"""Back here after a device call: unpack the <job>.tgz files the call returned (the run tool's files_at folder)
into benchmarks/results/<job>-<date>/, each with the command.txt, commit.txt, gpu.txt, log.txt and job.json the
runner wrote beside its results.

    python -m benchmarks.device.fetch FILES_AT                       # benchmarks/results/<job>-<date>/
    python -m benchmarks.device.fetch FILES_AT --into benchmarks/results/h200-2026-12-02   # .../<job>/

A job fetched again (a background job's later snapshot) replaces its earlier copy when job.json names the same
start; another run of the same job on the same day goes to <job>-<date>-2, -3, ... The call's session.json (which
jobs did not start, or wait for a carried file) is printed, not kept.
"""

from __future__ import annotations

import argparse
import io
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parents[2]


def archives(folder: Path) -> dict[str, bytes]:
    """{job: its .tgz's bytes}: <job>.tgz, or <job>.tgz.000, .001, ... joined in order."""
    found: dict[str, list[Path]] = {}
    for p in sorted(folder.rglob("*.tgz*")):
        name, _, part = p.name.partition(".tgz")
        if part == "" or (part[1:].isdigit() and part.startswith(".")):
            found.setdefault(name, []).append(p)
    return {name: b"".join(p.read_bytes() for p in sorted(ps)) for name, ps in found.items()}


def _started(d: Path) -> str | None:
    try:
        return json.loads((d / "job.json").read_text()).get("started")
    except (OSError, ValueError):
        return None


def unpack(job: str, blob: bytes, target: Path) -> Path:
    """Extract ``blob`` (members under ``<job>/``) into ``target``, refusing paths that leave it."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        members = [m for m in tar.getmembers() if m.isfile()]
        for m in members:
            rel = PurePosixPath(m.name)
            if rel.is_absolute() or ".." in rel.parts or rel.parts[:1] != (job,):
                raise SystemExit(f"{job}.tgz: refusing the member {m.name!r}")
        shutil.rmtree(target, ignore_errors=True)
        for m in members:
            dest = target.joinpath(*PurePosixPath(m.name).parts[1:])
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(tar.extractfile(m).read())
    return target


def place(job: str, blob: bytes, dest: Path, date: str, into: Path | None) -> Path:
    """Where ``job``'s results go: into/<job>, or dest/<job>-<date>[-N] (the same run replaces its copy)."""
    if into is not None:
        return into / job
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:gz") as tar:
        try:
            started = json.loads(tar.extractfile(f"{job}/job.json").read()).get("started")
        except (KeyError, ValueError):
            started = None
    n = 1
    while True:
        target = dest / (f"{job}-{date}" if n == 1 else f"{job}-{date}-{n}")
        if not target.exists() or (started is not None and _started(target) == started):
            return target
        n += 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files_at", type=Path, help="the folder the run tool's reply names as files_at")
    ap.add_argument("--dest", type=Path, default=ROOT / "benchmarks" / "results")
    ap.add_argument("--into", type=Path, default=None, help="put each job in INTO/<job>/ instead")
    ap.add_argument("--date", default=time.strftime("%Y-%m-%d"))
    args = ap.parse_args(argv)
    blobs = archives(args.files_at)
    if not blobs:
        print(f"no <job>.tgz in {args.files_at}")
    for job, blob in blobs.items():
        target = unpack(job, blob, place(job, blob, args.dest, args.date, args.into))
        try:
            rec = json.loads((target / "job.json").read_text())
        except (OSError, ValueError):
            rec = {}
        commit = (target / "commit.txt").read_text().strip() if (target / "commit.txt").is_file() else "?"
        print(f"{job:24s} {rec.get('status', '?'):10s} rc {rec.get('rc')!s:5s} commit {commit:12s} -> {target}")
    session = next(args.files_at.rglob("session.json"), None)
    if session is not None:
        for name, r in json.loads(session.read_text()).get("jobs", {}).items():
            if name not in blobs:
                print(f"{name:24s} {r.get('status', '?'):10s} {r.get('message') or ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
