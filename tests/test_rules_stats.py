"""The gate's statistics (gate/stats.py), held to what each Effect field promises, with expectations computed
here from the formulas the module's docstrings name: the interval and level, the effect the design could
detect with POWER (t quantiles at alpha / 2 and at POWER, times the standard error), the rank test's p beside
it, the noise, and the degenerate cases (identical ratios, a zero on either side of an unpaired comparison)."""

from __future__ import annotations

import math
from decimal import Decimal

import numpy as np
import pytest
from scipy.stats import mannwhitneyu, t, wilcoxon

from distbench.gate import stats


def reach(se: float, df: int, alpha: float) -> float:
    """The smallest shift detected with power 0.8 by a two-sided t test at alpha: (t_{1-a/2} + t_{0.8}) se."""
    return float((t.ppf(1 - alpha / 2, df) + t.ppf(0.8, df)) * se)


D = np.array([0.031, -0.004, 0.022, 0.015, 0.047, 0.009, 0.026])  # seven pairs' ln(head / base)


def test_a_paired_effects_fields_are_the_t_interval_its_power_and_wilcoxon() -> None:
    """Seven log ratios at alpha 0.05: the mean's t interval at level 0.95, the detectable effect
    (t_{0.975, 6} + t_{0.8, 6}) sd / sqrt(7), Wilcoxon's p, and the ratios' own sd as the noise."""
    e = stats.log_ratio_effect(D, 0.05)
    sd, n = D.std(ddof=1), len(D)
    half = t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    assert stats.POWER == 0.8 and e.n == 7 and e.level == pytest.approx(0.95, abs=1e-15)
    assert (e.estimate, e.low, e.high) == pytest.approx(
        (math.expm1(D.mean()), math.expm1(D.mean() - half), math.expm1(D.mean() + half)), rel=1e-12
    )
    assert e.detectable == pytest.approx(math.expm1(reach(sd / math.sqrt(n), n - 1, 0.05)), rel=1e-12)
    assert e.p_value == pytest.approx(float(wilcoxon(D).pvalue), rel=1e-12) and 0 < e.p_value < 0.05
    assert e.noise == pytest.approx(sd, rel=1e-12)


@pytest.mark.parametrize("ratio", [0.0, 0.01, 1.0])
def test_identical_ratios_collapse_the_interval_onto_the_estimate(ratio: float) -> None:
    """Five pairs with the same log ratio: nothing is spread, so the interval is the estimate, the design
    would detect any change (0) and the noise is 0. Both intervals report Wilcoxon's p for the same pairs: 1
    for no change (no rank to test), else the test's own 2 / 2^5 = 0.0625 (five of one sign), never 0."""
    d = np.full(5, ratio)
    for effect in (stats.log_ratio_effect, stats.trimmed_log_ratio_effect):
        e = effect(d, 0.01)
        assert e.low == e.high == e.estimate == pytest.approx(math.expm1(ratio)), effect
        assert (e.detectable, e.noise, e.level, e.n) == (0.0, 0.0, pytest.approx(0.99), 5), effect
    for effect in (stats.log_ratio_effect, stats.trimmed_log_ratio_effect):
        assert effect(d, 0.01).p_value == (1.0 if ratio == 0 else pytest.approx(0.0625)), effect


def test_a_trimmed_effects_fields_are_tukey_mclaughlins() -> None:
    """Six pairs, one far off: one pair trimmed a side (20% of 6), the kept four's mean; the winsorized sd
    over (1 - 2 x 0.2) sqrt(6) as the standard error, with 4 - 1 degrees of freedom for the interval and
    the detectable effect; the winsorized sd as the noise, Wilcoxon's p over all six."""
    d = np.array([0.012, 0.018, 0.35, 0.009, 0.015, 0.021])
    s = np.sort(d)
    kept = s[1:5]
    wins = np.r_[s[1], kept, s[4]]
    se = wins.std(ddof=1) / ((1 - 2 * 0.2) * math.sqrt(6))
    half = t.ppf(0.995, 3) * se
    e = stats.trimmed_log_ratio_effect(d, 0.01)
    assert e.n == 6 and e.level == pytest.approx(0.99, abs=1e-15)
    assert (e.estimate, e.low, e.high) == pytest.approx(
        (math.expm1(kept.mean()), math.expm1(kept.mean() - half), math.expm1(kept.mean() + half)), rel=1e-9
    )
    assert e.detectable == pytest.approx(math.expm1(reach(se, 3, 0.01)), rel=1e-9)
    assert e.p_value == pytest.approx(float(wilcoxon(d).pvalue), rel=1e-12)
    assert e.noise == pytest.approx(wins.std(ddof=1), rel=1e-12)


def test_an_unpaired_effect_is_welchs_on_logs_with_mann_whitney_beside() -> None:
    """Five base runs and seven head runs (seconds, below 1) of unequal spread: Welch's t interval on the
    logs, its Welch-Satterthwaite degrees of freedom (rounded down) for the detectable effect, Mann-Whitney's
    two-sided p, the noise the root of the sides' mean variance, and n the smaller side."""
    base = np.array([0.301, 0.305, 0.298, 0.310, 0.303])
    head = np.array([0.318, 0.331, 0.309, 0.342, 0.322, 0.315, 0.336])
    lb, lh = np.log(base), np.log(head)
    vb, vh = lb.var(ddof=1), lh.var(ddof=1)
    se = math.sqrt(vb / 5 + vh / 7)
    df = (vb / 5 + vh / 7) ** 2 / ((vb / 5) ** 2 / 4 + (vh / 7) ** 2 / 6)
    d, half = lh.mean() - lb.mean(), t.ppf(0.975, df) * se
    e = stats.unpaired_effect(list(base), list(head), 0.05)
    assert e.n == 5 and e.level == pytest.approx(0.95, abs=1e-15) and 0.05 < df % 1 < 0.95  # not near a whole
    assert (e.estimate, e.low, e.high) == pytest.approx(
        (math.expm1(d), math.expm1(d - half), math.expm1(d + half)), rel=1e-9
    )
    assert e.detectable == pytest.approx(math.expm1(reach(se, int(df), 0.05)), rel=1e-9)
    p = float(mannwhitneyu(head, base, alternative="two-sided").pvalue)
    assert e.p_value == pytest.approx(p, rel=1e-12) and e.p_value < 0.01
    assert e.noise == pytest.approx(math.sqrt((vb + vh) / 2), rel=1e-12)
    # the sides the other way round: the same interval, mirrored
    r = stats.unpaired_effect(list(head), list(base), 0.05)
    assert (r.estimate, r.low, r.high) == pytest.approx(
        (math.expm1(-d), math.expm1(-d - half), math.expm1(-d + half)), rel=1e-9
    )


@pytest.mark.parametrize(
    "base, head, scale",
    [
        ([0.0, 10.0, 20.0, 14.0], [10.0, 20.0, 30.0], 11.0),  # a zero in the base
        ([10.0, 20.0, 30.0], [0.0, 10.0, 25.0, 5.0], 20.0),  # a zero in the head
        ([0.0, 0.0, 0.0], [1.0, 2.0, 4.0], 1.0),  # an all-zero base: no relative change, absolute
    ],
)
def test_an_unpaired_effect_with_a_zero_is_relative_to_the_base_mean(base, head, scale) -> None:
    """A memory figure of 0 (the component offloaded) has no log: both sides are divided by the base's mean
    (1 when that is 0), and the effect is the difference of means on that scale, not exp()-ed."""
    b, h = np.array(base) / scale, np.array(head) / scale
    vb, vh = b.var(ddof=1), h.var(ddof=1)
    se = math.sqrt(vb / len(b) + vh / len(h))
    df = (vb / len(b) + vh / len(h)) ** 2 / (
        (vb / len(b)) ** 2 / (len(b) - 1) + (vh / len(h)) ** 2 / (len(h) - 1)
    )
    d, half = h.mean() - b.mean(), t.ppf(0.95, df) * se
    e = stats.unpaired_effect(base, head, 0.1)
    assert e.n == 3
    assert (e.estimate, e.low, e.high) == pytest.approx((d, d - half, d + half), rel=1e-9)
    assert e.detectable == pytest.approx(reach(se, max(1, int(df)), 0.1), rel=1e-9)
    assert e.noise == pytest.approx(math.sqrt((vb + vh) / 2), rel=1e-12)


@pytest.mark.parametrize("head, estimate, p", [([2.0, 2.0, 2.0], 1.0, 0.0), ([1.0, 1.0, 1.0], 0.0, 1.0)])
def test_unpaired_sides_without_spread_collapse_the_interval(head, estimate, p) -> None:
    """Three runs a side that repeat to the byte: the interval is the estimate (+100%, or none), nothing more
    is detectable, and p says certain."""
    e = stats.unpaired_effect([1.0, 1.0, 1.0], head, 0.05)
    assert (e.estimate, e.low, e.high) == pytest.approx((estimate, estimate, estimate))
    assert (e.detectable, e.p_value, e.noise, e.n) == (0.0, p, 0.0, 3)


def test_three_runs_a_side_are_enough_and_two_are_refused() -> None:
    """MIN_RUNS is the fewest a side: three runs give an effect, two are refused, naming both counts."""
    assert stats.MIN_RUNS == 3
    assert stats.unpaired_effect([1.0, 1.1, 1.2], [1.0, 1.1, 1.2], 0.05).n == 3
    with pytest.raises(ValueError, match="^an unpaired effect needs at least 3 runs a side, got 2/4$"):
        stats.unpaired_effect([1.0, 1.1], [1.0, 1.1, 1.2, 1.3], 0.05)


def test_bad_values_are_refused_each_with_its_own_message() -> None:
    """What is wrong is named: a value that is not positive and finite, pairs that do not pair, too few
    pairs (one value is too few pairs, not a bad value), a ratio that is not finite, an empty round."""
    positive = "^effects are computed on positive, finite values$"
    for bad in ([1.0, float("nan"), 2.0], [1.0, float("inf"), 2.0], [1.0, 0.0, 2.0], []):
        with pytest.raises(ValueError, match=positive):
            stats.paired_effect(bad, [1.0] * len(bad), 0.05)
    with pytest.raises(ValueError, match="^paired effect needs as many base as head values, got 3 and 4$"):
        stats.paired_effect([1.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0], 0.05)
    with pytest.raises(ValueError, match="^a paired effect needs at least 3 pairs, got 1$"):
        stats.paired_effect([1.0], [1.0], 0.05)
    with pytest.raises(ValueError, match="^a paired effect needs at least 3 pairs, got 2$"):
        stats.trimmed_log_ratio_effect(np.array([0.01, 0.02]), 0.05)
    with pytest.raises(ValueError, match="^log ratios must be finite$"):
        stats.log_ratio_effect(np.array([0.01, np.inf, 0.02]), 0.05)
    with pytest.raises(ValueError, match="^every round needs at least one pair of windows$"):
        stats.interleaved_effect([[0.1], []], 0.05)


def test_figures_are_any_real_numbers() -> None:
    """Figures as Decimals (a JSON reader with parse_float=Decimal) give the effect their floats give."""
    base, head = [1.00, 1.02, 0.99, 1.01], [1.03, 1.05, 1.02, 1.04]
    e = stats.paired_effect([Decimal(str(x)) for x in base], [Decimal(str(x)) for x in head], 0.05)
    assert e == stats.paired_effect(base, head, 0.05)
    u = stats.unpaired_effect([Decimal(str(x)) for x in base], [Decimal(str(x)) for x in head], 0.05)
    assert u == stats.unpaired_effect(base, head, 0.05)


def test_a_round_of_one_window_pair_is_its_own_ratio() -> None:
    """A round with a single pair of windows has nothing to trim: its ratio is that pair's."""
    e = stats.interleaved_effect([[0.01], [0.02], [0.03]], 0.05)
    assert e.estimate == pytest.approx(math.expm1(0.02)) and e.n == 3


def test_the_family_alpha_is_split_over_tests_and_looks_and_must_be_below_a_half() -> None:
    """Bonferroni: 0.05 over 5 tests is 0.01 a test (one look unless told), over 5 tests x 2 looks 0.005;
    alpha must lie strictly between 0 and 0.5."""
    assert stats.family_alpha(0.05, 5) == pytest.approx(0.01)
    assert stats.family_alpha(0.05, 5, 1) == pytest.approx(0.01)
    assert stats.family_alpha(0.05, 5, 2) == pytest.approx(0.005)
    assert stats.family_alpha(0.05, 0, 0) == pytest.approx(0.05)
    for bad in (0.0, 0.5, -0.1):
        with pytest.raises(ValueError, match="alpha must be between 0 and 0.5"):
            stats.family_alpha(bad, 3)


@pytest.mark.parametrize("direction", [-1, 1])
def test_an_effect_of_exactly_min_effect_is_decided(direction: int) -> None:
    """min_effect is "at least": an interval wholly on one side with its estimate exactly min_effect from 0
    is a regression, or an improvement, not merely unchanged."""
    worse = stats.Effect(6, 0.01, 0.005, 0.02, 0.99, 0.0, 0.01, 0.0)
    better = stats.Effect(6, -0.01, -0.02, -0.005, 0.99, 0.0, 0.01, 0.0)
    regression, improvement = (worse, better) if direction < 0 else (better, worse)
    assert stats.verdict(regression, direction, threshold=0.02, min_effect=0.01) == stats.REGRESSION
    assert stats.verdict(improvement, direction, threshold=0.02, min_effect=0.01) == stats.IMPROVEMENT


def test_only_a_spread_of_zero_collapses_the_interval() -> None:
    """The collapse is for ratios that agree exactly, not for a spread of one in log units: three pairs at
    ln ratios -1, 0, 1 (sd exactly 1) and three whose trimmed standard error is exactly 1 keep intervals as
    wide as t gives them."""
    from scipy.stats import mstats

    d = np.array([-1.0, 0.0, 1.0])
    assert d.std(ddof=1) == 1.0
    e = stats.log_ratio_effect(d, 0.05)
    half = t.ppf(0.975, 2) / math.sqrt(3)
    assert (e.low, e.high) == (pytest.approx(math.expm1(-half)), pytest.approx(math.expm1(half)))
    d = np.array([-1.0, 0.0, 1.0]) / float(mstats.trimmed_stde(np.array([-1.0, 0.0, 1.0]), limits=(0.2, 0.2)))
    assert float(mstats.trimmed_stde(d, limits=(0.2, 0.2))) == 1.0
    e = stats.trimmed_log_ratio_effect(d, 0.05)
    assert e.low < e.estimate < e.high
    assert (e.low, e.high) == (
        pytest.approx(math.expm1(-t.ppf(0.975, 2))),
        pytest.approx(math.expm1(t.ppf(0.975, 2))),
    )
