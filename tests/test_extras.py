"""The install stays two commands: the runtime needs no test, trace, history, lint or docs tool; a test of an
opt-in extra's package reaches it through extras.need(), which fails naming the install line where it is absent;
asv's environments install the same torch as the README and CI where they see none."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
from pathlib import Path

import pytest

from extras import EXTRA_MODULES, IN_TEST, extra_of, need

if sys.version_info >= (3, 11):
    import tomllib
else:  # pytest depends on tomli before 3.11
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]


def project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_runtime_dependencies_leave_test_trace_history_lint_and_docs_tools_to_extras():
    runtime = {re.split(r"[<>=\[ ]", d)[0] for d in project()["dependencies"]}
    extras = project()["optional-dependencies"]
    for extra in ("test", "trace", "history", "lint", "docs"):
        for dep in extras[extra]:
            assert re.split(r"[<>=\[ ]", dep)[0] not in runtime, (
                f"{dep} of [{extra}] is also a runtime dependency"
            )
    assert extras["dev"] == ["distbench[test,trace,history,lint,docs]"]


def test_a_missing_extras_package_fails_naming_it_and_its_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "hta", None)  # an import of hta raises ImportError
    with pytest.raises(
        pytest.fail.Exception, match=r"needs hta .*'trace'.*pip install --no-build-isolation -e '\.\[trace\]'"
    ):
        need("hta")
    monkeypatch.setitem(sys.modules, "ruptures", None)
    with pytest.raises(pytest.fail.Exception, match=r"needs ruptures .*-e '\.\[test\]'"):  # the README's line
        need("ruptures")
    assert need("asv").__name__ == "asv"
    with pytest.raises(ValueError, match="no extra's package"):
        need("yaml")


def _requirement_names(requirements: list[str]) -> list[str]:
    return [re.split(r"[<>=!~;\[ ]", r)[0].lower().replace("_", "-") for r in requirements]


def test_the_extras_modules_are_pyprojects_extras():
    """EXTRA_MODULES names every opt-in extra of pyproject.toml, and each installed package of an extra gives one of
    the modules it lists; the extras the README's `.[test]` brings are the ones `test` asks for."""
    extras = project()["optional-dependencies"]
    assert set(EXTRA_MODULES) == set(extras) - {"test", "dev"}
    brought = {e for r in extras["test"] if r.startswith("distbench[") for e in r[10:-1].split(",")}
    assert brought == set(IN_TEST)
    modules_of: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for d in dists:
            modules_of.setdefault(d.lower().replace("_", "-"), set()).add(module)
    for extra, requirements in extras.items():
        for name in _requirement_names(requirements):
            if extra in EXTRA_MODULES and name in modules_of:
                assert modules_of[name] & set(EXTRA_MODULES[extra]), (extra, name, modules_of[name])


def direct_imports(source: str) -> list[tuple[int, str]]:
    """(line, module) of each import of an extra's package, or pytest.importorskip call, in a module's source."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if extra_of(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and extra_of(node.module):
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "importorskip":
            found.append((node.lineno, "pytest.importorskip"))
    return found


def test_no_test_module_imports_an_extras_package_directly():
    """A test that needs an extra's package goes through extras.need(), which fails naming the install line;
    a direct import fails with a bare ModuleNotFoundError deep in a test, or a skip hides it."""
    tests = Path(__file__).resolve().parent
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {module}"
        for path in sorted(tests.rglob("*.py"))
        if path.name != "extras.py"
        for line, module in direct_imports(path.read_text(encoding="utf-8"))
    ]
    assert not offenders, "import these through extras.need():\n" + "\n".join(offenders)


def test_the_import_check_catches_a_direct_import():
    planted = "import json\nfrom asv import results\ndef f():\n    import hta.trace_analysis\n    pytest.importorskip('x')\n"
    assert direct_imports(planted) == [(2, "asv"), (4, "hta.trace_analysis"), (5, "pytest.importorskip")]


def test_readme_ci_and_asv_install_the_same_torch_where_there_is_none():
    """Three places pin the CPU torch (the README's first command, which .ci/run runs under CI's lock, the lock,
    and asv's environments): one pin."""
    pins = {
        name: set(re.findall(r"\btorch==([\w.+]+)", (ROOT / name).read_text()))
        for name in ("README.md", ".ci/constraints.txt", "asv.conf.json")
    }
    assert len(set().union(*pins.values())) == 1 and all(pins.values()), pins
    install = json.loads((ROOT / "asv.conf.json").read_text())["install_command"]
    assert "find_spec('torch') or" in install[0]  # the machine's torch wins where the environment sees it
    assert (
        "--no-build-isolation {wheel_file}" in install[1] and "--force-reinstall {wheel_file}" in install[2]
    )
