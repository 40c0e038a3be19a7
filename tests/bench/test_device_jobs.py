"""The device harness on the CPU: the job list is sound (unique names, commands that name files and modules of
this repository), and the runner lists, dry-runs, enforces time limits, fails fast on missing GPUs or carried
files, keeps to its budget and packs each job into $OUT; the GGUF-in-parts transport rebuilds and checks its
file; fetch unpacks what came back."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks.device import fetch, parts
from benchmarks.device.jobs import JOBS, NEEDS, Job
from benchmarks.device.run import check_jobs

ROOT = Path(__file__).resolve().parents[2]
EXTERNAL_MODULES = {"pytest"}
SEPARATORS = {";", "&&", "||", "|", "&", "(", ")", ";;"}


def references(cmd: str) -> list[tuple[str, str]]:
    """What a command names in this repository: ("module", X) for `python -m X`, ("path", P) for scripts run
    with python / bash and every argument that looks like a path of the repository (tests/, benchmarks/, baton/,
    --ignore=...); ``{root}/`` (ab.py's placeholder for this checkout) is dropped."""
    lex = shlex.shlex(cmd, posix=True, punctuation_chars=True)
    lex.whitespace_split = True
    tokens = [t.replace("{root}/", "") for t in lex]
    refs = []
    for i, t in enumerate(tokens):
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ""
        if t in ("python", "python3") and nxt == "-m":
            refs.append(("module", tokens[i + 2]))
        elif t.startswith("--ignore="):
            refs.append(("path", t.split("=", 1)[1]))
        elif t.split("/", 1)[0] in ("tests", "benchmarks", "baton") and "/" in t and t not in SEPARATORS:
            refs.append(("path", t.split("::", 1)[0]))
    return refs


def module_exists(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__main__.py").is_file()


def test_references_parser_finds_what_a_command_names():
    refs = references("mkdir -p $R && python3 -m benchmarks.bench_ling_flash --num-layers 18; "
                      "python3 -m pytest -q tests/engine/test_cuda_graphs.py::test_x --ignore=tests/dist "
                      "| tee $R/log; bash benchmarks/serve_bench.sh $R; python3 {root}/benchmarks/bench_tpot.py")
    assert ("module", "benchmarks.bench_ling_flash") in refs
    assert ("module", "pytest") in refs
    assert ("path", "tests/engine/test_cuda_graphs.py") in refs
    assert ("path", "tests/dist") in refs
    assert ("path", "benchmarks/serve_bench.sh") in refs
    assert ("path", "benchmarks/bench_tpot.py") in refs
    assert not module_exists("benchmarks.no_such_bench") and module_exists("baton")


def test_job_names_are_unique_and_the_list_is_sound():
    names = [j.name for j in JOBS]
    assert len(names) == len(set(names)), [n for n in names if names.count(n) > 1]
    check_jobs(JOBS, NEEDS)  # raises SystemExit on a bad list
    with pytest.raises(SystemExit, match="named twice"):
        check_jobs([JOBS[0], JOBS[0]], NEEDS)
    with pytest.raises(SystemExit, match="unknown need"):
        check_jobs([Job("x", "x", ("true",), needs=("nothing-like-it",))], NEEDS)
    for j in JOBS:
        assert j.about and j.commands and j.limit_s > 0, j.name
        assert j.background or j.limit_s <= 560, f"{j.name}: a foreground job must fit one 600 s call"
        assert all(o.startswith("{tmp}/") or not Path(o).is_absolute() for o in j.outputs), f"{j.name}: outputs " \
            "are globs under $R or {tmp}/..."


@pytest.mark.parametrize("job", JOBS, ids=lambda j: j.name)
def test_job_commands_name_files_and_modules_that_exist(job):
    refs = [r for cmd in job.commands for r in references(cmd)]
    assert refs, f"{job.name}: no command names anything in the repository"
    for kind, value in refs:
        if kind == "module":
            assert value in EXTERNAL_MODULES or module_exists(value), f"{job.name}: no module {value}"
        else:
            # a shell glob (cp baton/ops/linear/tuned/*.json ...) must match at least one file
            found = any(ROOT.glob(value)) if any(c in value for c in "*?[") else (ROOT / value).exists()
            assert found, f"{job.name}: no {value}"


# --- the runner, with fake jobs (no GPU, no device_setup) ---------------------------------------------------
FAKE_JOBS = """
from benchmarks.device.jobs import Job, Need

NEEDS = {"thing": Need(("{tmp}/big.bin",), "carry the big file")}
JOBS = [
    Job("quick", "writes a result", gpus=0, limit_s=20, outputs=("result.json", "absent.json", "{tmp}/side.txt"),
        env={"GREETING": "hello from $JOB"},
        commands=("echo $GREETING; echo '{\\"x\\": 1}' > $R/result.json; echo side > $TMP/side.txt",
                  "echo on-stderr >&2; echo gpus=$CUDA_VISIBLE_DEVICES commit=$BATON_COMMIT")),
    Job("slow", "sleeps past its limit", gpus=0, limit_s=1, grace_s=1,
        commands=("sleep 30", "touch $R/never")),
    Job("stubborn", "ignores SIGINT: killed after the grace", gpus=0, limit_s=1, grace_s=1,
        commands=("trap '' INT; sleep 30",)),
    Job("failing", "exits 3", gpus=0, limit_s=20, commands=("exit 3", "echo still-runs")),
    Job("two-gpus", "needs two GPUs", gpus=2, limit_s=20, commands=("touch $R/ran",)),
    Job("one-gpu", "needs one GPU", gpus=1, limit_s=20, commands=("echo visible=$CUDA_VISIBLE_DEVICES",)),
    Job("needy", "needs a carried file", gpus=0, limit_s=20, needs=("thing",), commands=("wc -c $TMP/big.bin",)),
    Job("long", "a limit past the budget", gpus=0, limit_s=400, commands=("touch $R/ran",)),
    Job("bg", "a background job", gpus=0, limit_s=30, background=True, outputs=("bg.txt",),
        commands=("sleep 1; echo done > $R/bg.txt",)),
]
"""


@pytest.fixture
def runner(tmp_path):
    jobs = tmp_path / "fake_jobs.py"
    jobs.write_text(FAKE_JOBS)
    env = dict(os.environ, BATON_DEVICE_TMP=str(tmp_path / "tmp"), BATON_COMMIT="abc1234")
    env.pop("OUT", None)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "root").mkdir()  # the tree the fake jobs run in (and nothing carried: no .carry/)

    def run(*args: str, gpus: int = 0, timeout: float = 60) -> subprocess.CompletedProcess:
        cmd = [sys.executable, "-m", "benchmarks.device.run", "--jobs", str(jobs), "--skip-setup", "--gpus", str(gpus),
               "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), "--root", str(tmp_path / "root"),
               *args]
        return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)

    return run


def members(tgz: Path) -> dict[str, bytes]:
    with tarfile.open(tgz) as tar:
        return {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}


def test_list_and_dry_run_of_the_real_jobs():
    env = dict(os.environ)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    out = subprocess.run([sys.executable, "-m", "benchmarks.device.run", "--list"], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    for j in JOBS:
        assert j.name in out
    dry = ["--dry-run", "--gpus", "1", "--budget-s", "800", "gpu-tests", "ling-flash-tp2", "linear-tune-ling",
           "census-smollm2"]
    out = subprocess.run([sys.executable, "-m", "benchmarks.device.run", *dry], cwd=ROOT, env=env,
                         capture_output=True, text=True, check=True).stdout
    assert "budget 800 s" in out and "## gpu-tests: would start by 0 s" in out
    assert "python3 -m pytest" in out and "export BATON_TEST_REPORT=" in out
    assert "## ling-flash-tp2: would not start: failed: needs 2 GPU(s), this machine has 1" in out
    assert "## linear-tune-ling: would not start" in out  # 480 + 480 s past the 800 s budget
    assert "## census-smollm2: would start by 480 s" in out
    bad = subprocess.run([sys.executable, "-m", "benchmarks.device.run", "no-such-job"], cwd=ROOT, env=env,
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown job" in bad.stderr


def test_runner_runs_records_and_packs_a_job(runner, tmp_path):
    r = runner("quick")
    assert r.returncode == 0, r.stdout + r.stderr
    files = members(tmp_path / "out" / "quick.tgz")
    assert {f"quick/{m}" for m in ("command.txt", "commit.txt", "gpu.txt", "log.txt", "job.json", "result.json",
                                   "side.txt")} <= set(files)
    assert files["quick/commit.txt"].decode().strip() == "abc1234"
    log = files["quick/log.txt"].decode()
    assert "hello from quick" in log and "on-stderr" in log and "commit=abc1234" in log
    command = files["quick/command.txt"].decode()
    assert "echo $GREETING" in command and "export GREETING='hello from quick'" in command
    rec = json.loads(files["quick/job.json"])
    assert rec["status"] == "ok" and rec["rc"] == 0 and len(rec["commands"]) == 2
    assert rec["missing_outputs"] == ["absent.json"]
    assert json.loads(files["quick/result.json"]) == {"x": 1}
    session = json.loads((tmp_path / "out" / "session.json").read_text())
    assert session["files"] == ["quick.tgz"] and session["jobs"]["quick"]["status"] == "ok"


def test_runner_enforces_the_time_limit(runner, tmp_path):
    t0 = time.monotonic()
    r = runner("slow", "stubborn")
    wall = time.monotonic() - t0
    assert r.returncode == 1
    assert wall < 15, f"the 1 s limits took {wall:.1f} s"
    slow = json.loads(members(tmp_path / "out" / "slow.tgz")["slow/job.json"])
    assert slow["status"] == "timed out" and slow["timed_out"] and slow["commands"][0]["timed_out"]
    assert slow["commands"][0]["wall_s"] < 5
    assert slow["skipped_commands"] == ["touch $R/never"] and not (tmp_path / "work" / "slow" / "never").exists()
    stubborn = json.loads(members(tmp_path / "out" / "stubborn.tgz")["stubborn/job.json"])
    assert stubborn["status"] == "timed out" and stubborn["rc"] == -9  # SIGINT ignored: SIGKILL after the grace


def test_runner_records_a_failure_and_goes_on(runner, tmp_path):
    r = runner("failing", "quick")
    assert r.returncode == 1
    rec = json.loads(members(tmp_path / "out" / "failing.tgz")["failing/job.json"])
    assert rec["status"] == "failed" and rec["rc"] == 3 and [c["rc"] for c in rec["commands"]] == [3, 0]
    assert (tmp_path / "out" / "quick.tgz").is_file()


def test_runner_fails_fast_without_the_gpus_or_the_carried_files(runner, tmp_path):
    r = runner("two-gpus", "needy", "one-gpu", gpus=1)
    assert r.returncode == 1
    session = json.loads((tmp_path / "out" / "session.json").read_text())["jobs"]
    assert session["two-gpus"]["status"] == "failed" and "needs 2 GPU(s), this machine has 1" in \
        session["two-gpus"]["message"]
    assert not (tmp_path / "work" / "two-gpus" / "ran").exists()
    assert session["needy"]["status"] == "waiting" and "carry the big file" in session["needy"]["message"]
    assert session["one-gpu"]["status"] == "ok"
    assert "visible=0" in members(tmp_path / "out" / "one-gpu.tgz")["one-gpu/log.txt"].decode()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["one-gpu.tgz", "session.json"]


def test_runner_starts_no_job_past_its_budget(runner, tmp_path):
    r = runner("--budget-s", "100", "long", "quick")
    assert r.returncode == 1
    session = json.loads((tmp_path / "out" / "session.json").read_text())["jobs"]
    assert session["long"]["status"] == "not started" and "does not fit" in session["long"]["message"]
    assert session["quick"]["status"] == "ok"
    assert not (tmp_path / "work" / "long").exists()


def test_runner_runs_a_background_job_and_collects_it(runner, tmp_path):
    r = runner("bg", "quick")
    assert r.returncode == 0, r.stdout + r.stderr
    files = members(tmp_path / "out" / "bg.tgz")
    assert files["bg/bg.txt"].decode().strip() == "done"
    assert json.loads(files["bg/job.json"])["status"] == "ok"
    r = runner("bg")  # finished in an earlier call: packed again, not rerun
    assert "finished in an earlier call" in r.stdout and (tmp_path / "out" / "bg.tgz").is_file()


def test_the_runner_rebuilds_a_file_sent_in_parts(runner, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(50_000))
    here = tmp_path / "here"
    dirs = parts.split(big, 3, root=here)
    assert [(d / "part.json").is_file() for d in dirs] == [True] * 3
    assert sum((d / "part").stat().st_size for d in dirs) == big.stat().st_size
    device, tmp = tmp_path / "device", tmp_path / "tmp"
    (device / ".carry").mkdir(parents=True)
    for i, d in enumerate(dirs):  # one part a call, out of order
        (device / ".carry" / d.name).mkdir()
        for f in d.iterdir():
            (device / ".carry" / d.name / f.name).write_bytes(f.read_bytes())
        got = parts.collect(device, tmp)
        if i < 2:
            assert "big.bin" in got.incomplete and not (tmp / "big.bin").exists()
            hint = got.missing_hint(str(tmp / "big.bin"))
            assert hint and f".carry/part{i + 1}" in hint
        else:
            assert got.rebuilt == ["big.bin"]
    assert (tmp / "big.bin").read_bytes() == big.read_bytes()
    assert parts.collect(device, tmp).rebuilt == []  # once only


def test_parts_reject_a_bad_sha256_and_gunzip_data(tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(10_000))
    here = tmp_path / "here"
    dirs = parts.split(big, 2, root=here)
    (dirs[1] / "part").write_bytes(b"x" * (dirs[1] / "part").stat().st_size)  # damaged on the way
    data = tmp_path / "gsm8k"
    data.mkdir()
    (data / "test.jsonl").write_text('{"question": "1 + 1"}\n' * 10_000)
    parts.add([data], root=here)
    assert (here / ".carry" / "data" / "files" / "gsm8k" / "test.jsonl.gz").is_file()
    tmp = tmp_path / "tmp"
    got = parts.collect(here, tmp)
    assert not (tmp / "big.bin").exists() and any("sha256 does not match" in m for m in got.messages)
    assert (tmp / "gsm8k" / "test.jsonl").read_text() == (data / "test.jsonl").read_text()


def test_waiting_job_names_the_parts_to_carry_next(runner, tmp_path):
    big = tmp_path / "big.bin"
    big.write_bytes(os.urandom(9_000))
    dirs = parts.split(big, 3, root=tmp_path / "here")
    (tmp_path / "tmp" / "parts" / "big.bin").mkdir(parents=True)
    meta = json.loads((dirs[0] / "part.json").read_text())
    (tmp_path / "tmp" / "parts" / "big.bin" / "manifest.json").write_text(json.dumps(meta))
    (tmp_path / "tmp" / "parts" / "big.bin" / "000").write_bytes((dirs[0] / "part").read_bytes())
    runner("needy")
    msg = json.loads((tmp_path / "out" / "session.json").read_text())["jobs"]["needy"]["message"]
    assert "1 of 3 parts of big.bin" in msg and ".carry/part1, .carry/part2" in msg


def test_fetch_unpacks_into_results(runner, tmp_path):
    runner("quick", "slow")
    dest = tmp_path / "results"
    assert fetch.main([str(tmp_path / "out"), "--dest", str(dest), "--date", "2026-12-02"]) == 0
    got = dest / "quick-2026-12-02"
    assert (got / "result.json").is_file() and (got / "command.txt").is_file()
    assert (got / "commit.txt").read_text().strip() == "abc1234"
    assert json.loads((dest / "slow-2026-12-02" / "job.json").read_text())["status"] == "timed out"
    fetch.main([str(tmp_path / "out"), "--dest", str(dest), "--date", "2026-12-02"])  # the same run: replaced
    assert sorted(p.name for p in dest.iterdir()) == ["quick-2026-12-02", "slow-2026-12-02"]
    runner("quick")  # another run of quick: beside the first
    fetch.main([str(tmp_path / "out"), "--dest", str(dest), "--date", "2026-12-02"])
    assert (dest / "quick-2026-12-02-2" / "job.json").is_file()


def test_fetch_joins_a_split_archive(tmp_path):
    payload = tmp_path / "src" / "big"
    payload.mkdir(parents=True)
    (payload / "job.json").write_text('{"status": "ok", "started": "t"}')
    (payload / "blob.bin").write_bytes(os.urandom(3000))
    tgz = tmp_path / "big.tgz"
    with tarfile.open(tgz, "w:gz") as tar:
        tar.add(payload, arcname="big")
    blob = tgz.read_bytes()
    out = tmp_path / "out"
    out.mkdir()
    for i in range(0, len(blob), 1000):
        (out / f"big.tgz.{i // 1000:03d}").write_bytes(blob[i:i + 1000])
    fetch.main([str(out), "--into", str(tmp_path / "res")])
    assert (tmp_path / "res" / "big" / "blob.bin").read_bytes() == (payload / "blob.bin").read_bytes()
