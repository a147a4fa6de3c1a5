"""How often the A/B gate raises a false alarm at the noise a machine really has, from its A/A comparisons.

`distbench ab` splits its family-wise alpha over configurations, gated metrics and looks, and its intervals
assume Student's t; real pairs have stalls, heavy tails and process bias. An A/A comparison (base and head
the same variant) measures that noise with nothing changed. For each configuration and gated metric,
calibrate() centres the pairs' log ratios on zero (nothing changed, by construction: a bias the A/A shows is
its verdict's business, counted beside) and replays the gate's own rule on resamples of them (a smoothed
bootstrap: drawn with replacement, plus Gaussian noise of Silverman's bandwidth): the looks, the per-test alpha, the threshold and the minimum effect of the A/A's ab.json. The
share of replays that end in REGRESSION is that rule's false-alarm rate at that noise. The A/A verdicts
themselves are counted too, with a Clopper-Pearson interval (scipy.stats.binomtest).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..metrics import METRICS
from . import stats
from .ab import WINDOWED, trimmed

#: Replays per configuration and metric (the simulated rate's standard error is under 1.2% at 2000).
RESAMPLES = 2000


@dataclass(frozen=True)
class Calibration:
    """One configuration and gated metric of an A/A comparison: its verdict, its noise, and the share of
    replays of the gate's rule at that noise that raised a false alarm."""

    label: str
    metric: str
    pairs: int
    verdict: str  # what the A/A itself concluded
    noise: float  # standard deviation of the pairs' log ratios
    false_alarm: float  # share of replays that ended in REGRESSION
    nominal: float  # the per-test alpha the rule spent on this metric, over all its looks


def pair_log_ratios(config: dict[str, Any], row: dict[str, Any]) -> np.ndarray:
    """The log ratios the gate judged for one metric of one configuration of an ab.json: the rounds' trimmed
    means of their window ratios for the windowed step time, else ln(head / base) of each pair of runs."""
    windows = config.get("window_log_ratios") or []
    if row["metric"] == WINDOWED and windows and all(windows):
        return stats.round_log_ratios(windows)
    return stats.log_ratios(row["base"], row["head"])


def replay(
    d: np.ndarray,
    metric: str,
    *,
    looks: list[int],
    per_test_alpha: float,
    threshold: float,
    min_effect: float,
    resamples: int,
    rng: np.random.Generator,
) -> float:
    """Share of `resamples` replays of the gate's rule on draws (with replacement) from the centred `d` that
    ended in REGRESSION: at each look the effect of the pairs so far, stopping at the first decision."""
    centred = d - d.mean()
    # a smoothed bootstrap (Silverman's bandwidth): drawn from a handful of pairs with replacement alone,
    # replays repeat one value often enough to fake a tight interval, and "alarm" for no reason
    bandwidth = 1.06 * float(centred.std(ddof=1)) * len(d) ** -0.2
    draws = rng.choice(centred, size=(resamples, looks[-1]), replace=True)
    draws += rng.normal(0.0, bandwidth, size=draws.shape)
    open_ = np.ones(resamples, dtype=bool)
    alarms = 0
    for n in looks:
        est, lo, hi = stats.intervals(draws[:, :n], per_test_alpha, trimmed=trimmed(metric))
        with np.errstate(invalid="ignore"):  # rows of identical draws: a zero-width interval
            v = stats.verdicts(
                est, lo, hi, METRICS[metric].direction, threshold=threshold, min_effect=min_effect
            )
        decided = open_ & (v != stats.UNDECIDED)
        alarms += int(np.sum(decided & (v == stats.REGRESSION)))
        open_ &= ~decided
    return alarms / resamples


def calibrate(
    report: dict[str, Any], *, resamples: int = RESAMPLES, seed: int = 0, default_looks: list[int]
) -> list[Calibration]:
    """Every gated metric of every configuration of one A/A ab.json, replayed (see the module doc).
    `default_looks` stands in for an ab.json written before the looks were recorded."""
    if report.get("base") != report.get("head"):
        raise ValueError(
            f"not an A/A comparison: base {report.get('base')!r}, head {report.get('head')!r}; "
            "calibrate reads comparisons of a variant against itself (distbench ab with no --head)"
        )
    looks = list(report.get("looks") or default_looks)
    rng = np.random.default_rng(seed)
    out = []
    for config in report["configs"]:
        for row in config["rows"]:
            if not row["gated"] or len(row["base"]) < stats.MIN_RUNS:
                continue
            d = pair_log_ratios(config, row)
            rate = replay(
                d,
                row["metric"],
                looks=looks,
                per_test_alpha=report["per_test_alpha"],
                threshold=report["threshold"],
                min_effect=report["min_effect"],
                resamples=resamples,
                rng=rng,
            )
            out.append(
                Calibration(
                    config["label"],
                    row["metric"],
                    len(d),
                    row["verdict"],
                    float(d.std(ddof=1)),
                    rate,
                    report["per_test_alpha"] * len(looks),
                )
            )
    return out


def observed(calibrations: list[Calibration]) -> tuple[int, int, tuple[float, float]]:
    """(false alarms, verdicts, 95% Clopper-Pearson interval of the rate) over the A/A verdicts themselves."""
    from scipy.stats import binomtest

    n = len(calibrations)
    k = sum(c.verdict == stats.REGRESSION for c in calibrations)
    if n == 0:
        return 0, 0, (0.0, 1.0)
    ci = binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    return k, n, (float(ci.low), float(ci.high))


def family_rate(calibrations: list[Calibration]) -> float:
    """The replayed chance that one comparison raises any false alarm over all its configurations and gated
    metrics (taken as independent: step time and device time move together, so this is an upper bound),
    to set beside the family-wise alpha the gate promises."""
    return 1 - float(np.prod([1 - c.false_alarm for c in calibrations]))
