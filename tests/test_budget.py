"""The CPU tier's time budget (distbench/testsuite/budget.py): a session whose tests' summed time over the
reference workload's passes the committed ratio fails, even when every test passed; the whole default tier
is judged, a subset is not unless asked. Child sessions run in this process with a reference workload of a
fixed 0.1 s, so the ratio is the tests' summed seconds times ten, on a machine no other process shares unless
a test says otherwise. A machine shared past SHARED_ABOVE gets the ratio printed and no verdict; the meter
that says so is tested against real processes, one outside this process tree and one inside it."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
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
    monkeypatch.setattr(budget.ShareMeter, "read", lambda self: budget.Share(foreign_s=0.0, capacity_s=10.0))
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
        [r"tier budget: tests took 0\.3 s = 3\.\d reference workloads .*budget 2; .*: OVER"]
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


@pytest.mark.parametrize("foreign_s", [2.4, 2.6])
def test_a_shared_machine_prints_the_ratio_and_judges_only_below_the_share(tier, monkeypatch, foreign_s):
    """Over budget either way; 24% of the machine taken by others is judged (and fails), 26% is not."""
    monkeypatch.setattr(
        budget.ShareMeter, "read", lambda self: budget.Share(foreign_s=foreign_s, capacity_s=10.0)
    )
    result = tier("2").runpytest()
    if foreign_s / 10.0 > budget.SHARED_ABOVE:
        assert result.ret == pytest.ExitCode.OK
        result.stdout.re_match_lines(
            [r"tier budget: tests took 0\.3 s = 3\.\d .*took 26% .*NOT JUDGED.*shared"]
        )
    else:
        assert result.ret == pytest.ExitCode.TESTS_FAILED
        result.stdout.re_match_lines([r".*took 24% of the machine's CPU time: OVER BUDGET"])


BUSY = (
    "import time\nwhile time.process_time() < {s}:\n    pass\n"  # {s} CPU seconds, however loaded the machine
)


def test_the_meter_counts_a_process_outside_the_tree_and_not_one_inside_it():
    """A busy process the shell leaves behind (reparented away from this tree) is foreign; a busy child of this
    process is not. Each is held to its own CPU time, read from the kernel, so a loaded machine cannot fail it."""
    own0 = budget.own_tree_s()
    subprocess.run([sys.executable, "-c", BUSY.format(s=1.0)], check=True)
    inside_s = budget.own_tree_s() - own0  # the reaped child's CPU time, and this process's own
    out = subprocess.run(
        ["sh", "-c", f'{sys.executable} -c "{BUSY.format(s=1.0)}" >/dev/null 2>&1 & echo $!'],
        capture_output=True,
        text=True,
        check=True,
    )
    orphan = psutil.Process(int(out.stdout))
    assert orphan.pid not in {p.pid for p in psutil.Process().children(recursive=True)}
    meter2 = budget.ShareMeter()
    orphan_s = 0.0
    while orphan.is_running() and orphan.status() != psutil.STATUS_ZOMBIE:
        try:
            orphan_s = sum(orphan.cpu_times()[:2])
        except psutil.Error:
            break
        time.sleep(0.05)
    outside = meter2.read()
    assert inside_s >= 1.0, inside_s
    assert orphan_s >= 0.9, orphan_s
    assert outside.foreign_s >= 0.8 * orphan_s, (outside, orphan_s)


def test_the_share_is_the_machines_busy_time_less_this_trees_over_its_capacity(monkeypatch):
    clock = {"busy": 100.0, "own": 10.0, "now": 50.0}
    monkeypatch.setattr(budget, "machine_busy_s", lambda: clock["busy"])
    monkeypatch.setattr(budget, "own_tree_s", lambda: clock["own"])
    monkeypatch.setattr(budget.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(budget.os, "cpu_count", lambda: 2)
    meter = budget.ShareMeter()
    clock.update(busy=112.0, own=18.0, now=60.0)  # 12 s busy in 10 s on 2 cores, 8 of them this tree's
    share = meter.read()
    assert (share.foreign_s, share.capacity_s, share.fraction) == (4.0, 20.0, 0.2)
