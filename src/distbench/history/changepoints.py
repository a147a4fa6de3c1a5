"""Change points of a noisy performance series: where its level moved, and by how much.

A nightly figure moves by a percent or two when something changed and by as much again from night to night
when nothing did, so a fixed threshold on the night-to-night change either misses the first or cries at the
second. This module asks instead whether the series is better described by segments of different levels, in
three steps:

1. Candidates: ruptures' PELT search with the least-squares (l2) cost on the series' log (changes are
   relative), scaled by its noise (a robust estimate from consecutive differences, so the steps themselves do
   not inflate it), with the BIC penalty 2 log n per change: a segment boundary is proposed where the split
   explains more than a change point costs.
2. Significance, as E-divisive means does it (Matteson and James; the method of MongoDB's and Apache Otava's
   change-point detection): each candidate is tested within the segment between its neighbours by a
   permutation test of the largest split gain anywhere in that segment, on the points' ranks (one run far
   off must not outweigh the rest), so the search's own choice of the best split is in the null
   distribution (testing the chosen split alone would find changes in pure noise).
   The least significant candidate above `alpha` is dropped and its neighbours retested, until every one
   left is significant.
3. Place: each change left moves to the best least-squares split of the segment between its neighbours, on
   the points' values in noise sigmas (clipped far out), not their ranks: a nightly finds a regression with
   many nights before it and few after, and there ranks put the change a night early.

Each change is reported with the medians either side and the relative change of the segments' means, with
Welch's t confidence interval on the log scale (scipy.stats.ttest_ind), exp()-ed back to a ratio.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

#: the fewest points a segment may have: one point alone is an outlier, not a level
MIN_SIZE = 2
#: the search's penalty per change, in units of log n on the noise-scaled series: BIC's 2 log n (a change
#: costs its level and its place)
PENALTY_PER_LOG_N = 2.0
#: how far from its segment's median a point weighs in placing a split, in noise sigmas: one run far off (a
#: quiet moment on a shared machine) weighs no more than a large step, and a step of up to this size keeps
#: its whole size (clipped at 4, a 16-sigma step behind 30 points went a point early when the last of them
#: lay 2.5 sigmas high)
CLIP_SIGMAS = 8.0
#: permutations per significance test; the smallest p-value it can give is 1 / (PERMUTATIONS + 1)
PERMUTATIONS = 999
#: a commit boundary takes a change from a split through one commit's runs when its gain is at least this share
#: of that split's: runs of one commit differ only by noise, so a split between them is where noise put it
#: (8 runs of one commit, 6 of a planted +5% on an H200: the ranks split one run late, the new level's first
#: run being faster than the old level's one slow run)
BOUNDARY_GAIN_SHARE = 0.95


@dataclass(frozen=True)
class Change:
    """A change of level before point `index` (the first point of the new level)."""

    index: int
    before: float  # median of the segment before
    after: float  # median of the segment after
    ratio: float  # exp(mean log after - mean log before): 1.02 is 2% higher
    low: float  # the ratio's confidence interval
    high: float
    p_value: float  # the permutation test's, within the segment between the neighbouring changes

    @property
    def percent(self) -> float:
        return (self.ratio - 1) * 100


def noise_scale(x: np.ndarray) -> float:
    """The series' noise as a standard deviation, from the median absolute consecutive difference (a step
    moves one difference; noise moves them all), 1.4826 / sqrt(2) scaling that to a normal's sigma."""
    d = np.abs(np.diff(x))
    s = float(np.median(d)) * 1.4826 / math.sqrt(2) if len(d) else 0.0
    return s if s > 0 else float(np.std(x)) or 1.0


def _gains(y: np.ndarray) -> np.ndarray:
    """The least-squares gain of splitting each row of `y` in two at every split that leaves MIN_SIZE points
    a side (column j: the split before point MIN_SIZE + j): k (m - k) / m (mean_left - mean_right)^2."""
    m = y.shape[-1]
    k = np.arange(MIN_SIZE, m - MIN_SIZE + 1)
    c = np.cumsum(y, axis=-1)
    left = c[..., k - 1] / k
    right = (c[..., -1:] - c[..., k - 1]) / (m - k)
    return k * (m - k) / m * (left - right) ** 2


def _ranks(y: np.ndarray) -> np.ndarray:
    """The segment's ranks: a split is judged by which points lie above which, so that one run far off (a
    quiet moment on a shared machine ran 28 ms among runs of 0.6-2 s) does not outweigh the rest."""
    from scipy.stats import rankdata

    return np.asarray(rankdata(y), dtype=float)


def _clipped(y: np.ndarray) -> np.ndarray:
    """The segment in noise sigmas about its median, each point within CLIP_SIGMAS of it: what places a split.
    Not ranks: they keep no size, so a level's highest point weighs like the next level's lowest, and the gain's
    weight, largest mid-segment, pulls a change a point early when it has many points before it and few after
    (10 before and 4 after a step of 16 sigmas: a third of the time)."""
    return np.clip((y - np.median(y)) / noise_scale(y), -CLIP_SIGMAS, CLIP_SIGMAS)


def best_split(y: np.ndarray, groups: Sequence[object] | None = None) -> int:
    """Where a segment splits best: the first point of its second part. With `groups` (each point's commit),
    the best split between two groups instead, when it gains nearly as much (BOUNDARY_GAIN_SHARE)."""
    gains = _gains(_clipped(y))
    best = int(np.argmax(gains))
    if groups is not None:
        at_boundary = [j for j in range(len(gains)) if groups[MIN_SIZE + j - 1] != groups[MIN_SIZE + j]]
        if at_boundary:
            j = max(at_boundary, key=lambda j: gains[j])
            if gains[j] >= BOUNDARY_GAIN_SHARE * gains[best]:
                best = j
    return MIN_SIZE + best


def split_p_value(y: np.ndarray, rng: np.random.Generator) -> float:
    """Permutation p-value of the segment's best split, on its ranks: how often a shuffled segment splits at
    least as well anywhere."""
    if len(y) < 2 * MIN_SIZE:
        return 1.0
    r = _ranks(y)
    observed = np.max(_gains(r))
    shuffled = rng.permuted(np.broadcast_to(r, (PERMUTATIONS, len(r))), axis=1)
    best = np.max(_gains(shuffled), axis=-1)
    return float((1 + np.sum(best >= observed * (1 - 1e-12))) / (PERMUTATIONS + 1))


def candidates(x: np.ndarray) -> list[int]:
    """ruptures' PELT (l2 cost) on the noise-scaled series with the BIC penalty: the proposed boundaries."""
    import ruptures as rpt

    n = len(x)
    if n < 2 * MIN_SIZE:
        return []
    z = (x - np.median(x)) / noise_scale(x)
    ends = (
        rpt.KernelCPD(kernel="linear", min_size=MIN_SIZE, jump=1)
        .fit(z)
        .predict(pen=PENALTY_PER_LOG_N * math.log(n))
    )
    return [int(e) for e in ends[:-1]]  # the last "end" is n


def _change(x: np.ndarray, lo: int, k: int, hi: int, p: float, alpha: float) -> Change:
    from scipy import stats

    a, b = x[lo:k], x[k:hi]
    with warnings.catch_warnings():  # scipy's "precision loss" on a noise-free figure (a memory peak)
        warnings.simplefilter("ignore", RuntimeWarning)
        ci = stats.ttest_ind(b, a, equal_var=False).confidence_interval(1 - alpha)
    d = float(np.mean(b) - np.mean(a))
    if not math.isfinite(ci.low):  # two equal constant segments: no spread to speak of
        ci = type(ci)(d, d)
    return Change(
        index=k,
        before=float(np.exp(np.median(a))),
        after=float(np.exp(np.median(b))),
        ratio=math.exp(d),
        low=math.exp(float(ci.low)),
        high=math.exp(float(ci.high)),
        p_value=p,
    )


def _relocate(x: np.ndarray, kept: list[int], groups: Sequence[object] | None) -> list[int]:
    """Each change moved to the best split of the segment between its neighbours, until none moves: the
    search proposes boundaries for the penalised whole, and a dropped neighbour leaves a kept one where it
    suited the pair."""
    for _ in range(len(x) if kept else 0):
        moved = [
            lo + best_split(x[lo:hi], None if groups is None else groups[lo:hi])
            for lo, hi in zip([0, *kept[:-1]], [*kept[1:], len(x)], strict=True)
        ]
        if moved == kept:
            break
        kept = moved
    return kept


def find_changes(
    values: Sequence[float], alpha: float = 0.01, seed: int = 0, groups: Sequence[object] | None = None
) -> list[Change]:
    """The significant changes of level of a series of positive figures, in order. `alpha` is the
    false-alarm rate of a series' tests together (Bonferroni over the candidates tested at once), `seed` the
    permutations' (the same series gives the same answer), `groups` each point's commit, when several points
    share one (a change is then placed between commits unless a split through one is clearly better)."""
    x = np.log(np.asarray(values, dtype=float))
    if not np.all(np.isfinite(x)):
        raise ValueError("a change-point series must be positive and finite")
    if groups is not None and len(groups) != len(x):
        raise ValueError(f"{len(groups)} groups for {len(x)} points")
    rng = np.random.default_rng(seed)
    kept = candidates(x)
    while kept:
        bounds = [0, *kept, len(x)]
        ps = [split_p_value(x[bounds[i - 1] : bounds[i + 1]], rng) for i in range(1, len(bounds) - 1)]
        worst = int(np.argmax(ps))
        if ps[worst] <= alpha / len(kept):
            break
        del kept[worst]
    kept = _relocate(x, kept, groups)
    bounds = [0, *kept, len(x)]
    return [
        _change(
            x,
            bounds[i],
            bounds[i + 1],
            bounds[i + 2],
            split_p_value(x[bounds[i] : bounds[i + 2]], rng),
            alpha,
        )
        for i in range(len(kept))
    ]
