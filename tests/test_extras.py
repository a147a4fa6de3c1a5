"""The install stays two commands: the runtime needs no test, trace, history, lint or docs tool, a test of an
opt-in extra skips with the install line where it is absent, and CI installs everything and fails on such a
skip; asv's environments install the same torch as the README and CI where they see none."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
import yaml

from extras import REQUIRE, need

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


def test_a_missing_extra_skips_with_the_install_line(monkeypatch):
    monkeypatch.delenv(REQUIRE, raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"pip install --no-build-isolation -e '\.\[trace\]'"):
        need("distbench_no_such_module", "trace")
    assert need("yaml", "test").safe_load("a: 1") == {"a": 1}


def test_a_missing_extra_fails_where_every_extra_is_required(monkeypatch):
    monkeypatch.setenv(REQUIRE, "1")
    with pytest.raises(pytest.fail.Exception, match=r"\[trace\]"):
        need("distbench_no_such_module", "trace")


def test_ci_installs_every_extra_and_requires_it():
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"pip install .*-e \"\.\[dev\]\"", script)
    assert f"{REQUIRE}=1" in script
    steps = yaml.safe_load((ROOT / ".github" / "workflows" / "ci.yml").read_text())["jobs"]["test"]["steps"]
    assert any('-e ".[dev]"' in s.get("run", "") for s in steps)
    (pytest_step,) = [s for s in steps if s.get("run", "").split() == ["pytest", "pytest", "-m", "slow"]]
    assert pytest_step["env"] == {REQUIRE: "1"}  # the tier and the system tests it leaves out


def test_readme_ci_and_asv_install_the_same_torch_where_there_is_none():
    """Three places pin the CPU torch (the README's first command, CI's lock, which .ci/run installs torch
    under, and asv's environments): one pin."""
    pins = {
        name: set(re.findall(r"\btorch==([\w.+]+)", (ROOT / name).read_text()))
        for name in ("README.md", ".ci/constraints.txt", "asv.conf.json")
    }
    assert len(set().union(*pins.values())) == 1 and all(pins.values()), pins
    assert re.search(r"pip install -q -c \.ci/constraints\.txt torch$", (ROOT / ".ci/run").read_text(), re.M)
    install = json.loads((ROOT / "asv.conf.json").read_text())["install_command"]
    assert "find_spec('torch') or" in install[0]  # the machine's torch wins where the environment sees it
    assert (
        "--no-build-isolation {wheel_file}" in install[1] and "--force-reinstall {wheel_file}" in install[2]
    )
