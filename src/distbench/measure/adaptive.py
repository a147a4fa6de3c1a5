"""How long to measure: until the run's figure would repeat, not for a fixed count of steps.

A run's step time is the median over its timed windows of the slowest rank's wall clock per step
(results.py). Ten steps in one window left that figure 15-40% apart between runs of one commit on an idle
2-GPU machine: a single window cannot tell a slow phase of the host from the run's speed. So the bench job
times windows of equal length and after each one asks `decide`:

* steady state is found, not assumed: a leading window slower than every later one by more than the target
  is a start-up transient (allocator growth, autotuning, clocks ramping) and leaves the timed set (it counts
  as warm-up). Slower than their median was the first rule: on one H200 it took noise for a transient and
  dropped 5 of 8 windows of a host-bound run whose windows spread +/-10%;
* the figure is the median of the remaining windows, and its 95% confidence interval comes from order
  statistics (distribution-free: window times are skewed, one window in several is a stall), so a stall
  widens the interval instead of moving the figure;
* timing stops once that interval lies within +/-target of the median, or at the cap of steady windows
  (a dropped start is made up for, so a capped run still has its interval), and the result says which (a
  capped run's interval is its honest spread).

Every rank takes the same decision from the same numbers: the window walls are max-reduced across ranks
before `decide` sees them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from scipy.stats import binom

#: the confidence of the median's interval
CONFIDENCE = 0.95


def median_interval(xs: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Distribution-free interval of the median: the widest symmetric pair of order statistics (x_(k),
    x_(n-k+1)) whose coverage 1 - 2 * P(Binomial(n, 1/2) < k) still reaches `confidence`; None when even
    (min, max) does not (fewer than 6 samples at 95%)."""
    n = len(xs)
    s = sorted(xs)
    best = None
    for k in range(1, n // 2 + 1):
        if 1 - 2 * binom.cdf(k - 1, n, 0.5) >= confidence:
            best = (s[k - 1], s[n - k])
        else:
            break
    return best


def steady_start(xs: list[float], target: float) -> int:
    """How many leading windows are a start-up transient: each slower than every window after it by more than
    the target. At least three windows are always kept."""
    k = 0
    while len(xs) - k > 3 and xs[k] > max(xs[k + 1 :]) * (1 + target):
        k += 1
    return k


@dataclass(frozen=True)
class Decision:
    more: bool  # time another window
    drop: int  # leading windows that are warm-up, not steady state
    interval: tuple[float, float] | None  # of the median of the steady windows
    reason: str  # "narrow", "cap" or "too few windows"

    def to_dict(self) -> dict[str, object]:
        """What a result keeps of it; the interval it keeps once, as results.py computes it from the windows."""
        return {"drop": self.drop, "reason": self.reason}


def decide(window_s: list[float], target: float, max_windows: int) -> Decision:
    """After the windows timed so far (seconds per step, slowest rank): time another one, or stop."""
    drop = steady_start(window_s, target)
    steady = window_s[drop:]
    interval = median_interval(steady)
    med = statistics.median(steady)
    narrow = interval is not None and med * (1 - target) <= interval[0] and interval[1] <= med * (1 + target)
    if narrow:
        return Decision(False, drop, interval, "narrow")
    if len(steady) >= max_windows:  # the cap counts steady windows: a dropped start is made up for
        return Decision(False, drop, interval, "cap")
    return Decision(True, drop, interval, "too few windows" if interval is None else "wide")
