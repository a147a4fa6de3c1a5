"""The change-point detector's significance rule (history/changepoints.py), held to what it promises: `alpha` is
the false-alarm rate of a whole series, so the candidates tested at once share it (Bonferroni), and pure noise
draws a change in at most about `alpha` of series."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import binom

from distbench.history import changepoints


def test_candidates_tested_together_share_alpha(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three candidates at p = 0.005 each, alpha 0.01: against 0.01 / 3 one goes; the two left pass 0.01 / 2
    (the level is corrected for the candidates still tested, not the first count). Without the correction
    all three stay; with a strict `<` the last two fall too."""
    monkeypatch.setattr(changepoints, "candidates", lambda x: [10, 20, 30])
    monkeypatch.setattr(changepoints, "split_p_value", lambda y, rng: 0.005)
    steps = np.repeat([1.0, 1.1, 1.2, 1.3], 10)
    changes = changepoints.find_changes(steps, alpha=0.01)
    assert len(changes) == 2 and all(c.p_value == 0.005 for c in changes), changes
    # one candidate alone is tested at alpha itself
    monkeypatch.setattr(changepoints, "candidates", lambda x: [20])
    monkeypatch.setattr(changepoints, "split_p_value", lambda y, rng: 0.01)
    assert [c.index for c in changepoints.find_changes(steps, alpha=0.01)] == [20]


def test_the_least_significant_candidate_goes_and_the_rest_are_retested(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Candidates at 10, 20 and 30, each tested within its neighbours' segment, at p 0.001, 0.02 and 0.004
    (alpha 0.01): the one at 0.02 goes, and the other two, retested within their new neighbours' segments,
    stay (p at most 0.01 / 2)."""
    ps = {(0, 20): 0.001, (10, 30): 0.02, (20, 50): 0.004, (0, 30): 0.001, (10, 50): 0.004}
    monkeypatch.setattr(changepoints, "candidates", lambda x: [10, 20, 30])
    seen: list[tuple[int, int]] = []

    def p_of(y: np.ndarray, rng: np.random.Generator) -> float:
        lo = 10 * round(float(y[0]))  # log level i starts at point 10 i
        seen.append((lo, lo + len(y)))
        return ps[seen[-1]]

    monkeypatch.setattr(changepoints, "split_p_value", p_of)
    levels = np.exp(np.repeat([0.0, 1.0, 2.0, 3.0], [10, 10, 10, 20]))
    changes = changepoints.find_changes(levels, alpha=0.01)
    assert [(c.index, c.p_value) for c in changes] == [(10, 0.001), (30, 0.004)]
    assert seen[:5] == [(0, 20), (10, 30), (20, 50), (0, 30), (10, 50)]


def noise(seed: int, n: int) -> np.ndarray:
    """n figures of one level: uniform +-1% for even seeds, normal at 1% for odd ones."""
    rng = np.random.default_rng(seed)
    spread = rng.uniform(-0.01, 0.01, n) if seed % 2 == 0 else rng.normal(0, 0.01, n)
    return 1.0 + spread


@pytest.mark.parametrize("alpha", [0.05, 0.2])
def test_pure_noise_draws_a_change_in_at_most_alpha_of_series(alpha: float) -> None:
    """200 series of 40 points of noise: the number with any change stays below the 99.9% quantile of
    Binomial(200, alpha), what a detector whose false-alarm rate is alpha can reach. (Measured at 0.05: 7.)
    A detector testing each candidate at alpha plus its search's choice, or reading p the wrong way round,
    goes past it."""
    series = 200
    alarms = sum(bool(changepoints.find_changes(noise(s, 40), alpha=alpha, seed=s)) for s in range(series))
    assert alarms <= binom.ppf(0.999, series, alpha), alarms


def one_change_at(monkeypatch: pytest.MonkeyPatch, index: int) -> None:
    """The search proposes `index` and the permutation test finds it significant."""
    monkeypatch.setattr(changepoints, "candidates", lambda x: [index])
    monkeypatch.setattr(changepoints, "split_p_value", lambda y, rng: 0.001)


def test_a_changes_interval_is_welchs_on_the_log_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    """Segments of unequal size and spread: the ratio's interval is Welch's (unequal variances,
    Welch-Satterthwaite degrees of freedom) at 1 - alpha, computed here from its formula, exp()-ed back."""
    from scipy.stats import t

    rng = np.random.default_rng(5)
    a, b = rng.normal(0.0, 0.002, 6), rng.normal(0.4, 0.03, 10)
    one_change_at(monkeypatch, 6)
    (c,) = changepoints.find_changes(np.exp(np.r_[a, b]), alpha=0.05)
    va, vb = a.var(ddof=1) / len(a), b.var(ddof=1) / len(b)
    df = (va + vb) ** 2 / (va**2 / (len(a) - 1) + vb**2 / (len(b) - 1))
    d, half = b.mean() - a.mean(), t.ppf(0.975, df) * np.sqrt(va + vb)
    assert c.index == 6 and c.ratio == pytest.approx(np.exp(d), rel=1e-12)
    assert (c.low, c.high) == (
        pytest.approx(np.exp(d - half), rel=1e-9),
        pytest.approx(np.exp(d + half), rel=1e-9),
    )


def test_two_constant_segments_have_the_ratio_as_their_whole_interval(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A noise-free figure (a memory peak) that steps: no spread to speak of, so the interval is the ratio."""
    one_change_at(monkeypatch, 5)
    (c,) = changepoints.find_changes([1.0] * 5 + [2.0] * 5)
    assert c.low == c.high == pytest.approx(c.ratio) == pytest.approx(2.0)
    assert (c.before, c.after) == (pytest.approx(1.0), pytest.approx(2.0))


def test_a_change_goes_to_the_best_commit_boundary_when_it_gains_nearly_as_much() -> None:
    """Ranks whose best split (before point 2) falls inside commit a: the boundary a|b gains 9.375 of its
    9.6 (at least BOUNDARY_GAIN_SHARE), b|c nothing; the change goes to a|b, the best of the boundaries, not
    merely the last one."""
    y = np.array([7, 10, 6, 8, 5, 4, 3, 9, 11, 2, 12, 1], dtype=float)
    commits = ["a"] * 4 + ["b"] * 4 + ["c"] * 4
    assert changepoints.best_split(y) == 2
    assert changepoints.best_split(y, commits) == 4
    assert changepoints.best_split(y, ["a"] * 12) == 2  # no boundary: the best split


def _alternating(n: int, level: float = 0.0) -> np.ndarray:
    """n points alternating level, level + 1: consecutive differences of 1, a noise sigma of 1.4826 / sqrt(2)."""
    return level + np.tile([0.0, 1.0], n // 2 + 1)[:n]


def test_a_split_is_placed_by_values_clipped_at_eight_sigmas() -> None:
    """Values, not ranks, place a split: behind 30 points whose last lies 2.5 sigmas high, a 16-sigma step
    stays at point 30 (clipped at 4 sigmas it went one point early). And the clip is what keeps one point far
    off (1000 sigmas) from pulling a 5-sigma step's split to the pair it ends."""
    assert changepoints.CLIP_SIGMAS == 8.0
    sigma = changepoints.noise_scale(_alternating(30))
    before = _alternating(30)
    before[-1] = 0.5 + 2.5 * sigma
    step = np.r_[before, _alternating(4, 16 * sigma)]
    assert changepoints.best_split(step) == 30
    outlier = np.r_[_alternating(12), _alternating(4, 5 * sigma), 5 * sigma, 1000.0]
    assert changepoints.best_split(outlier) == 12


#: a commit's first run short of its level (as on an H200, results/history-h200-2026-11-28): on values the best
#: split is before point 7, one run into commit b; the boundary before point 6 gains 0.972 of it
FIRST_RUN_SHORT = np.array([0, 1, 0, 1, 0, 1, 5, 10, 11, 10, 11, 10], dtype=float)


def test_a_change_one_run_into_a_commit_goes_back_to_its_boundary() -> None:
    y = FIRST_RUN_SHORT
    assert changepoints.best_split(y) == 7
    assert changepoints.best_split(y, ["a"] * 6 + ["b"] * 6) == 6
    assert changepoints.best_split(y, ["a"] * 7 + ["b"] * 5) == 7  # there the boundary is the best split


def test_a_point_weighs_at_most_clip_sigmas_from_the_median() -> None:
    y = np.r_[_alternating(9), 1000.0]
    sigma = changepoints.noise_scale(y)
    clipped = changepoints._clipped(y)
    assert clipped[-1] == changepoints.CLIP_SIGMAS
    assert clipped[:-1] == pytest.approx((y[:-1] - np.median(y)) / sigma)
    assert changepoints._clipped(-y)[-1] == -changepoints.CLIP_SIGMAS


def test_a_boundary_gaining_exactly_the_share_takes_the_change() -> None:
    """The share is "at least": ranks whose best split (before point 6) gains 630^2 / (6 * 15 * 21) = 210 and
    whose only commit boundary (before point 2) gains 399^2 / (2 * 19 * 21) = 199.5, exactly 0.95 of it, put
    the change at the boundary. (Each gain is (m L - S k)^2 / (k (m - k) m), L the left ranks' sum, S all of
    them.)"""
    y = np.array([2, 1, 8, 7, 12, 6, 14, 15, 4, 19, 16, 17, 18, 13, 3, 20, 21, 11, 10, 5, 9], dtype=float)
    assert changepoints.BOUNDARY_GAIN_SHARE == 0.95
    assert changepoints.best_split(y) == 6
    assert changepoints.best_split(y, ["a"] * 2 + ["b"] * 19) == 2


def test_each_change_is_measured_between_its_neighbours(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three noise-free levels 1, 2 and 4 (ten points each), changes before points 10 and 20: each change's
    medians and ratio are its own two segments', 1 -> 2 and 2 -> 4, never a segment reaching past a
    neighbouring change."""
    monkeypatch.setattr(changepoints, "candidates", lambda x: [10, 20])
    monkeypatch.setattr(changepoints, "split_p_value", lambda y, rng: 0.001)
    changes = changepoints.find_changes(np.repeat([1.0, 2.0, 4.0], 10))
    got = [(c.index, *np.round([c.before, c.after, c.ratio, c.low, c.high], 12)) for c in changes]
    assert got == [(10, 1.0, 2.0, 2.0, 2.0, 2.0), (20, 2.0, 4.0, 2.0, 2.0, 2.0)], changes


def test_a_step_no_shuffle_matches_is_reported_at_the_tests_floor() -> None:
    """20 runs at one level and 20 at +50% (1% noise): no shuffle of the 40 ranks splits them as well (that
    takes the same 20 on one side: 2 / C(40, 20) of shuffles), so the change's p-value is the smallest the
    test can give, 1 / (999 + 1), measured on the whole series either side of it."""
    x = np.r_[np.ones(20), 1.5 * np.ones(20)] * (1 + np.random.default_rng(1).uniform(-0.01, 0.01, 40))
    (c,) = changepoints.find_changes(x)
    assert changepoints.PERMUTATIONS == 999
    assert (c.index, c.p_value) == (20, 0.001)


def test_the_permutation_p_value_of_small_and_flat_segments() -> None:
    """Three points leave no split with MIN_SIZE a side: p is 1. Four have one split, in the middle, and a
    shuffle matches it when it puts the same pair on one side: 8 of the 24 orders, p about 1/3. A flat
    segment's split gains nothing, and every shuffle gains as much: p is 1."""
    rng = np.random.default_rng(0)
    assert changepoints.split_p_value(np.array([0.0, 1.0, 2.0]), rng) == 1.0
    assert changepoints.split_p_value(np.array([0.0, 1.0, 2.0, 3.0]), rng) == pytest.approx(1 / 3, abs=0.05)
    assert changepoints.split_p_value(np.zeros(10), rng) == 1.0


def test_the_search_proposes_a_split_of_four_points_and_none_of_three() -> None:
    """Four points are two segments of MIN_SIZE: a clear step between them is proposed (the permutation test
    judges it later). Three cannot be split: no candidate, and no change, rather than an error."""
    assert changepoints.candidates(np.log([1.0, 1.0, 2.0, 2.0])) == [2]
    assert changepoints.candidates(np.log([1.0, 1.0, 2.0])) == []
    assert changepoints.find_changes([1.0, 1.0, 2.0]) == []


def test_the_noise_scale_is_the_noises_sigma_whatever_the_steps() -> None:
    """2000 points of N(0, 0.01) with a step of 10 sigma half way: the scale is sigma (from the consecutive
    differences, the step moving one of them), not the standard deviation the step inflates to 0.05."""
    x = np.random.default_rng(7).normal(0.0, 0.01, 2000)
    x[1000:] += 0.1
    assert changepoints.noise_scale(x) == pytest.approx(0.01, rel=0.05)


def test_a_series_gives_the_same_answer_every_time_and_the_seed_is_the_permutations(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A split of noise kept whatever its p-value (alpha 1), in three series: find_changes gives the same
    p-values call after call, those of seed 0 by default, and another seed draws other permutations."""
    monkeypatch.setattr(changepoints, "candidates", lambda x: [15])
    series = [noise(s, 30) for s in range(3)]

    def ps(seed: int | None = None) -> list[float]:
        kw = {} if seed is None else {"seed": seed}
        return [c.p_value for s in series for c in changepoints.find_changes(s, alpha=1.0, **kw)]

    first = ps()
    assert len(first) == 3 and ps() == first == ps(0)
    assert ps(1) != first


def test_a_series_is_refused_unless_positive_and_finite_and_its_groups_must_match() -> None:
    """A figure of 0, below 0 or not finite has no log: refused, saying so; and one commit per point."""
    for bad in ([1.0, 0.0, 2.0, 3.0], [1.0, -1.0, 2.0, 3.0], [1.0, float("nan"), 2.0, 3.0]):
        with (
            np.errstate(divide="ignore", invalid="ignore"),
            pytest.raises(ValueError, match="^a change-point series must be positive and finite$"),
        ):
            changepoints.find_changes(bad)
    with pytest.raises(ValueError, match="^3 groups for 4 points$"):
        changepoints.find_changes([1.0, 1.0, 2.0, 2.0], groups=["a", "a", "b"])


def test_a_series_of_any_real_numbers_is_read_as_floats() -> None:
    """Figures as Decimals (what a JSON reader with parse_float=Decimal gives) find the changes their floats
    do."""
    from decimal import Decimal

    x = np.round(np.repeat([1.0, 1.5], 20) * noise(0, 40), 4)
    floats = changepoints.find_changes(x)
    assert [c.index for c in floats] == [20]
    assert changepoints.find_changes([Decimal(str(v)) for v in x]) == floats
