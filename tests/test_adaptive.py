"""measure/adaptive.py: time until the figure repeats. The interval is checked against its definition (order
statistics of the binomial), the rules against series whose answer is known by construction."""

from __future__ import annotations

import random

from distbench.measure.adaptive import decide, median_interval, steady_start


def test_the_median_interval_is_the_widest_order_statistics_pair_at_95_percent() -> None:
    assert median_interval([1.0] * 5) is None  # (min, max) of 5 covers 93.75% < 95%
    xs = [float(i) for i in range(1, 7)]
    assert median_interval(xs) == (1.0, 6.0)  # 6 samples: 1 - 2/64 = 96.9%
    # 20 samples: k = 6 covers 1 - 2 P(B(20, .5) <= 5) = 95.9%, k = 7 only 88.5%
    assert median_interval([float(i) for i in range(1, 21)]) == (6.0, 15.0)


def test_a_slow_start_is_warm_up_and_the_rest_is_kept() -> None:
    assert steady_start([1.3, 1.1, 1.0, 1.0, 1.01, 0.99], 0.01) == 2
    assert steady_start([1.0, 1.0, 1.01, 0.99, 1.0], 0.01) == 0
    assert steady_start([2.0, 2.0, 2.0], 0.01) == 0  # three windows are always kept
    # noise is not a transient: a first window inside the later ones' spread stays (an H200 run's windows)
    assert steady_start([1.051, 1.042, 0.97, 1.12, 1.005, 1.078, 1.106, 1.107], 0.01) == 0


def test_timing_stops_once_the_interval_is_narrow_and_not_before() -> None:
    rng = random.Random(0)
    quiet = [1.0 + rng.uniform(-0.004, 0.004) for _ in range(6)]
    d = decide(quiet, 0.01, 12)
    assert not d.more and d.reason == "narrow" and d.drop == 0
    assert decide(quiet[:5], 0.01, 12).more  # five windows give no 95% interval yet
    noisy = [1.0 + rng.uniform(-0.1, 0.1) for _ in range(8)]
    assert decide(noisy, 0.01, 12).more
    capped = decide(noisy + [1.0] * 4, 0.01, 12)
    assert not capped.more and capped.reason == "cap" and capped.interval is not None
    # a dropped start is made up for: six steady windows, so the capped figure has its interval
    start = [1.5, 1.0, 1.05, 0.95, 1.1, 0.9, 1.0]
    assert decide(start[:6], 0.01, 6).more and not decide(start, 0.01, 6).more


def test_a_stall_widens_the_interval_instead_of_moving_the_figure() -> None:
    steady = [1.0, 1.002, 0.998, 1.001, 0.999, 1.0, 1.0]
    d = decide([*steady, 1.4], 0.01, 12)  # one stalled window of eight: (x_(1), x_(8)) holds it
    assert d.more and d.interval is not None and d.interval[1] == 1.4
