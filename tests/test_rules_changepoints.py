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
