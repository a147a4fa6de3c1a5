"""The gate's statistics: an effect with its confidence interval, the effect it could have detected, and a
verdict that says UNDECIDED rather than PASS when the data cannot resolve the question asked.

Every figure is compared on the log scale, ln(head / base), so a metric and its reciprocal (step time and
throughput) reach the same verdict, and an effect is reported as the relative change exp(d) - 1.

* Paired (the A/B runner: A and B alternate on the same GPUs, so drift between pairs cancels): one value
  per run, the run's median over its windows (robust to the one window in three that stalls by 20-40%);
  d_i = ln(B_i / A_i) per pair. The interval is Student's t on the mean of d (scipy.stats.ttest_1samp).
  Its standard error is the spread of d itself, so it carries both sources of noise: run-to-run
  variation (a fresh build per run) and within-run variation (what is left in each run's median).
  A whole run that stalled inflates that spread and the verdict turns UNDECIDED, never a false alarm.
  The Wilcoxon signed-rank p-value (scipy.stats.wilcoxon) is reported beside it as a rank-based check.
* Interleaved (the A/B runner's windows mode: each pair's timed windows take turns): one value per round,
  the trimmed mean of ln(B_w / A_w) over its adjacent windows, then the same t interval over rounds, which
  thus carries the process-to-process bias and what is left of the window noise.
* Unpaired (`distbench compare` of two result directories): Welch's t on ln values
  (scipy.stats.ttest_ind), with the Mann-Whitney U p-value reported beside it.

The interval's level is set by the caller to control false alarms across a whole matrix: the A/B runner
divides its family-wise alpha over every configuration, metric and interim look (Bonferroni), so adding pairs
until a decision is reached does not inflate the false-alarm rate. The rate actually reached is measured
with A/A runs, not assumed.

Verdict for a metric where `worse` is +1 when larger is worse (times, memory) and -1 when smaller is
(throughput), with w = worse x effect:
    regression:  the whole interval of w lies above 0 and w >= min_effect (a real slowdown worth a red build)
    improvement: the whole interval of w lies below 0 and -w >= min_effect
    unchanged:   the interval's upper end of w is below `threshold` (a regression that large is ruled out)
    undecided:   anything else: the noise at this number of runs cannot rule out a regression of
                 `threshold`; more runs, or a quieter configuration, are needed.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

REGRESSION = "regression"
IMPROVEMENT = "improvement"
UNCHANGED = "unchanged"
UNDECIDED = "undecided"

#: Power at which the minimum detectable effect is reported.
POWER = 0.8
#: Fewest values on a side for a t interval that is not wildly wide (2 leaves 1 degree of freedom).
MIN_RUNS = 3


@dataclass(frozen=True)
class Effect:
    """A change of head against base, as relative changes (0.02 = head 2% larger)."""

    n: int  # pairs, or the smaller side's runs
    estimate: float
    low: float
    high: float
    level: float  # confidence level of [low, high]
    detectable: float  # smallest |change| this design would detect with POWER at the interval's alpha
    p_value: float  # rank test (Wilcoxon signed-rank, or Mann-Whitney U), reported beside the interval
    noise: float  # standard deviation of the log values per run (paired: of the log ratios)

    def worse(self, direction: int) -> tuple[float, float, float]:
        """(estimate, low, high) on the 'worse' axis: positive means worse for a metric of `direction`
        (+1 higher is better, -1 lower is better)."""
        return worse_axis(direction, self.estimate, self.low, self.high)


def worse_axis(direction: int, est: Any, lo: Any, hi: Any) -> tuple[Any, Any, Any]:
    """(estimate, low, high), scalars or arrays alike, turned so that positive means worse for a metric of
    `direction`: a metric where higher is better has its sign and its interval's ends swapped."""
    return (-est, -hi, -lo) if direction > 0 else (est, lo, hi)


def _rel(x: float) -> float:
    return math.expm1(x)


def _logs(xs: Sequence[float]) -> np.ndarray:
    arr = np.asarray(xs, dtype=float)
    if arr.size == 0 or not np.all(np.isfinite(arr)) or np.any(arr <= 0):
        raise ValueError("effects are computed on positive, finite values")
    return np.log(arr)


def _reach(se: float, df: int, alpha: float) -> float:
    """The smallest shift (on the scale of `se`) detected with POWER by a two-sided test at `alpha`."""
    from scipy.stats import t

    return float((t.ppf(1 - alpha / 2, df) + t.ppf(POWER, df)) * se)


def log_ratios(base: Sequence[float], head: Sequence[float]) -> np.ndarray:
    """ln(head[i] / base[i]) of pairs run side by side."""
    if len(base) != len(head):
        raise ValueError(f"paired effect needs as many base as head values, got {len(base)} and {len(head)}")
    return _logs(head) - _logs(base)


def paired_effect(base: Sequence[float], head: Sequence[float], alpha: float) -> Effect:
    """Effect of head over base from pairs run side by side (base[i] with head[i])."""
    return log_ratio_effect(log_ratios(base, head), alpha)


#: Share of a round's window log ratios trimmed from each end before averaging: a window in three stalled
#: by 20-40% on 2x H200, so a round's ratio must not follow one window.
WINDOW_TRIM = 0.2


def interleaved_effect(rounds: Sequence[Sequence[float]], alpha: float) -> Effect:
    """Effect of head over base from rounds of interleaved windows: rounds[r] holds ln(head / base) of each
    pair of adjacent windows of round r (fresh processes per round). Each round gives one value, the trimmed
    mean of its window ratios (scipy.stats.trim_mean), and the interval is Student's t over rounds: the
    rounds' spread holds both the process-to-process bias and what is left of the window noise, and the
    windows' interleaving cancels whatever drifts slower than a window (host speed, clocks)."""
    return log_ratio_effect(round_log_ratios(rounds), alpha)


def round_log_ratios(rounds: Sequence[Sequence[float]]) -> np.ndarray:
    """One log ratio per round of interleaved windows: the WINDOW_TRIM-trimmed mean of its windows' ratios."""
    from scipy.stats import trim_mean

    if any(len(r) == 0 for r in rounds):
        raise ValueError("every round needs at least one pair of windows")
    return np.array([float(trim_mean(r, WINDOW_TRIM)) for r in rounds])


def log_ratio_effect(d: np.ndarray, alpha: float) -> Effect:
    """Effect from paired log ratios d = ln(head / base): Student-t interval on their mean, Wilcoxon beside."""
    from scipy.stats import ttest_1samp

    if d.size < MIN_RUNS:
        raise ValueError(f"a paired effect needs at least {MIN_RUNS} pairs, got {d.size}")
    if not np.all(np.isfinite(d)):
        raise ValueError("log ratios must be finite")
    n, mean = d.size, float(d.mean())
    sd = float(d.std(ddof=1))
    if sd == 0.0:  # identical ratios: the interval collapses onto the estimate
        lo = hi = mean
    else:
        lo, hi = ttest_1samp(d, 0.0).confidence_interval(1 - alpha)
    return Effect(
        n,
        _rel(mean),
        _rel(lo),
        _rel(hi),
        1 - alpha,
        _rel(_reach(sd / math.sqrt(n), n - 1, alpha)),
        signed_rank_p(d),
        sd,
    )


def signed_rank_p(d: np.ndarray) -> float:
    """The Wilcoxon signed-rank p of paired log ratios, beside every interval as a cross-check that decides
    nothing; 1 where every ratio is exactly 1. Identical ratios get the test's own p too (with n pairs of one
    sign it cannot go below about 2^(1-n)), not 0: both intervals report the same p for the same pairs."""
    from scipy.stats import wilcoxon

    return float(wilcoxon(d).pvalue) if np.any(d != 0) else 1.0


#: Share of the pairs trimmed from each end for a memory metric's interval (at 6 pairs: one each side).
PAIR_TRIM = 0.2


def trimmed_log_ratio_effect(d: np.ndarray, alpha: float) -> Effect:
    """Effect from paired log ratios of values that repeat to the byte but for an occasional jump: their
    PAIR_TRIM-trimmed mean with the Tukey-McLaughlin interval (scipy.stats.mstats: winsorized spread, t with
    the kept count less one degrees of freedom). On one H200, DDP's peak allocated memory at GPT-2 124M was
    one fp32 copy of the parameters (+474 MiB) higher in one run of six on either side, in A/A runs too: a
    plain t interval then stayed undecided at every look, and no such configuration could pass."""
    from scipy.stats import mstats

    if d.size < MIN_RUNS:
        raise ValueError(f"a paired effect needs at least {MIN_RUNS} pairs, got {d.size}")
    limits = (PAIR_TRIM, PAIR_TRIM)
    mean = float(mstats.trimmed_mean(d, limits=limits))
    se = float(mstats.trimmed_stde(d, limits=limits))
    df = int(mstats.trimr(d, limits=limits).count()) - 1
    if se == 0.0:  # the kept ratios agree exactly: the interval collapses onto the estimate
        lo = hi = mean
    else:
        lo, hi = (float(x) for x in mstats.trimmed_mean_ci(d, limits=limits, alpha=alpha))
    noise = float(np.std(mstats.winsorize(d, limits=limits), ddof=1))
    return Effect(
        d.size,
        _rel(mean),
        _rel(lo),
        _rel(hi),
        1 - alpha,
        _rel(_reach(se, df, alpha)),
        signed_rank_p(d),
        noise,
    )


def intervals(d: np.ndarray, alpha: float, *, trimmed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(estimate, low, high) as relative changes for each row of log ratios `d` (rows x pairs) at once: the
    mean's Student-t interval (log_ratio_effect's), or the trimmed mean's Tukey-McLaughlin interval
    (trimmed_log_ratio_effect's). For replaying the gate's rule thousands of times (gate/calibrate.py);
    tests/test_calibrate.py holds both to the scalar functions."""
    from scipy.stats import t

    n = d.shape[1]
    g = int(PAIR_TRIM * n) if trimmed else 0
    s = np.sort(d, axis=1)
    kept = s[:, g : n - g]
    mean = kept.mean(axis=1)
    wins = np.concatenate([np.repeat(s[:, [g]], g, 1), kept, np.repeat(s[:, [n - g - 1]], g, 1)], axis=1)
    share = 2 * PAIR_TRIM if trimmed else 0.0  # the nominal share, as scipy.stats.mstats.trimmed_stde takes
    se = wins.std(axis=1, ddof=1) / ((1 - share) * math.sqrt(n))
    half = t.ppf(1 - alpha / 2, kept.shape[1] - 1) * se
    return np.expm1(mean), np.expm1(mean - half), np.expm1(mean + half)


def verdicts(
    est: np.ndarray, lo: np.ndarray, hi: np.ndarray, direction: int, *, threshold: float, min_effect: float
) -> np.ndarray:
    """The verdict of each (estimate, low, high), as an array of its strings: REGRESSION where the interval
    excludes no change on the worse side and the estimate is at least `min_effect`, IMPROVEMENT the same on
    the better side, UNCHANGED where a regression of `threshold` is ruled out, else UNDECIDED."""
    est, lo, hi = worse_axis(direction, est, lo, hi)
    return np.select(
        [(lo > 0) & (est >= min_effect), (hi < 0) & (-est >= min_effect), hi < threshold],
        [REGRESSION, IMPROVEMENT, UNCHANGED],
        UNDECIDED,
    )


def unpaired_effect(base: Sequence[float], head: Sequence[float], alpha: float) -> Effect:
    """Effect of head over base from independent runs: Welch's t on log values, or on values relative to the
    base mean where a value is zero (memory of a component that was offloaded)."""
    from scipy.stats import mannwhitneyu, ttest_ind

    n = min(len(base), len(head))
    if n < MIN_RUNS:
        raise ValueError(
            f"an unpaired effect needs at least {MIN_RUNS} runs a side, got {len(base)}/{len(head)}"
        )
    b, h = np.asarray(base, dtype=float), np.asarray(head, dtype=float)
    log = bool(np.all(b > 0) and np.all(h > 0))
    if log:
        b, h = np.log(b), np.log(h)
    else:  # relative to the base mean; an all-zero base has no relative change to speak of
        scale = abs(float(b.mean())) or 1.0
        b, h = b / scale, h / scale
    mean = float(h.mean() - b.mean())
    vb, vh = float(b.var(ddof=1)), float(h.var(ddof=1))
    se = math.sqrt(vb / b.size + vh / h.size)
    if se == 0.0:
        lo = hi = mean
        p = 1.0 if mean == 0.0 else 0.0
        df = b.size + h.size - 2
    else:
        res = ttest_ind(h, b, equal_var=False)
        lo, hi = res.confidence_interval(1 - alpha)
        df = max(1, int(res.df))
        p = float(mannwhitneyu(h, b, alternative="two-sided").pvalue)
    rel = _rel if log else float
    return Effect(
        n, rel(mean), rel(lo), rel(hi), 1 - alpha, rel(_reach(se, df, alpha)), p, math.sqrt((vb + vh) / 2)
    )


def verdict(effect: Effect, direction: int, *, threshold: float, min_effect: float) -> str:
    """regression / improvement / unchanged / undecided (see the module doc)."""
    est, lo, hi = (np.array([x]) for x in (effect.estimate, effect.low, effect.high))
    return str(verdicts(est, lo, hi, direction, threshold=threshold, min_effect=min_effect)[0])


def family_alpha(alpha: float, tests: int, looks: int = 1) -> float:
    """Per-test alpha that keeps the chance of any false alarm across `tests` x `looks` at most `alpha`."""
    if not 0 < alpha < 0.5:
        raise ValueError(f"alpha must be between 0 and 0.5, got {alpha}")
    return alpha / max(1, tests) / max(1, looks)
