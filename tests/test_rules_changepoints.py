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
