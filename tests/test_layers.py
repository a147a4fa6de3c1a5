"""The import layers of src/distbench, written once as data, and a checker that fails on an import that goes up.

A module may import from its own layer and the layers below it, never from a layer above: the process layer
knows nothing of strategies, in-rank jobs know nothing of results, rendering knows nothing of the command line.
Imports inside functions and under TYPE_CHECKING count like the others. `python tests/test_layers.py` prints
every upward import and import cycle of the tree.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

#: Lowest first. A module belongs to the layer of the longest prefix listed here.
LAYERS: list[tuple[str, list[str]]] = [
    (
        "base: errors, the run configuration, the machine, claims about time",
        [
            "distbench",
            "distbench.errors",
            "distbench.config",
            "distbench.machine",
            "distbench.testsuite.claims",
        ],
    ),
    ("process: rank pools, workers, launches", ["distbench.runtime"]),
    (
        "what runs in a rank: models, strategies, checks, measurements",
        ["distbench.workloads", "distbench.strategies", "distbench.invariants", "distbench.measure"],
    ),
    ("in-rank jobs", ["distbench.jobs"]),
    (
        "results: building, metrics, scaling, plausibility, shortfalls",
        [
            "distbench.results",
            "distbench.metrics",
            "distbench.scaling",
            "distbench.plausibility",
            "distbench.gaps",
        ],
    ),
    (
        "running configurations: matrix, side by side, suite, lanes, A/B gate, doctor",
        [
            "distbench.matrix",
            "distbench.sidebyside",
            "distbench.testsuite",
            "distbench.gate",
            "distbench.doctor",
        ],
    ),
    (
        "rendering: reports, comparisons, the history's change points",
        ["distbench.report", "distbench.compare", "distbench.history"],
    ),
    (
        "entry points: command line, pytest plugin",
        ["distbench.cli", "distbench.commands", "distbench.testsuite.plugin"],
    ),
]


def modules(src: Path) -> dict[str, tuple[Path, bool]]:
    """Every module under `src`: dotted name -> (file, is a package's __init__)."""
    out = {}
    for path in sorted(src.rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if package else parts)] = (path, package)
    return out


def imports(src: Path) -> dict[str, set[str]]:
    """Module -> the modules of the tree it imports (`from pkg import sub` counts as importing pkg.sub)."""
    mods = modules(src)
    return {name: {m for m in found if m in mods and m != name} for name, found in named_imports(src).items()}


def missing_imports(src: Path) -> list[str]:
    """Imports of distbench modules that do not exist, wherever they stand (in a function, too): the type
    checker, told to ignore missing imports for the libraries without types, does not see them."""
    mods = modules(src)
    return sorted(
        f"{name} -> {m}"
        for name, found in named_imports(src).items()
        for m in found
        if m.split(".")[0] == "distbench" and m not in mods
    )


def named_imports(src: Path) -> dict[str, set[str]]:
    """Module -> every dotted name it imports, resolved from relative imports, whether or not it exists."""
    mods = modules(src)
    graph: dict[str, set[str]] = {}
    for name, (path, package) in mods.items():
        here = name.split(".") if package else name.split(".")[:-1]
        found = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = (
                    ".".join(here[: len(here) - node.level + 1] + ([node.module] if node.module else []))
                    if node.level
                    else node.module or ""
                )
                found |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
        graph[name] = found
    return graph


def layer_of(module: str) -> int:
    best, level = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (module == p or module.startswith(p + ".")) and len(p) > best:
                best, level = len(p), i
    if level < 0:
        raise AssertionError(f"{module} belongs to no layer: add it to LAYERS in {Path(__file__).name}")
    return level


def upward_imports(src: Path) -> list[str]:
    graph = imports(src)
    return sorted(
        f"{m} -> {t} ({LAYERS[layer_of(m)][0].split(':')[0]} -> {LAYERS[layer_of(t)][0].split(':')[0]})"
        for m, targets in graph.items()
        for t in targets
        if layer_of(t) > layer_of(m)
    )


def cycles(src: Path) -> list[list[str]]:
    """The import cycles (strongly connected groups of more than one module), Tarjan's algorithm."""
    graph = imports(src)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


def test_no_module_imports_from_a_layer_above_its_own():
    assert upward_imports(SRC) == []


def test_every_import_of_the_tree_names_a_module_that_exists():
    assert missing_imports(SRC) == []


def test_no_import_cycles():
    assert cycles(SRC) == []


def test_the_checker_finds_a_planted_upward_import_and_cycle(tmp_path):
    pkg = tmp_path / "distbench"
    (pkg / "runtime").mkdir(parents=True)
    (pkg / "report").mkdir()
    for init in (pkg, pkg / "runtime", pkg / "report"):
        (init / "__init__.py").write_text("")
    (pkg / "report" / "tables.py").write_text("def table():\n    from ..runtime import pool\n")
    (pkg / "runtime" / "pool.py").write_text("from ..report.tables import table\n")
    assert upward_imports(tmp_path) == [
        "distbench.runtime.pool -> distbench.report.tables (process -> rendering)"
    ]
    assert cycles(tmp_path) == [["distbench.report.tables", "distbench.runtime.pool"]]
    (pkg / "report" / "plots.py").write_text("def plot():\n    from ..suite import Suite\n")
    assert missing_imports(tmp_path) == ["distbench.report.plots -> distbench.suite"]


if __name__ == "__main__":
    print("upward imports:", *upward_imports(SRC) or ["(none)"], sep="\n  ")
    print("import cycles:", *[" <-> ".join(c) for c in cycles(SRC)] or ["(none)"], sep="\n  ")
    sys.exit(0)
