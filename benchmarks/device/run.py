"""The device runner: runs named jobs of benchmarks/device/jobs.py on the GPU machine and packs each one's results
into $OUT/<job>.tgz (the device returns at most 8 files: one a job, and session.json).

    python3 -m benchmarks.device.run JOB [JOB ...]     # in the repository root on the device machine
    python3 -m benchmarks.device.run --list             # the jobs: GPUs, limit, needs, what each measures
    python3 -m benchmarks.device.run --dry-run JOB ...  # what would run (commands, env, GPUs, needs), running nothing

In order, once a call: what the call carried is taken in (benchmarks/device/parts.py: the GGUF's parts, rebuilt
when the last arrives; data files), benchmarks/device_setup.sh runs (the carried wheels; skip with --skip-setup),
the commit is read (BATON_COMMIT, else .whl/commit.txt). Then each job, in the order named, on its own GPUs:

- a job needing more GPUs than the machine has, or something not carried yet (its ``needs``), fails at once with
  what to do;
- a job starts only when its whole time limit fits what is left of --budget-s (default 570 of the call's 600 s);
  the rest are listed as not started, for the next call;
- its commands run in bash from the repository root, in order, stdout and stderr in log.txt; at the limit the
  running one gets the job's stop signal (SIGINT: pytest prints its failures), SIGKILL ``grace_s`` later, and the
  job is recorded as timed out;
- its result folder (--work, default /tmp/baton-jobs/<job>, kept while the machine is warm) gets command.txt (the
  exact commands and env), commit.txt, gpu.txt (nvidia-smi before and after), log.txt, job.json (rc, wall time,
  each command's rc, missing outputs) and its outputs; it is packed into $OUT/<job>.tgz as soon as it ends (split
  into <job>.tgz.000, .001, ... over 15 MiB).

--parallel runs jobs side by side on free GPUs (in the order named; a job waits until its GPUs are free).
Background jobs (training) start detached in a copy of the tree and go on after the call; naming one again in
the next call waits for it while the budget lasts and packs what it has. Back here,
``python -m benchmarks.device.fetch`` unpacks the files into benchmarks/results/<job>-<date>/.
"""

from __future__ import annotations

import argparse
import glob
import importlib
import importlib.util
import io
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from string import Template

from benchmarks.device import parts
from benchmarks.device.jobs import Job, Need

ROOT = Path(__file__).resolve().parents[2]
META = ("command.txt", "commit.txt", "gpu.txt", "log.txt", "job.json")
MAX_FILES = 8  # files the device returns
PART_BYTES = 15 * 2**20  # a .tgz over this is split (16 MiB a file come back)
PACK_RESERVE_S = 10  # kept at the end of the budget for packing
SIGNALS = {"INT": signal.SIGINT, "TERM": signal.SIGTERM, "ABRT": signal.SIGABRT}
STARTED = ("ok", "failed", "timed out", "running")
TREE_IGNORE = shutil.ignore_patterns(".git", ".carry", ".whl", ".old", ".new", ".parts", "__pycache__",
                                     ".pytest_cache", ".ruff_cache", "*.egg-info", ".venv*")


# --- the job list ----------------------------------------------------------------------------------------------
def check_jobs(jobs: list[Job], needs: dict[str, Need]) -> None:
    """A job list the runner can use: unique names of [a-z0-9-], known needs and signals, sane numbers."""
    problems, seen = [], set()
    for j in jobs:
        if j.name in seen:
            problems.append(f"{j.name}: named twice")
        seen.add(j.name)
        if not j.name or any(c not in "abcdefghijklmnopqrstuvwxyz0123456789-" for c in j.name):
            problems.append(f"{j.name!r}: a name of a-z, 0-9 and '-' only (it names files)")
        if not j.commands or not all(isinstance(c, str) and c.strip() for c in j.commands):
            problems.append(f"{j.name}: no commands")
        if j.gpus < 0 or j.limit_s <= 0 or j.grace_s < 0:
            problems.append(f"{j.name}: gpus >= 0, limit_s > 0, grace_s >= 0")
        if j.stop_signal not in SIGNALS:
            problems.append(f"{j.name}: stop_signal one of {', '.join(SIGNALS)}")
        problems += [f"{j.name}: unknown need {n!r}" for n in j.needs if n not in needs]
    if problems:
        raise SystemExit("bad job list:\n  " + "\n  ".join(problems))


def load_jobs(spec: str) -> tuple[dict[str, Job], dict[str, Need]]:
    """The jobs of a module (benchmarks.device.jobs) or a .py file (the tests' fake jobs): its JOBS and NEEDS."""
    from benchmarks.device import jobs as default

    if spec.endswith(".py"):
        loader = importlib.util.spec_from_file_location("device_jobs", spec)
        mod = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(mod)
    else:
        mod = importlib.import_module(spec)
    needs = getattr(mod, "NEEDS", default.NEEDS)
    check_jobs(mod.JOBS, needs)
    return {j.name: j for j in mod.JOBS}, needs


# --- the machine -----------------------------------------------------------------------------------------------
def gpu_ids(override: int | None) -> list[str]:
    """The GPUs jobs may use: CUDA_VISIBLE_DEVICES' entries when set, else nvidia-smi's; --gpus N keeps the first
    N (or N fake ones where there is no GPU: the tests)."""
    visible = [v for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if override is not None:
        return (visible + [str(i) for i in range(len(visible), override)])[:override]
    if visible:
        return visible
    if shutil.which("nvidia-smi") is None:
        return []
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi: not on this machine\n"
    query = "index,name,driver_version,memory.used,memory.total,clocks.sm,clocks.mem,temperature.gpu"
    r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"], capture_output=True, text=True)
    return r.stdout + r.stderr


def read_commit(root: Path) -> str:
    if os.environ.get("BATON_COMMIT"):
        return os.environ["BATON_COMMIT"]
    f = root / ".whl" / "commit.txt"
    return f.read_text().strip() if f.is_file() else "unknown"


def device_setup(root: Path) -> None:
    """Source benchmarks/device_setup.sh (the wheels into /tmp/site, PYTHONPATH, the `baton` script, the NCCL
    switches) and keep the environment it leaves, for every job of this call."""
    script = root / "benchmarks" / "device_setup.sh"
    r = subprocess.run(["bash", "-c", f"source {shlex.quote(str(script))} >&2 && env -0"], cwd=root,
                       capture_output=True)
    if r.returncode != 0:
        raise SystemExit(f"device_setup.sh failed:\n{r.stderr.decode(errors='replace')}")
    for item in r.stdout.decode().split("\0"):
        key, sep, value = item.partition("=")
        if sep and key not in ("_", "SHLVL", "PWD", "OLDPWD") and os.environ.get(key) != value:
            os.environ[key] = value


def run_command(cmd: str, env: dict, cwd: Path, timeout: float, sig: int, grace: float, log) -> tuple[int, bool]:
    """One command in bash, in its own process group, output to ``log``: (rc, timed out). At ``timeout`` the
    group gets ``sig``, then SIGKILL ``grace`` s later; whatever it left running is killed when it ends."""
    p = subprocess.Popen(["bash", "-o", "pipefail", "-c", cmd], cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    timed_out = False
    try:
        p.wait(timeout=max(timeout, 0.01))
    except subprocess.TimeoutExpired:
        timed_out = True
        _kill_group(p.pid, sig)
        try:
            p.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            _kill_group(p.pid, signal.SIGKILL)
            p.wait()
    finally:
        _kill_group(p.pid, signal.SIGKILL)  # a server or a `cmd &` the command left behind
        if p.poll() is None:
            p.kill()
            p.wait()
    return p.returncode, timed_out


def _kill_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie (finished, not reaped) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


# --- one session -----------------------------------------------------------------------------------------------
class Session:
    def __init__(self, args: argparse.Namespace, jobs: dict[str, Job], needs: dict[str, Need]):
        self.args, self.jobs, self.needs = args, jobs, needs
        self.root = Path(args.root).resolve() if args.root else ROOT
        self.tmp = parts.tmp_root()
        self.work = Path(args.work) if args.work else self.tmp / "baton-jobs"
        self.out = Path(args.out or os.environ.get("OUT") or self.tmp / "out")
        self.t0 = time.monotonic()
        self.lock = threading.Lock()
        self.results: dict[str, dict] = {}
        self.commit = "unknown"
        self.collected = parts.Collected()
        self.background: dict[str, subprocess.Popen] = {}
        self.files: list[str] = []

    # -- small things
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def say(self, msg: str) -> None:
        with self.lock:
            print(f"[{self.elapsed():4.0f} s] {msg}", flush=True)

    def path(self, p: str) -> Path:
        """A need's or output's path: {tmp} is the device's scratch folder, relative paths are under the root."""
        q = Path(p.replace("{tmp}", str(self.tmp)))
        return q if q.is_absolute() else self.root / q

    def job_env(self, job: Job, d: Path, gpus: list[str]) -> dict[str, str]:
        env = dict(os.environ)
        if self.root != ROOT:  # a background job's copy of the tree, not the checkout the next call overwrites
            env["PYTHONPATH"] = os.pathsep.join(str(self.root) if p and Path(p).resolve() == ROOT else p
                                                for p in env.get("PYTHONPATH", "").split(os.pathsep))
        base = {"R": str(d), "OUT": str(d), "JOB": job.name, "TMP": str(self.tmp), "BATON_COMMIT": self.commit,
                "PYTHONUNBUFFERED": "1"}
        if job.gpus:
            base["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env.update(base)
        for key, value in job.env.items():
            env[key] = Template(value).safe_substitute(base)
        return env

    def describe(self, job: Job, gpus: list[str], d: Path) -> str:
        """command.txt: the job as a script one could paste (the env the runner set, then the commands)."""
        env = self.job_env(job, d, gpus)
        shown = ["R", "OUT", "JOB", "TMP", "BATON_COMMIT", "CUDA_VISIBLE_DEVICES", *job.env]
        lines = [f"# {job.name}: {job.about}",
                 f"# {job.gpus} GPU(s) ({','.join(gpus) or 'none'}), limit {job.limit_s} s (SIG{job.stop_signal}, "
                 f"SIGKILL {job.grace_s} s later), needs: {', '.join(job.needs) or 'nothing carried'}",
                 f"# outputs: {', '.join(job.outputs) or '-'}",
                 f"cd {shlex.quote(str(self.root))}",
                 "source benchmarks/device_setup.sh  # (the runner sources it once a call)"]
        lines += [f"export {k}={shlex.quote(env[k])}" for k in dict.fromkeys(shown) if k in env]
        return "\n".join(lines + list(job.commands)) + "\n"

    def blocker(self, job: Job, ngpus: int) -> tuple[str, str] | None:
        """Why ``job`` cannot start on this machine now: (status, message), or None."""
        if job.gpus > ngpus:
            kind = "nvidia-h200" if job.gpus == 1 else f"nvidia-h200-x{job.gpus}"
            return "failed", (f"needs {job.gpus} GPU(s), this machine has {ngpus}: run it on a machine of "
                              f"{job.gpus} GPUs (the run tool's kind {kind})")
        for name in job.needs:
            missing = [str(self.path(p)) for p in self.needs[name].paths if not self.path(p).exists()]
            if missing:
                hint = next((h for p in missing if (h := self.collected.missing_hint(p))), None)
                return "waiting", f"needs {name} ({', '.join(missing)} not here): {hint or self.needs[name].how}"
        return None

    # -- running a job
    def execute(self, job: Job, d: Path, gpus: list[str]) -> dict:
        """Run ``job``'s commands with its limit, into ``d``; returns (and writes) job.json's record."""
        d.mkdir(parents=True, exist_ok=True)
        env = self.job_env(job, d, gpus)
        (d / "command.txt").write_text(self.describe(job, gpus, d))
        (d / "commit.txt").write_text(self.commit + "\n")
        (d / "gpu.txt").write_text("# before\n" + nvidia_smi())
        rec = {"job": job.name, "about": job.about, "commit": self.commit, "gpus": gpus, "limit_s": job.limit_s,
               "started": time.strftime("%Y-%m-%d %H:%M:%S"), "commands": []}
        start = time.monotonic()
        deadline = start + job.limit_s
        with open(d / "log.txt", "ab") as log:
            for i, cmd in enumerate(job.commands):
                left = deadline - time.monotonic()
                if left <= 0:
                    rec["skipped_commands"] = list(job.commands[i:])
                    break
                log.write(f"$ {cmd}\n".encode())
                log.flush()
                c0 = time.monotonic()
                rc, timed_out = run_command(cmd, env, self.root, left, SIGNALS[job.stop_signal], job.grace_s, log)
                wall = time.monotonic() - c0
                log.write(f"[rc {rc}{', timed out: stopped at the limit' if timed_out else ''}, {wall:.1f} s]\n"
                          .encode())
                log.flush()
                rec["commands"].append({"command": cmd, "rc": rc, "wall_s": round(wall, 1), "timed_out": timed_out})
                if timed_out:
                    rec["skipped_commands"] = list(job.commands[i + 1:])
                    break
        timed_out = any(c["timed_out"] for c in rec["commands"]) or bool(rec.get("skipped_commands"))
        rc = next((c["rc"] for c in rec["commands"] if c["rc"] != 0), 0)
        rec.update(rc=rc, timed_out=timed_out, wall_s=round(time.monotonic() - start, 1),
                   status="timed out" if timed_out else "ok" if rc == 0 else "failed")
        rec["outputs"], rec["missing_outputs"] = self.gather_outputs(job, d)
        with open(d / "gpu.txt", "a") as f:
            f.write("# after\n" + nvidia_smi())
        (d / "job.json").write_text(json.dumps(rec, indent=1) + "\n")
        return rec

    def gather_outputs(self, job: Job, d: Path) -> tuple[list[str], list[str]]:
        """The outputs' matches (relative to ``d``; absolute ones are copied in first) and the patterns that
        matched nothing."""
        found, missing = [], []
        for pattern in job.outputs:
            if Path(pattern.replace("{tmp}", str(self.tmp))).is_absolute():
                matches = []
                for src in sorted(glob.glob(pattern.replace("{tmp}", str(self.tmp)))):
                    dst = d / Path(src).name
                    if Path(src).is_dir():
                        shutil.copytree(src, dst, dirs_exist_ok=True)
                    else:
                        shutil.copy2(src, dst)
                    matches.append(dst)
            else:
                matches = sorted(d.glob(pattern))
            found += [str(m.relative_to(d)) for m in matches]
            if not matches:
                missing.append(pattern)
        return list(dict.fromkeys(found)), missing

    def pack(self, job: Job, d: Path, rec: dict) -> list[str]:
        """$OUT/<job>.tgz: the runner's files, every *.log in ``d`` and the outputs (of a job still running: what
        is there now, with a job.json that says so). Over 15 MiB it is split into <job>.tgz.000, .001, ..."""
        running = rec.get("status") == "running"
        outputs = rec.get("outputs") or [str(m.relative_to(d)) for pattern in job.outputs
                                         if not Path(pattern).is_absolute() for m in sorted(d.glob(pattern))]
        names = [*META, *sorted(p.name for p in d.glob("*.log")), *outputs]
        files: list[str] = []
        for rel in dict.fromkeys(names):
            p = d / rel
            if p.is_dir():
                files += [str(q.relative_to(d)) for q in sorted(p.rglob("*")) if q.is_file()]
            elif p.is_file() or (rel == "job.json" and running):
                files.append(rel)
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for rel in dict.fromkeys(files):
                if rel == "job.json" and running:
                    data = json.dumps(rec, indent=1).encode()
                else:
                    try:
                        data = (d / rel).read_bytes()  # read whole: a file a running job writes stays consistent
                    except OSError:
                        continue
                info = tarfile.TarInfo(f"{job.name}/{rel}")
                info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
                tar.addfile(info, io.BytesIO(data))
        blob = buf.getvalue()
        self.out.mkdir(parents=True, exist_ok=True)
        for old in self.out.glob(f"{job.name}.tgz*"):
            old.unlink()
        if len(blob) <= PART_BYTES:
            (self.out / f"{job.name}.tgz").write_bytes(blob)
            written = [f"{job.name}.tgz"]
        else:
            written = []
            for i in range(0, len(blob), PART_BYTES):
                name = f"{job.name}.tgz.{i // PART_BYTES:03d}"
                (self.out / name).write_bytes(blob[i:i + PART_BYTES])
                written.append(name)
        with self.lock:
            self.files = [f for f in self.files if not f.startswith(f"{job.name}.tgz")] + written
        size = len(blob) / 2**20
        self.say(f"{job.name}: packed {len(files)} files into {', '.join(written)} ({size:.1f} MiB)")
        return written

    def run_foreground(self, job: Job, gpus: list[str]) -> None:
        d = self.work / job.name
        shutil.rmtree(d, ignore_errors=True)
        self.say(f"{job.name}: started on GPU(s) {','.join(gpus) or '-'}, limit {job.limit_s} s")
        try:
            rec = self.execute(job, d, gpus)
        except Exception as e:  # the runner's own failure: recorded, the other jobs go on
            rec = {"job": job.name, "status": "failed", "rc": None, "message": f"runner error: {e!r}"}
            d.mkdir(parents=True, exist_ok=True)
            (d / "job.json").write_text(json.dumps(rec, indent=1) + "\n")
        self.finish(job, d, rec)

    def finish(self, job: Job, d: Path, rec: dict) -> None:
        with self.lock:
            self.results[job.name] = rec
        tail = (d / "log.txt").read_text(errors="replace").splitlines()[-8:] if (d / "log.txt").is_file() else []
        missing = f", missing outputs: {', '.join(rec['missing_outputs'])}" if rec.get("missing_outputs") else ""
        self.say(f"{job.name}: {rec['status']} (rc {rec.get('rc')}, {rec.get('wall_s', 0):.0f} s){missing}\n    "
                 + "\n    ".join(tail))
        self.pack(job, d, rec)
        self.write_session()

    # -- background jobs
    def start_or_attach(self, job: Job, gpus: list[str]) -> None:
        d = self.work / job.name
        done = d / "job.json"
        pid = int((d / "pid").read_text()) if (d / "pid").is_file() else None
        if done.is_file() and not self.args.rerun:
            self.say(f"{job.name}: finished in an earlier call; packing it again (--rerun starts it afresh)")
            return
        if pid and _alive(pid) and not done.is_file():
            self.say(f"{job.name}: running since an earlier call (pid {pid}); waiting for it")
            return
        if pid and _alive(pid):
            _kill_group(pid, signal.SIGKILL)
        shutil.rmtree(d, ignore_errors=True)
        tree = self.work / f"{job.name}.tree"
        shutil.rmtree(tree, ignore_errors=True)
        shutil.copytree(self.root, tree, ignore=TREE_IGNORE, symlinks=True)
        d.mkdir(parents=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=",".join(gpus), BATON_COMMIT=self.commit,
                   BATON_DEVICE_TMP=str(self.tmp))
        cmd = [sys.executable, "-m", "benchmarks.device.run", "--supervise", job.name, "--root", str(tree),
               "--work", str(self.work), "--jobs", self.args.jobs, "--gpus", str(job.gpus), "--skip-setup"]
        with open(d / "supervisor.log", "ab") as log:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
        (d / "pid").write_text(f"{p.pid}\n")
        self.background[job.name] = p
        self.say(f"{job.name}: started in the background (pid {p.pid}, limit {job.limit_s} s, in a copy of the "
                 f"tree at {tree}); name it again in the next call to collect it")

    def bg_done(self, job: Job) -> bool:
        d = self.work / job.name
        p = self.background.get(job.name)
        if p is not None:
            return p.poll() is not None
        if (d / "job.json").is_file():
            return True
        pid = int((d / "pid").read_text()) if (d / "pid").is_file() else None
        return not (pid and _alive(pid))

    def collect_background(self, jobs: list[Job]) -> None:
        while any(not self.bg_done(j) for j in jobs) and self.left() > PACK_RESERVE_S:
            time.sleep(min(2.0, max(self.left() - PACK_RESERVE_S, 0.05)))
        for job in jobs:
            d = self.work / job.name
            if (d / "job.json").is_file():
                rec = json.loads((d / "job.json").read_text())
                self.finish(job, d, rec)
                continue
            if self.bg_done(job):
                rec = {"job": job.name, "status": "failed", "rc": None,
                       "message": "the background job ended without job.json: see supervisor.log"}
            else:
                started = (d / "pid").stat().st_mtime if (d / "pid").is_file() else time.time()
                rec = {"job": job.name, "status": "running", "rc": None, "wall_s": round(time.time() - started, 1),
                       "message": f"still running ({time.time() - started:.0f} s of its {job.limit_s} s): name it "
                                  "again in the next call (within ~30 s, while the machine is warm) to collect it"}
            with self.lock:
                self.results[job.name] = rec
            self.say(f"{job.name}: {rec['status']}: {rec['message']}")
            self.pack(job, d, rec)
            self.write_session()

    # -- the whole call
    def write_session(self) -> None:
        with self.lock:
            record = {"commit": self.commit, "budget_s": self.args.budget_s, "wall_s": round(self.elapsed(), 1),
                      "carried": self.collected.messages, "files": self.files,
                      "jobs": {k: {f: v.get(f) for f in ("status", "rc", "wall_s", "message", "missing_outputs")}
                               for k, v in self.results.items()}}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "session.json").write_text(json.dumps(record, indent=1) + "\n")

    def run(self, names: list[str]) -> int:
        if len(names) > MAX_FILES - 1:
            raise SystemExit(f"{len(names)} jobs: at most {MAX_FILES - 1} a call (the device returns {MAX_FILES} "
                             "files: one .tgz a job and session.json)")
        self.collected = parts.collect(self.root, self.tmp)
        for m in self.collected.messages:
            self.say(m)
        if not self.args.skip_setup:
            device_setup(self.root)
            self.say("benchmarks/device_setup.sh: done")
        self.commit = read_commit(self.root)
        os.environ["BATON_COMMIT"] = self.commit
        gpus = gpu_ids(self.args.gpus)
        self.say(f"commit {self.commit}, {len(gpus)} GPU(s), budget {self.args.budget_s:g} s, results in {self.work}")
        queue, background = [], []
        for name in names:
            job = self.jobs[name]
            blocked = self.blocker(job, len(gpus))
            if blocked:
                self.results[name] = {"job": name, "status": blocked[0], "rc": None, "message": blocked[1]}
                self.say(f"{name}: {blocked[0]}: {blocked[1]}")
            elif job.background:
                background.append(job)
            else:
                queue.append(job)
        for job in background:  # they share the GPUs with the jobs of this call: name only what fits beside them
            self.start_or_attach(job, gpus[:job.gpus])
        self.schedule(queue, gpus)
        self.collect_background(background)
        self.write_session()
        print(f"\n== summary: commit {self.commit}, {self.elapsed():.0f} s of {self.args.budget_s:g}; files in "
              f"{self.out}: {', '.join(self.files + ['session.json'])}")
        for name in names:
            r = self.results.get(name, {"status": "?"})
            print(f"{name:24s} {r['status']:12s} rc {r.get('rc')!s:5s} {r.get('wall_s') or 0:6.0f} s  "
                  f"{r.get('message', '')}")
        if len(self.files) + 1 > MAX_FILES:
            print(f"WARNING: {len(self.files) + 1} files in {self.out}: the device returns only {MAX_FILES}")
        return 0 if all(self.results.get(n, {}).get("status") in ("ok", "running") for n in names) else 1

    def schedule(self, queue: list[Job], gpus: list[str]) -> None:
        """Start the jobs in order, each on free GPUs and only if its limit fits the budget; one at a time, or
        side by side with --parallel."""
        free, running = list(gpus), {}
        while queue or running:
            while queue:
                job = queue[0]
                if job.gpus > len(free) or (running and not self.args.parallel):
                    break
                queue.pop(0)
                if job.limit_s + PACK_RESERVE_S > self.left():
                    msg = (f"its limit ({job.limit_s} s) does not fit the {max(self.left(), 0):.0f} s left of "
                           f"--budget-s {self.args.budget_s:g}: name it in the next call")
                    self.results[job.name] = {"job": job.name, "status": "not started", "rc": None, "message": msg}
                    self.say(f"{job.name}: not started: {msg}")
                    continue
                take, free = free[:job.gpus], free[job.gpus:]
                t = threading.Thread(target=self.run_foreground, args=(job, take), daemon=True)
                t.start()
                running[job.name] = (t, take)
            for name, (t, take) in list(running.items()):
                if not t.is_alive():
                    free = sorted(free + take, key=gpus.index)
                    del running[name]
            if running:
                time.sleep(0.1)


# --- the command line --------------------------------------------------------------------------------------------
def print_list(jobs: dict[str, Job]) -> None:
    print(f"{'job':22s} GPUs  limit  {'needs':26s} about")
    for j in jobs.values():
        needs = ",".join(j.needs) + (" (background)" if j.background else "")
        print(f"{j.name:22s} {j.gpus:4d} {j.limit_s:5d} s  {needs or '-':26s} {j.about}")


def dry_run(session: Session, names: list[str]) -> None:
    """What each job would run here, and which would start within the budget (one after another, each taking its
    whole limit at worst); nothing is run, collected or installed."""
    session.commit = read_commit(session.root)
    gpus = gpu_ids(session.args.gpus)
    at = 0
    print(f"# {len(gpus)} GPU(s) here, budget {session.args.budget_s:g} s, commit {session.commit}\n")
    for name in names:
        job = session.jobs[name]
        d = session.work / job.name
        blocked = session.blocker(job, len(gpus))
        if blocked:
            plan = f"would not start: {blocked[0]}: {blocked[1]}"
        elif job.background:
            plan = "would start in the background (or be waited for, if it runs already)"
        elif at + job.limit_s + PACK_RESERVE_S > session.args.budget_s:
            plan = f"would not start: {at} s + its {job.limit_s} s limit is past the budget"
        else:
            plan = f"would start by {at} s"
            at += job.limit_s
        print(f"## {name}: {plan}")
        print(session.describe(job, gpus[:job.gpus], d))


def supervise(session: Session, name: str) -> int:
    """A background job's own process: run it with its limit (it outlives the call that started it)."""
    session.commit = read_commit(session.root)
    job = session.jobs[name]
    rec = session.execute(job, session.work / name, gpu_ids(job.gpus)[:job.gpus])
    return 0 if rec["status"] == "ok" else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", metavar="JOB", help="jobs to run, in order")
    ap.add_argument("--list", action="store_true", help="list the jobs")
    ap.add_argument("--dry-run", action="store_true", help="print what would run, run nothing")
    ap.add_argument("--budget-s", type=float, default=570, help="start no job whose limit does not fit what is left "
                    "of this many seconds from the start (default 570: a 600 s call)")
    ap.add_argument("--parallel", action="store_true", help="run jobs side by side on free GPUs")
    ap.add_argument("--rerun", action="store_true", help="start a background job again though it finished")
    ap.add_argument("--skip-setup", action="store_true",
                    help="do not source benchmarks/device_setup.sh (for the runner's own background jobs): its "
                         "environment (PYTHONPATH=/tmp/site, the carried wheels) is then missing even on a warm "
                         "machine, so fla-core, gguf and the serve wheels do not import (2026-12-08: a test run "
                         "lost that way); never on a call of your own")
    ap.add_argument("--gpus", type=int, default=None, help="use this many GPUs (default: all; tests: fake ones)")
    ap.add_argument("--out", default=None, help="where the .tgz go (default $OUT)")
    ap.add_argument("--work", default=None, help="the jobs' result folders (default /tmp/baton-jobs)")
    ap.add_argument("--jobs", default="benchmarks.device.jobs", help="the job list: a module or a .py file")
    ap.add_argument("--root", default=None, help="the tree the jobs run in (default: this checkout; a background "
                    "job's supervisor gets its copy)")
    ap.add_argument("--supervise", default=None, help=argparse.SUPPRESS)  # run one background job, detached
    args = ap.parse_args(argv)
    if args.jobs.endswith(".py"):
        args.jobs = str(Path(args.jobs).resolve())
    jobs, needs = load_jobs(args.jobs)
    session = Session(args, jobs, needs)
    if args.supervise:
        return supervise(session, args.supervise)
    if args.list:
        print_list(jobs)
        return 0
    unknown = [n for n in args.names if n not in jobs]
    if unknown:
        ap.error(f"unknown job(s) {', '.join(unknown)}; --list shows them: {', '.join(jobs)}")
    if args.dry_run:
        dry_run(session, args.names or list(jobs))
        return 0
    if not args.names:
        ap.error("name the jobs to run (--list shows them)")
    return session.run(args.names)


if __name__ == "__main__":
    sys.exit(main())
