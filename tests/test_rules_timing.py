"""Rules about time that decide a verdict: what the CPU tier's budget counts (testsuite/budget.py), how long a
launch's follower waits for rank 0 (runtime/launchwatch.py), and which windows `--until-ci` keeps and
builds its interval from (measure/adaptive.py)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from distbench.measure.adaptive import decide, median_interval, steady_start
from distbench.runtime import launchwatch
from distbench.testsuite import budget


def test_the_budget_counts_every_phase_of_a_test(monkeypatch: pytest.MonkeyPatch) -> None:
    """Setup and teardown (fixtures: a shared suite's ranks, a checkpoint) are the tier's time as much as the
    call: a budget that counted calls only would let a test move its cost into a fixture. A slice of the
    reference workload is timed once SAMPLE_EVERY_S seconds of tests have passed, at a teardown."""
    sampled: list[int] = []

    def reference_workload(slices: int = budget.SLICES) -> float:
        sampled.append(slices)
        return 0.1

    monkeypatch.setattr(budget, "reference_workload", reference_workload)
    tier = budget.TierBudget(2.0)
    tier.pytest_sessionstart()
    assert sampled == [budget.SLICES]
    for when, seconds in [("setup", 3.0), ("call", 0.5), ("teardown", 2.0)]:
        tier.pytest_runtest_logreport(SimpleNamespace(when=when, duration=seconds))
    assert tier.tests == 5.5 and sampled == [budget.SLICES]  # 5.5 s: not yet SAMPLE_EVERY_S
    for when, seconds in [("setup", 4.0), ("call", 0.0)]:
        tier.pytest_runtest_logreport(SimpleNamespace(when=when, duration=seconds))
    assert tier.tests == 9.5 and sampled == [budget.SLICES]
    tier.pytest_runtest_logreport(SimpleNamespace(when="teardown", duration=0.5))
    assert tier.tests == 10.0 and sampled == [budget.SLICES, 1]  # at the teardown that reached 10 s
    assert tier.sampled_at == 10.0
    tier.pytest_runtest_logreport(SimpleNamespace(when="teardown", duration=2.0))
    assert sampled == [budget.SLICES, 1]  # 2 s since the last sample
    assert tier.reference == pytest.approx(0.1)  # SLICES x the median slice, 0.1 / SLICES
    assert tier.ratio == pytest.approx(12.0 / 0.1)


def test_the_budget_is_exceeded_only_past_its_ratio() -> None:
    tier = budget.TierBudget(2.0)
    tier.slices = [0.5] * budget.SLICES  # a reference of 4 s
    tier.tests, tier.judged = 8.0, True
    tier.share = budget.Share(foreign_s=0.0, capacity_s=1.0)  # a judged session has read its share
    assert not tier.over  # exactly at the budget
    tier.tests = 8.01
    assert tier.over
    tier.judged = False
    assert not tier.over  # no verdict, nothing over


@pytest.mark.parametrize("timeout, grace", [(40.0, 10.0), (120.0, 30.0), (600.0, 30.0), (8.0, 2.0)])
def test_a_follower_waits_for_a_job_it_sat_out_and_rank_0s_work_between_jobs(
    timeout: float, grace: float
) -> None:
    """A follower's wait for the next job is rank 0's part of the job the follower sat out (its timeout and
    the grace for late outcomes: a quarter of the timeout, at most 30 s), then what rank 0 does before handing
    out the next (building, checking, writing: within another timeout). Shorter, a slow but healthy rank 0 is
    taken for a dead one; longer, a dead one holds the node for nothing."""
    assert launchwatch.reply_grace(timeout) == grace
    assert launchwatch.hand_out_bound(timeout) == (timeout + grace) + timeout


@pytest.mark.parametrize("kind", ["cpu", "cuda"], ids=["gloo", "nccl"])
def test_a_job_is_bounded_by_the_backend_first_where_it_keeps_the_story(kind: str) -> None:
    """gloo raises in the rank at its timeout (the job fails with tracebacks, the launch goes on): the watch
    comes a grace later. NCCL's watchdog kills the process at its timeout: the watch comes first."""
    group, own = launchwatch.job_bounds(100.0, kind)  # kind: not the suite's device_type parameter
    first, later = (group, own) if kind == "cpu" else (own, group)
    assert (first, later) == (100.0, 125.0)


def test_the_start_dropped_is_the_leading_windows_slower_than_every_later_one() -> None:
    """A leading window is a transient only when slower than every window after it by more than the target;
    one as slow later on (a stall) keeps it, and a slow window that is not leading is never dropped."""
    assert steady_start([1.5, 1.3, 1.0, 1.0, 1.0, 1.0], 0.01) == 2
    assert steady_start([1.5, 1.0, 1.6, 1.0, 1.0, 1.0], 0.01) == 0  # a later window as slow: not a start
    assert steady_start([1.5, 1.6, 1.0, 1.0, 1.0, 1.0], 0.01) == 0  # the very next one counts too
    assert steady_start([1.5, 1.0, 1.0, 1.0], 0.5) == 0  # exactly the target slower: not beyond it
    assert steady_start([1.0, 1.5, 1.0, 1.0, 1.0, 1.0], 0.01) == 0  # the second window stalled: kept
    assert steady_start([1.0101, 1.0, 1.0, 1.0], 0.01) == 1  # beyond the target, by a hair
    assert steady_start([1.0099, 1.0, 1.0, 1.0], 0.01) == 0  # within it
    assert steady_start([3.0, 2.0, 1.5, 1.0, 1.0], 0.01) == 2  # three windows are always kept


def test_the_interval_and_the_cap_come_from_the_steady_windows_only() -> None:
    """The dropped start is in neither the figure's interval nor the cap's count of windows."""
    start = [2.0, 1.0, 1.001, 0.999, 1.0, 1.002, 0.998]
    d = decide(start, 0.01, 12)
    assert d.drop == 1
    assert d.interval == median_interval(start[1:]) == (0.998, 1.002)
    assert not d.more and d.reason == "narrow"
    wide = [2.0, 1.0, 1.1, 0.9, 1.05, 0.95]
    assert decide(wide, 0.01, 6).more  # five steady windows of a cap of six
    assert not decide([*wide, 1.0], 0.01, 6).more


def test_the_interval_is_narrow_only_when_both_ends_lie_within_the_target() -> None:
    low_end = [0.985, 1.0, 1.0, 1.0, 1.0, 1.0]  # the low end 1.5% under the median
    high_end = [1.0, 1.0, 1.0, 1.0, 1.0, 1.015]
    for xs in (low_end, high_end):
        d = decide(xs, 0.01, 12)
        assert d.more and d.reason == "wide" and d.drop == 0, (xs, d)
    assert decide([0.991, 1.0, 1.0, 1.0, 1.0, 1.009], 0.01, 12).reason == "narrow"


def _decision(**kw: Any) -> dict[str, Any]:
    return decide(**kw).to_dict()


def test_a_result_keeps_the_drop_and_the_reason() -> None:
    assert _decision(window_s=[2.0, 1.0, 1.0, 1.0], target=0.01, max_windows=12) == {
        "drop": 1,
        "reason": "too few windows",
    }


def test_an_interval_ending_exactly_at_the_target_is_narrow() -> None:
    """ "Within +/-target" includes its ends (exact in binary: median 1, target 1/2, ends 0.5 and 1.5)."""
    d = decide([0.5, 1.0, 1.0, 1.0, 1.0, 1.5], 0.5, 12)
    assert d.interval == (0.5, 1.5) and d.reason == "narrow" and d.more is False


def test_a_capped_decision_stops_and_keeps_its_dropped_start() -> None:
    d = decide([2.0, 1.0, 1.1, 0.9, 1.05, 0.95, 1.0], 0.01, 6)
    assert d.reason == "cap" and d.more is False and d.drop == 1


def test_the_medians_interval_is_the_narrowest_pair_of_order_statistics_that_still_covers() -> None:
    """Of six windows: (x_(1), x_(6)) covers the median with probability 1 - 2/64 = 0.96875, (x_(2), x_(5))
    0.78, (x_(3), x_(4)) 0.31; the interval is the narrowest pair whose coverage reaches the confidence, the
    confidence itself included."""
    xs = [6.0, 1.0, 5.0, 2.0, 4.0, 3.0]
    assert median_interval(xs, 0.96875) == (1.0, 6.0)
    assert median_interval(xs, 0.97) is None
    assert median_interval(xs, 0.5) == (2.0, 5.0)
    assert median_interval(xs, 0.3) == (3.0, 4.0)
