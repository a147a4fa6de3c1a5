"""`distbench ab --numerics suite`: the invariant tests themselves, run under base and under head, and the tests
that fail under head and pass under base, per strategy.

The numerics comparison (numerics.py) trains what it names and compares two curves; the invariant tests compare
each strategy with the independent reference and with itself across accumulation, recipes and checkpoints, and
they are what caught a real upstream accumulation regression that the default-step numerics read IDENTICAL. Each
side runs pytest over MODULES with its own interpreter, code and environment (variants.py), from its own
checkout's tests (this checkout's for python=, path= and env. variants) and writes JUnit XML; the two files are
compared test by test. A test that fails on both sides is the checkout's, not the upgrade's, and is listed apart.
"""

from __future__ import annotations

import re
import subprocess
import xml.etree.ElementTree as ET
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .numerics import EXIT_DIVERGED

if TYPE_CHECKING:
    from .variants import VariantProcess

#: The invariant test modules the suite runs: parity with the reference, accumulation, the recipes, checkpoints.
MODULES = (
    "tests/test_loss_parity.py",
    "tests/test_accumulation.py",
    "tests/test_recipes.py",
    "tests/test_checkpoint.py",
)
PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"
#: Tests that name no strategy in their parameters (the checks of the checks) are listed under this.
NO_STRATEGY = "(none)"


def read_junit(path: Path) -> dict[str, str]:
    """Each test case of a pytest JUnit XML file, as "classname::name", with its outcome (PASSED, FAILED for a
    failure or an error, SKIPPED); ValueError when the file is not JUnit XML."""
    try:
        root = ET.parse(path).getroot()
    except (ET.ParseError, OSError) as e:
        raise ValueError(f"{path}: not a JUnit XML file ({e})") from None
    cases = {}
    for case in root.iter("testcase"):
        tags = {child.tag for child in case}
        outcome = FAILED if tags & {"failure", "error"} else SKIPPED if "skipped" in tags else PASSED
        cases[f"{case.get('classname')}::{case.get('name')}"] = outcome
    return cases


def strategy_of(test: str, strategies: Collection[str]) -> str:
    """The strategy a test case runs, from its parameters ("test_x[zero2-ws2]" -> "zero2"), or NO_STRATEGY."""
    params = re.search(r"\[(.*)\]$", test)
    for token in re.split(r"[-,]", params.group(1)) if params else ():
        if token in strategies:
            return token
    return NO_STRATEGY


@dataclass
class SuiteComparison:
    """What the two sides' test runs came to: per strategy, the tests failing under head alone (regressions),
    under base alone (fixed), and on both; a side whose run left no results, with why."""

    regressions: dict[str, list[str]] = field(default_factory=dict)
    fixed: dict[str, list[str]] = field(default_factory=dict)
    both: dict[str, list[str]] = field(default_factory=dict)
    counts: dict[str, dict[str, int]] = field(default_factory=dict)  # per side, tests by outcome
    errors: dict[str, str] = field(default_factory=dict)  # per side that could not run

    @property
    def exit_code(self) -> int:
        """EXIT_DIVERGED when a test fails under head alone, 3 when a side could not run, else 0."""
        return EXIT_DIVERGED if self.regressions else 3 if self.errors else 0


def compare(base: dict[str, str], head: dict[str, str], strategies: Collection[str]) -> SuiteComparison:
    """Test by test (read_junit's outcomes): where each failing test fails, grouped by strategy. A test that ran
    on one side only counts as passing on the other where it did not run (a new test that fails under head
    alone is a regression)."""
    out = SuiteComparison(counts={side: _count(cases) for side, cases in (("base", base), ("head", head))})
    for test in sorted(set(base) | set(head)):
        b, h = base.get(test) == FAILED, head.get(test) == FAILED
        into = out.both if b and h else out.regressions if h else out.fixed if b else None
        if into is not None:
            into.setdefault(strategy_of(test, strategies), []).append(test)
    return out


def _count(cases: dict[str, str]) -> dict[str, int]:
    return {k: sum(v == k for v in cases.values()) for k in (PASSED, FAILED, SKIPPED)}


def pytest_command(
    python: str, junit: Path, strategies: list[str], world_size: int | None, device: str
) -> list[str]:
    """The pytest run of one side: MODULES over the strategies (and world sizes up to the one asked), JUnit
    XML out; on GPUs the GPU tier (-m gpu)."""
    cmd = [python, "-m", "pytest", *MODULES, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    cmd += ["--strategies", ",".join(strategies)]
    if world_size:
        cmd += ["--world-sizes", ",".join(str(n) for n in range(1, world_size + 1))]
    return cmd + (["-m", "gpu"] if device == "cuda" else [])


def run_side(
    proc: VariantProcess,
    out: Path,
    strategies: list[str],
    world_size: int | None,
    timeout: float,
) -> dict[str, str] | str:
    """One side's test run: its outcomes (read_junit), or why there are none (no tests in its checkout, no
    results written, over `timeout` seconds). Its output goes to OUT/<side>-suite.log."""
    proc.checkout()
    root = proc.src.parent
    missing = [m for m in MODULES if not (root / m).is_file()]
    if missing:
        return f"{root} holds no {', '.join(missing)}: the suite runs from a distbench source checkout"
    junit, log = out / f"{proc.variant.label}-suite.xml", out / f"{proc.variant.label}-suite.log"
    junit.unlink(missing_ok=True)
    cmd = pytest_command(proc.variant.python, junit, strategies, world_size, proc.device_type)
    side = f"the {proc.variant.label} side's"
    try:
        with log.open("w") as f:
            env = proc.environment()
            ran = subprocess.run(cmd, cwd=root, env=env, stdout=f, stderr=subprocess.STDOUT, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"{side} tests ran past {timeout:.0f} s (log: {log})"
    if ran.returncode not in (
        0,
        1,
    ):  # 1: tests failed; 2-5: interrupted, internal or usage error, none collected
        return f"{side} pytest exited {ran.returncode}, not a test run's 0 or 1 (log: {log})"
    if not junit.is_file():
        return f"{side} pytest wrote no results (log: {log})"
    try:
        return read_junit(junit)
    except ValueError as e:
        return str(e)
