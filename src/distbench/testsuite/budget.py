"""pytest plugin: the CPU tier's time budget, held by the tier itself.

The tier's budget is three minutes on 2 cores; it crept past that one feature at a time, and nothing failed.
A budget in seconds cannot fail a run by itself: the same commit took 2.5 times longer on a loaded afternoon
than on an idle morning. So the budget is a ratio: the summed time of the session's tests (setup, call and
teardown, as junit counts them) over the time of a fixed reference workload (a CPU matmul and a Python loop)
timed through the same session. Both slow down alike on a busy machine; more work, or slower work, moves
the ratio.

A ratio still cannot judge a machine the tier shares: two tiers at once on 2 cores measured 1,346-1,643
reference workloads against a lone tier's 578, since ranks that wait on each other lose more to a neighbour
than one thread does. So the session also measures the CPU time other processes took (the machine's busy time,
hypervisor steal included, less this session's process tree); past SHARED_ABOVE of the machine, the ratio is
printed with that share and not judged. CI runs the tier alone, where it is judged.

Active by default only for the whole default tier (`pytest` with no paths, -k, -m or deselection of its own):
a subset's summed time says nothing about the tier's. `--tier-budget=on` measures and enforces on any
selection (and prints the ratio), `off` never. docs/ci.md (the CPU tier's time budget) says how to set it.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Any

import psutil
import pytest

from ..measure.hostspeed import host_jiffies

#: The reference workload is this many slices; one slice is timed every SAMPLE_EVERY_S seconds of tests, and
#: the whole workload at the session's start and end. A shared machine's speed moves within minutes (the
#: workload took 0.37 s at one session's start and 0.65 s at its end): the ratio is taken against the median
#: of the slices over the whole session, not against two moments.
SLICES = 8
SAMPLE_EVERY_S = 10.0

#: Past this share of the machine's CPU time taken by other processes, the session gets no verdict. A lone tier
#: on the project's 2-core machine measured under 5%; a second tier beside it takes about half.
SHARED_ABOVE = 0.25


def reference_workload(slices: int = SLICES) -> float:
    """Seconds `slices` of one fixed piece of CPU work take here: single-threaded matmuls (the tier's ranks are
    torch) and a pure-Python loop (the tier's session process is Python); the whole workload (SLICES) is about
    0.4 s on one core of the project's machine. The work is fixed, never calibrated at run time: calibrating
    would divide the machine's speed out. One thread: on torch's two, the slices ranged 0.3-27.6 s in one
    session (threads that wait on each other, beside the ranks' own), and the median of such samples moves."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        t0 = time.perf_counter()
        for _ in range(slices):
            _torch_half()
            _python_half()
        return time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)


def _torch_half() -> Any:
    """250 products of two 192 x 192 matrices, each squashed by tanh (its entries shrink towards 0 and stay
    finite): the result, so that a test can hold the work to its size."""
    import torch

    a = torch.ones(192, 192)
    for _ in range(250):
        a = torch.tanh(a @ a / 192.0)
    return a


def _python_half() -> int:
    """A Python loop of 375,000 additions; its sum, so that a test can hold the work to its length."""
    total = 0
    for i in range(375_000):
        total += i % 7
    return total


def machine_busy_s() -> float:
    """CPU seconds the whole machine has been busy since boot, every core summed (measure/hostspeed.py's
    host_jiffies: all but idle and iowait, so time stolen by the hypervisor counts, since a neighbouring VM slows
    the tier as a neighbouring process does); 0 where the counters cannot be read, so no share is seen."""
    jiffies = host_jiffies()
    return jiffies[0] / os.sysconf("SC_CLK_TCK") if jiffies else 0.0


def own_tree_s() -> float:
    """CPU seconds this process and its descendants have used: the live ones' own and their reaped children's.
    A child that exited and was reaped counts in its parent's children figures."""
    total = 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
        except psutil.Error:  # exited between the listing and the read: its time is lost, and small
            continue
        total += t.user + t.system + t.children_user + t.children_system
    return total


@dataclass
class Share:
    """What other processes took of the machine between two moments."""

    foreign_s: float  # their CPU seconds
    capacity_s: float  # the machine's: cores x wall seconds

    @property
    def fraction(self) -> float:
        return max(0.0, self.foreign_s) / self.capacity_s if self.capacity_s > 0 else 0.0


class ShareMeter:
    """Other processes' CPU time from its creation to each `read()`."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.own0 = time.monotonic(), machine_busy_s(), own_tree_s()

    def read(self) -> Share:
        wall = time.monotonic() - self.t0
        foreign = (machine_busy_s() - self.busy0) - (own_tree_s() - self.own0)
        return Share(foreign_s=foreign, capacity_s=(os.cpu_count() or 1) * wall)


class TierBudget:
    """One session's figures, registered as a plugin while the budget is active: its tests' summed seconds,
    and the reference workload's, sampled through the session."""

    meter: ShareMeter  # from the session's start
    share: Share  # what others took of the machine, read when the session is judged

    def __init__(self, budget: float) -> None:
        self.budget = budget
        self.tests = 0.0
        self.sampled_at = 0.0  # self.tests when the last slice was timed
        self.slices: list[float] = []  # seconds per slice, each sample
        self.judged = False

    def _sample(self, slices: int) -> None:
        self.slices += [reference_workload(slices) / slices] * slices
        self.sampled_at = self.tests

    @property
    def reference(self) -> float:
        """The whole workload's seconds at the session's median speed: a slice that ran beside a burst of
        another process's work moves the mean, not the median."""
        return SLICES * statistics.median(self.slices)

    @property
    def ratio(self) -> float:
        return self.tests / self.reference

    @property
    def shared(self) -> bool:
        return self.share.fraction > SHARED_ABOVE

    @property
    def over(self) -> bool:
        return self.judged and not self.shared and self.ratio > self.budget

    def pytest_sessionstart(self) -> None:
        self.meter = ShareMeter()
        self._sample(SLICES)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        self.tests += report.duration
        if report.when == "teardown" and self.tests - self.sampled_at >= SAMPLE_EVERY_S:
            self._sample(1)

    @pytest.hookimpl(tryfirst=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """The verdict: an over-budget tier fails the session (exit 1) even when every test passed. A session
        stopped early (Ctrl-C, -x, --maxfail, a collection error) ran part of the tier: no verdict."""
        if session.shouldstop or session.shouldfail or exitstatus not in (0, 1):
            return
        self._sample(SLICES)
        self.share = self.meter.read()
        self.judged = True
        if self.over:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        if not self.judged:
            terminalreporter.write_line("tier budget: no verdict, the session stopped early")
            return
        line = (
            f"tier budget: tests took {self.tests:.1f} s = {self.ratio:.1f} reference workloads (the reference: "
            f"{self.reference:.2f} s, the median of {len(self.slices)} slices timed through the session, "
            f"{SLICES * min(self.slices):.2f}-{SLICES * max(self.slices):.2f} s as a whole); budget {self.budget:g}; "
            f"other processes took {self.share.fraction:.0%} of the machine's CPU time"
        )
        if self.shared:
            terminalreporter.write_line(
                f"{line}: NOT JUDGED, the machine was shared (over {SHARED_ABOVE:.0%}); run the tier alone for a "
                "verdict, as CI does",
                yellow=True,
            )
        elif self.over:
            terminalreporter.write_line(
                f"{line}: OVER BUDGET, the session fails. Make tests cheaper, or mark `nightly` a case that "
                "repeats another's behaviour (docs/ci.md, the CPU tier's time budget)",
                red=True,
                bold=True,
            )
        else:
            terminalreporter.write_line(f"{line}: within budget")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "tier_budget_ratio",
        "the CPU tier's budget: its tests' summed seconds over the reference workload's "
        "(distbench/testsuite/budget.py; docs/ci.md says how it was set)",
        default="",
    )
    parser.getgroup("distbench").addoption(
        "--tier-budget",
        choices=("auto", "on", "off"),
        default="auto",
        help="the CPU tier's time budget (tests' summed time over a reference workload's): auto (enforced on "
        "the whole default tier only), on (measured, printed and enforced on any selection), off",
    )


def is_whole_default_tier(config: pytest.Config) -> bool:
    """`pytest` as the README runs it: the testpaths, the addopts' -m, nothing deselected, not a lane."""
    addopts = config.getini("addopts")  # already split, as the shell would
    default_mark = addopts[addopts.index("-m") + 1] if "-m" in addopts else ""
    return (
        config.args_source == pytest.Config.ArgsSource.TESTPATHS
        and not config.option.keyword
        and config.option.markexpr == default_mark
        and not config.getoption("deselect", None)
        and not config.getoption("lf", False)
        and not config.getoption("--distbench-lane", None)
    )


def _budget(config: pytest.Config) -> float:
    """The committed budget (pyproject.toml's tier_budget_ratio); a missing or non-positive one stops the
    session, named."""
    text = str(config.getini("tier_budget_ratio"))
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if value <= 0:
        raise pytest.UsageError(
            f"tier_budget_ratio = {text!r} ([tool.pytest.ini_options] in pyproject.toml): the tier's time "
            "budget must be a positive number of reference workloads"
        )
    return value


def pytest_configure(config: pytest.Config) -> None:
    mode = config.getoption("--tier-budget")
    if config.option.collectonly:
        return
    if mode == "on" or (mode == "auto" and is_whole_default_tier(config)):
        config.pluginmanager.register(TierBudget(_budget(config)))
