"""Packages point one way: ops and cache <- dist <- layers <- models <- spec <- engine <- server, bench, train <- cli.

Every ``import baton.X`` in baton/ (module level or inside a function; ``if TYPE_CHECKING:`` blocks excepted: they
are annotations, not imports at run time) is an edge between two units (``baton.<package or module>``). An edge to
a higher rank is an upward import, and two units importing each other make a cycle. Both fail this test unless
they are in KNOWN below, the debt that exists today, each entry with where it comes from. An entry that no longer
occurs also fails: remove it, so the list only shrinks.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "baton"

RANK = {
    "baton.env": 0, "baton.types": 0, "baton.config": 0, "baton.plotting": 0,
    "baton.ops": 1, "baton.cache": 1,
    "baton.dist": 1.5,  # beside the ops: its all-reduce uses ops/allreduce
    "baton.layers": 2,
    "baton.models": 3, "baton.tokenizer": 3.5,  # the GGUF tokenizer reads models/gguf.py
    "baton.speculative": 4,
    "baton.engine": 5,
    "baton.server": 6, "baton.bench": 6, "baton.train": 6, "baton.args": 6,
    "baton.cli": 7, "baton.__main__": 7,
}  # fmt: skip

# (from, to): why it is there today. Upward edges and both directions of a cycle.
KNOWN: dict[tuple[str, str], str] = {}


def _unit(module: str) -> str:
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 1 else parts[0]


def _module_of(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    name = ".".join(rel.parts)
    return name.removesuffix(".__init__")


def _imports(tree: ast.AST) -> list[str]:
    """Absolute baton imports outside ``if TYPE_CHECKING:`` blocks."""
    found: list[str] = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module == "baton":  # from baton import env, dist
                found.extend(f"baton.{a.name}" for a in node.names if f"baton.{a.name}" in RANK)
            else:
                found.append(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return [m for m in found if m.startswith("baton.")]


def _edges() -> dict[tuple[str, str], set[str]]:
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for path in ROOT.rglob("*.py"):
        src = _unit(_module_of(path))
        for module in _imports(ast.parse(path.read_text())):
            dst = _unit(module)
            if dst != src and dst in RANK:
                edges[(src, dst)].add(str(path.relative_to(ROOT.parent)))
    return edges


def test_every_unit_has_a_rank() -> None:
    units = {_unit(_module_of(p)) for p in ROOT.rglob("*.py")} - {"baton"}
    assert units <= set(RANK), f"give these a rank in tests/test_layering.py: {sorted(units - set(RANK))}"


def test_no_new_upward_import_or_cycle() -> None:
    edges = _edges()
    bad = {}
    for (src, dst), files in edges.items():
        upward = RANK[src] < RANK[dst]
        cycle = RANK[src] == RANK[dst] and (dst, src) in edges  # two units of one rank importing each other
        if (upward or cycle) and (src, dst) not in KNOWN:
            bad[(src, dst)] = sorted(files)
    assert not bad, f"upward imports or cycles between packages: {bad}"


def test_known_debt_still_exists() -> None:
    edges = _edges()
    gone = [k for k in KNOWN if k not in edges]
    assert not gone, f"these are fixed: remove them from KNOWN in tests/test_layering.py: {gone}"
