"""Claims about time that a noisy machine may leave undecided.

A bound on a figure measured with noise (an overhead of at most 1%, a counter within 2% of a clock) holds
where the figure's interval lies inside it, fails where the interval lies wholly outside, and is undecided
where the interval straddles its edge: more samples, a quieter machine or a lower-noise figure are needed.
Undecided is not a defect of the code under test, so it does not fail a test session: a test raises
`Undecided` and the pytest plugin reports it as UNDECIDED, with the interval and the reason, in the test's
report and the session's summary. A planted defect of the size the claim is about must still fail, so a
claim takes samples until it is decided or its budget runs out (`decide`), and each look spends a share of
its error rate (Bonferroni), so looking again does not make a false failure likelier. Where a few samples
stall far out (a round whose one side waited on the host or a clock dip), the trimmed mean's interval keeps
the claim decidable (`trim`). The time a fixed piece
of work takes only grows when something else runs beside it; for such a time `decide_time` bounds the
claim by its least and most disturbed samples, which needs far fewer samples than an interval of the mean.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: user_properties key of an undecided test's report (the plugin's, and the lanes' replay's)
UNDECIDED_KEY = "distbench_undecided"
#: A claim's chance of failing on noise alone, over all its looks. A session holds a few dozen claims.
ALPHA = 1e-3

HOLDS, FAILS, UNDECIDED = "holds", "fails", "undecided"


class Undecided(Exception):
    """The machine's noise leaves the claim undecided: reported, neither a failure nor a pass."""


@dataclass(frozen=True)
class Interval:
    """An estimate with its confidence interval (in the claim's own unit)."""

    estimate: float
    low: float
    high: float
    n: int

    def __str__(self) -> str:
        return f"{self.estimate:.4g} [{self.low:.4g}, {self.high:.4g}] (n={self.n})"


def mean_interval(samples: Sequence[float], alpha: float, trim: float = 0.0) -> Interval:
    """Student's t interval of the samples' mean at level 1 - alpha; at least 2 samples. With `trim` > 0:
    Yuen's interval of the trimmed mean (the floor(trim * n) least and greatest samples left out, the spread
    taken from the winsorized samples; Wilcox, Introduction to Robust Estimation, 5.3), which keeps its level
    where a few samples are far out (a round that stalled)."""
    from scipy.stats import t

    n = len(samples)
    estimate, se, df = _center(samples, trim)
    if n < 2 or df < 1:
        raise ValueError(f"an interval needs at least 2 samples left after trimming; {n} at trim {trim}")
    half = t.ppf(1 - alpha / 2, df) * se
    return Interval(estimate, estimate - half, estimate + half, n)


def _center(samples: Sequence[float], trim: float) -> tuple[float, float, int]:
    """(trimmed mean, its standard error, degrees of freedom); trim 0: the mean's."""
    n = len(samples)
    g = math.floor(trim * n)
    h = n - 2 * g
    if h < 2:
        return math.nan, math.nan, h - 1
    xs = sorted(samples)
    winsorized = [xs[g]] * g + xs[g : n - g] + [xs[n - g - 1]] * g
    se = math.sqrt((n - 1) * statistics.variance(winsorized) / (h * (h - 1)))
    return statistics.fmean(xs[g : n - g]), se, h - 1


def within(iv: Interval, low: float = -math.inf, high: float = math.inf) -> str:
    """HOLDS where the interval lies inside [low, high], FAILS where it lies wholly outside, else UNDECIDED."""
    if low <= iv.low and iv.high <= high:
        return HOLDS
    if iv.high < low or iv.low > high:
        return FAILS
    return UNDECIDED


def settle(verdict: str, what: str, iv: object, why: str = "") -> None:
    """Turn a verdict into the test's outcome: nothing when it holds, AssertionError when it fails,
    Undecided (with the interval and `why`) when the noise leaves it open."""
    if verdict == FAILS:
        raise AssertionError(f"{what}: {iv}")
    if verdict == UNDECIDED:
        raise Undecided(f"{what}: {iv}" + (f"; {why}" if why else ""))


@dataclass
class Decision:
    verdict: str
    interval: Interval
    samples: list[float]
    seconds: float


def decide(
    draw: Callable[[], float],
    low: float = -math.inf,
    high: float = math.inf,
    *,
    first: int = 4,
    most: int = 16,
    budget_s: float = 60.0,
    alpha: float = ALPHA,
    trim: float = 0.0,
) -> Decision:
    """Draw samples of a figure until the interval of its mean (trimmed by `trim`, mean_interval) is decided
    against [low, high]: a look after `first` samples, then after each new one, up to `most` samples or
    `budget_s` seconds (at least `first` are drawn). Each of the at most most - first + 1 looks is judged at
    alpha / looks. A claim the noise seen so far could not decide even at `most` samples stops early,
    UNDECIDED: its budget would buy nothing (a host-bound step whose rounds spread by 10-30%)."""
    from scipy.stats import t

    looks = most - first + 1
    a = alpha / looks
    df_most = most - 2 * math.floor(trim * most) - 1
    t0 = time.monotonic()
    samples = [draw() for _ in range(first)]
    while True:
        iv = mean_interval(samples, a, trim)
        verdict = within(iv, low, high)
        se = _center(samples, trim)[1]
        reach = t.ppf(1 - a / 2, df_most) * se * math.sqrt(len(samples) / most)  # the half-width at `most`
        hopeless = len(samples) >= first + 2 and any(
            abs(iv.estimate - edge) < reach for edge in (low, high) if math.isfinite(edge)
        )
        if verdict != UNDECIDED or hopeless or len(samples) >= most or time.monotonic() - t0 >= budget_s:
            return Decision(verdict, iv, samples, time.monotonic() - t0)
        samples.append(draw())


def decide_time(
    draw: Callable[[], float],
    high: float,
    *,
    first: int = 3,
    most: int = 8,
    budget_s: float = 60.0,
    agree: float = 1.5,
) -> Decision:
    """Draw seconds of a fixed piece of work until a bound on them is decided. Interference only adds time, so
    the work's own time is at most the least disturbed sample: the bound HOLDS as soon as one sample is
    within it. It FAILS when `first` or more samples all exceed it and agree (the largest at most `agree`
    times the least: a lasting cost, not a burst of interference); otherwise more are drawn, up to `most` or
    `budget_s`, and it is UNDECIDED. The interval reported is [least, most] of the samples, around their
    median."""
    t0 = time.monotonic()
    samples = [draw()]
    while True:
        iv = Interval(statistics.median(samples), min(samples), max(samples), len(samples))
        if iv.low <= high:
            verdict = HOLDS
        elif len(samples) >= first and iv.high <= agree * iv.low:
            verdict = FAILS
        else:
            verdict = UNDECIDED
        if verdict != UNDECIDED or len(samples) >= most or time.monotonic() - t0 >= budget_s:
            return Decision(verdict, iv, samples, time.monotonic() - t0)
        samples.append(draw())
