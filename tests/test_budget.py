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
from collections import namedtuple
from types import SimpleNamespace

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
    result.stderr.fnmatch_lines(
        [
            "*tier_budget_ratio*pyproject.toml*the tier's time budget must be a positive number of reference workloads"
        ]
    )


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
    while True:  # until it ends: a zombie, or reaped (gone) between two reads
        try:
            if orphan.status() == psutil.STATUS_ZOMBIE:
                break
            orphan_s = sum(orphan.cpu_times()[:2])
        except psutil.Error:
            break
        time.sleep(0.05)
    outside = meter2.read()
    assert inside_s >= 0.9, inside_s  # the kernel counts in clock ticks: 0.99 s was read
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


def test_the_machine_is_busy_in_every_state_but_idle_and_iowait_and_unreadable_counters_count_nothing(
    monkeypatch,
):
    """/proc/stat's eight counters (user, nice, system, idle, iowait, irq, softirq, steal) each a power of two, so
    the sum names exactly the states counted: all but idle and iowait, steal included (guest is already in user),
    in seconds of the kernel's clock ticks; a machine without the counters counts nothing."""
    from distbench.measure import hostspeed

    monkeypatch.setattr(hostspeed, "cpu_stat", lambda: [2**i for i in range(8)])
    monkeypatch.setattr(budget.os, "sysconf", lambda name: {"SC_CLK_TCK": 4}[name])
    assert budget.machine_busy_s() == (1 + 2 + 4 + 32 + 64 + 128) / 4
    monkeypatch.setattr(hostspeed, "cpu_stat", lambda: None)
    assert budget.machine_busy_s() == 0.0


_Times = namedtuple("_Times", ("user", "system", "children_user", "children_system"))  # noqa: PYI024


class _Proc:
    """A process of a fake tree: its CPU times, its children (all of them only when asked recursively), or
    gone when read (it exited between the listing and the read)."""

    def __init__(self, times=None, children=(), grandchildren=()):
        self.times, self.kids, self.grandkids = times, list(children), list(grandchildren)

    def cpu_times(self):
        if self.times is None:
            raise psutil.NoSuchProcess(0)
        return _Times(*self.times)

    def children(self, recursive=False):
        return self.kids + (self.grandkids if recursive is True else [])


def test_the_tree_counts_every_descendants_user_and_system_time_and_their_reaped_childrens(monkeypatch):
    gone = _Proc(None)  # exited meanwhile: skipped, the rest still counted
    me = _Proc(
        (1.0, 2.0, 4.0, 8.0),
        children=[gone, _Proc((16.0, 32.0, 0.0, 0.0))],
        grandchildren=[_Proc((64.0, 128.0, 256.0, 0.0))],
    )
    monkeypatch.setattr(budget.psutil, "Process", lambda: me)
    assert budget.own_tree_s() == 511.0


def test_a_machine_that_cannot_count_its_cpus_is_taken_for_one(monkeypatch):
    clock = {"now": 0.0}
    monkeypatch.setattr(budget, "machine_busy_s", lambda: 0.0)
    monkeypatch.setattr(budget, "own_tree_s", lambda: 0.0)
    monkeypatch.setattr(budget.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(budget.os, "cpu_count", lambda: None)
    meter = budget.ShareMeter()
    clock["now"] = 3.0
    assert meter.read().capacity_s == 3.0


class _Reporter:
    def __init__(self):
        self.lines = []

    def write_line(self, line, **markup):
        self.lines.append((line, markup))


@pytest.mark.parametrize(("foreign_s", "ratio_over", "ending", "markup"), [
    (0.0, True, "OVER BUDGET, the session fails. Make tests cheaper, or mark `nightly` a case that repeats "
     "another's behaviour (docs/ci.md, the CPU tier's time budget)", {"red": True, "bold": True}),
    (5.0, True, "NOT JUDGED, the machine was shared (over 25%); run the tier alone for a verdict, as CI does",
     {"yellow": True}),
    (0.0, False, "within budget", {}),
])  # fmt: skip
def test_the_verdict_line_says_what_was_measured_and_what_to_do(foreign_s, ratio_over, ending, markup):
    tb = budget.TierBudget(budget=2.0 if ratio_over else 10.0)
    tb.tests, tb.slices, tb.judged = 3.0, [0.05, 0.125, 0.125, 0.2], True  # median 0.125: reference 1.0 s
    tb.share = budget.Share(foreign_s=foreign_s, capacity_s=10.0)
    reporter = _Reporter()
    tb.pytest_terminal_summary(reporter)
    ((line, got),) = reporter.lines
    assert line == (
        "tier budget: tests took 3.0 s = 3.0 reference workloads (the reference: 1.00 s, the median of 4 slices "
        f"timed through the session, 0.40-1.60 s as a whole); budget {tb.budget:g}; other processes took "
        f"{foreign_s / 10:.0%} of the machine's CPU time: {ending}"
    )
    assert got == markup


class _Config:
    """What is_whole_default_tier reads of a pytest.Config; getoption as pytest's: a missing option without a
    default is an error."""

    def __init__(
        self, addopts=("-m", "not slow"), source="testpaths", keyword="", markexpr="not slow", **options
    ):
        self.addopts, self.options = list(addopts), options
        self.args_source = getattr(pytest.Config.ArgsSource, source.upper())
        self.option = SimpleNamespace(keyword=keyword, markexpr=markexpr)

    def getini(self, name):
        assert name == "addopts"
        return self.addopts

    def getoption(self, name, default=ValueError):
        if name in self.options:
            return self.options[name]
        if default is ValueError:
            raise ValueError(f"no option named {name!r}")
        return default


@pytest.mark.parametrize(("config", "whole"), [
    (_Config(), True),
    (_Config(deselect=None, lf=False, **{"--distbench-lane": None}), True),
    (_Config(addopts=("-ra",), markexpr=""), True),  # no -m in addopts: the default mark is none
    (_Config(addopts=("-ra", "-m", "not slow", "--strict-markers"), markexpr="not slow"), True),
    (_Config(source="args"), False),  # paths given
    (_Config(keyword="sleeps"), False),
    (_Config(markexpr="slow"), False),
    (_Config(addopts=("-ra",), markexpr="not slow"), False),
    (_Config(deselect=["tests/test_a.py::test_b"]), False),
    (_Config(lf=True), False),
    (_Config(**{"--distbench-lane": "1"}), False),
])  # fmt: skip
def test_the_whole_default_tier_is_pytest_as_the_readme_runs_it(config, whole):
    assert budget.is_whole_default_tier(config) is whole


def test_a_budget_below_one_workload_is_still_a_budget(tier):
    result = tier("0.5").runpytest()
    assert result.ret == pytest.ExitCode.TESTS_FAILED  # judged (and over), not refused
    result.stdout.fnmatch_lines(["*budget 0.5; *OVER BUDGET*"])


def test_the_reference_workload_is_its_fixed_work_on_one_thread_and_gives_the_threads_back(monkeypatch):
    """The work, held by its results: the Python loop's sum in closed form (53,571 whole cycles of 0..6 and
    0 + 1 + 2), the matmul chain's 192 x 192 result shrunk to 0 by tanh; one thread while timing, the
    caller's count after; a time, not a clock reading."""
    import torch

    assert budget._python_half() == 53_571 * 21 + 3
    a = budget._torch_half()
    assert a.shape == (192, 192) and float(a.abs().max()) < 0.01
    set_to = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (set_to.append(n), real(n)))
    before = torch.get_num_threads()
    seconds = budget.reference_workload(1)
    assert set_to == [1, before] and torch.get_num_threads() == before
    assert 0.0 < seconds < 10.0


def test_the_options_say_what_they_do_and_refuse_a_mode_they_lack(tier):
    """`pytest --help` lists --tier-budget under distbench's group with its three modes and its help, and the
    ini key with its; a mode it lacks is a usage error; without the ini key the budget names its empty value."""
    helped = tier("2").runpytest("--help")
    text = " ".join(helped.stdout.str().split())
    assert (
        "distbench: --tier-budget={auto,on,off} the CPU tier's time budget (tests' summed time over a reference "
        "workload's): auto (enforced on the whole default tier only), on (measured, printed and enforced on any "
        "selection), off"
    ) in text
    assert (
        "tier_budget_ratio (string): the CPU tier's budget: its tests' summed seconds over the reference "
        "workload's (distbench/testsuite/budget.py; docs/ci.md says how it was set)"
    ) in text
    assert tier("2").runpytest("--tier-budget=maybe").ret == pytest.ExitCode.USAGE_ERROR
    pytester = tier("2")
    pytester.makeini(INI.replace("tier_budget_ratio = {ratio}\n", ""))
    missing = pytester.runpytest()
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*tier_budget_ratio = '' (*"])
