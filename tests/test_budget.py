"""The CPU tier's time budget (distbench/testsuite/budget.py): a session whose tests' summed time over the
reference workload's passes the committed ratio fails, even when every test passed; the whole default tier
is judged, a subset is not unless asked. Child sessions run in this process with a reference workload of a
fixed 0.1 s, so the ratio is the tests' summed seconds times ten."""

from __future__ import annotations

import pytest

from distbench.testsuite import budget

pytest_plugins = ["pytester"]

INI = """
[pytest]
testpaths = tests
addopts = -m 'not slow' -p distbench.testsuite.budget -p no:hypothesispytest -p no:benchmark -p no:cacheprovider
tier_budget_ratio = {ratio}
markers = slow: left out by default
"""

SLEEPY = """
import time
import pytest

def test_sleeps():
    time.sleep(0.3)

@pytest.mark.slow
def test_left_out():
    pass
"""


@pytest.fixture
def tier(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch):
    """A tier of one test that sleeps 0.3 s (a ratio of 3 or a little more), its budget the argument."""
    monkeypatch.setattr(
        budget, "reference_workload", lambda slices=budget.SLICES: 0.1 * slices / budget.SLICES
    )
    pytester.mkdir("tests")
    (pytester.path / "tests" / "test_sleepy.py").write_text(SLEEPY)

    def make(ratio: str) -> pytest.Pytester:
        pytester.makeini(INI.format(ratio=ratio))
        return pytester

    return make


def test_a_tier_over_its_budget_fails_though_every_test_passed(tier):
    result = tier("2").runpytest()  # the planted slowdown: 0.3 s of sleep against a budget of 0.2 s
    result.assert_outcomes(passed=1, deselected=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.re_match_lines(
        [r"tier budget: tests took 0\.3 s = 3\.\d reference workloads .*budget 2: OVER"]
    )


def test_a_tier_within_its_budget_passes_and_prints_its_ratio(tier):
    result = tier("10").runpytest()
    assert result.ret == pytest.ExitCode.OK
    result.stdout.re_match_lines(
        [r"tier budget: tests took 0\.3 s = 3\.\d reference workloads .*: within budget"]
    )


@pytest.mark.parametrize("args", [["-k", "sleeps"], ["tests/test_sleepy.py"], ["-m", "slow or not slow"]])
def test_a_subset_is_not_judged(tier, args):
    result = tier("2").runpytest(*args)
    assert result.ret == pytest.ExitCode.OK
    assert "tier budget" not in result.stdout.str()


def test_a_subset_is_judged_when_asked(tier):
    result = tier("2").runpytest("-k", "sleeps", "--tier-budget=on")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(["*OVER BUDGET*"])


def test_off_measures_nothing(tier):
    result = tier("2").runpytest("--tier-budget=off")
    assert result.ret == pytest.ExitCode.OK
    assert "tier budget" not in result.stdout.str()


def test_a_session_stopped_early_gets_no_verdict(tier, pytester):
    (pytester.path / "tests" / "test_fails_first.py").write_text("def test_fails():\n    assert False\n")
    result = tier("2").runpytest("-x")
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # the failure's, not the budget's
    result.stdout.fnmatch_lines(["tier budget: no verdict, the session stopped early"])


@pytest.mark.parametrize("ratio", ["", "fast", "0"])
def test_a_budget_that_is_not_a_positive_number_is_named(tier, ratio):
    result = tier(ratio).runpytest()
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*tier_budget_ratio*pyproject.toml*positive number*"])
