"""How verdicts roll up, checked over generated outcomes (hypothesis): a metric's verdict from its interval
(gate/stats.py), a configuration's from its gated metrics and a run's from its configurations (gate/ab.py),
a comparison's from its rows (compare.py). Each test states its properties in its docstring; none of them
restates the code's own loop, so a reordering or a dropped case in the code fails them."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from distbench.compare import INSUFFICIENT, CompareReport
from distbench.compare import Row as CompareRow
from distbench.config import RunConfig
from distbench.gate import stats
from distbench.gate.ab import ABReport, ConfigOutcome, Row
from properties import cases, narrowed, ordered

PROPERTIES = cases(50)
GATE_VERDICTS = (stats.REGRESSION, stats.IMPROVEMENT, stats.UNCHANGED, stats.UNDECIDED)
#: How bad a verdict is for the question the gate asks ("did it get slower?"), worst last.
SEVERITY = {stats.IMPROVEMENT: 0, stats.UNCHANGED: 0, stats.UNDECIDED: 1, stats.REGRESSION: 2}
CFG = RunConfig(strategy="ddp", world_size=2, model="gpt2-tiny", global_batch=4, micro_batch=2)

RELATIVE = st.floats(-0.2, 0.2, allow_nan=False)


@st.composite
def effects(draw: st.DrawFn) -> tuple[float, float, float]:
    """(estimate, low, high) with low <= estimate <= high, as relative changes."""
    low, high = ordered(draw(RELATIVE), draw(RELATIVE))
    return draw(st.floats(low, high)), low, high


@pytest.mark.parametrize("ends", [(0.0, -0.0), (-0.0, 0.0), (-0.0, -0.0), (0.1, -0.1)])
def test_the_effects_strategy_draws_from_any_two_ends(ends):
    """The counterexample a random draw once found (ends 0.0 and -0.0: `There are no 64-bit floating-point
    values between min_value=0.0 and max_value=-0.0`), kept: the estimate's range is never empty."""
    low, high = ordered(*ends)
    st.floats(low, high).validate()  # raises InvalidArgument on an empty range


@st.composite
def criteria(draw: st.DrawFn) -> dict[str, float]:
    """The gate's settings as `distbench ab` and `compare` accept them: 0 < min_effect <= threshold."""
    min_effect = draw(st.floats(0.001, 0.05))
    return {"min_effect": min_effect, "threshold": draw(st.floats(min_effect, 0.1))}


def _verdict(e: tuple[float, float, float], direction: int, c: dict[str, float]) -> str:
    est, lo, hi = (np.array([x]) for x in e)
    return str(stats.verdicts(est, lo, hi, direction, **c)[0])


#: The rule's edges, which generated floats seldom hit: an interval ending exactly at no change, or at threshold;
#: and what the nightly profile found: a low end so close to 0 that est - (est - low) rounds to 0.
EDGES = [
    (0.01, 0.0, 0.02),
    (-0.01, -0.02, 0.0),
    (0.0, -0.01, 0.02),
    (0.0, 0.0, 0.0),
    (0.125, 6.2e-161, 0.125),
]


@PROPERTIES
@given(effects(), criteria(), st.floats(0.0, 0.1), st.floats(0.0, 1.0))
@example(EDGES[0], {"min_effect": 0.01, "threshold": 0.02}, 0.0, 0.5)
@example(EDGES[1], {"min_effect": 0.01, "threshold": 0.02}, 0.0, 0.5)
@example(EDGES[2], {"min_effect": 0.01, "threshold": 0.02}, 0.0, 0.5)
@example(EDGES[3], {"min_effect": 0.01, "threshold": 0.02}, 0.0, 0.5)  # effects() of ends 0.0 and -0.0
@example(EDGES[4], {"min_effect": 0.03125, "threshold": 0.0625}, 0.0, 1.0)
def test_a_metrics_verdict_follows_its_interval(e, c, shift, shrink):
    """Properties of one metric's verdict (stats.verdicts), on the axis where positive is worse:
    - a metric where higher is better gets the verdict of its mirror image where lower is better;
    - REGRESSION only where the whole interval is worse and the estimate at least min_effect; IMPROVEMENT
      the same on the better side; UNCHANGED only where a regression of `threshold` is ruled out;
    - UNDECIDED exactly where none of these is shown;
    - the same interval moved towards worse never gets a better verdict;
    - a narrower interval around the same estimate (more pairs) stays decided once decided."""
    est, lo, hi = e
    v = _verdict(e, -1, c)
    assert _verdict((-est, -hi, -lo), +1, c) == v
    regression = lo > 0 and est >= c["min_effect"]
    improvement = hi < 0 and -est >= c["min_effect"]
    assert (v == stats.REGRESSION) == regression
    assert (v == stats.IMPROVEMENT) == (improvement and not regression)
    assert (v == stats.UNCHANGED) == (hi < c["threshold"] and not regression and not improvement)
    worse = _verdict((est + shift, lo + shift, hi + shift), -1, c)
    assert SEVERITY[worse] >= SEVERITY[v] and not (v != stats.IMPROVEMENT and worse == stats.IMPROVEMENT)
    if v != stats.UNDECIDED:
        assert _verdict((est, *narrowed(est, lo, hi, shrink)), -1, c) != stats.UNDECIDED


ROWS = st.lists(st.tuples(st.booleans(), st.sampled_from(GATE_VERDICTS)), max_size=8)


def _outcome(rows: list[tuple[bool, str]], error: str | None = None) -> ConfigOutcome:
    o = ConfigOutcome(CFG, "ddp", error=error)
    o.rows = [Row("ddp", f"m{i}", gated, [], [], v) for i, (gated, v) in enumerate(rows)]
    return o


@PROPERTIES
@given(ROWS, st.randoms(use_true_random=False))
def test_a_configurations_verdict_is_its_worst_gated_metrics(rows, rng):
    """Properties of a configuration's verdict (ConfigOutcome.verdict) from its rows:
    - a regression in any gated metric is the configuration's regression;
    - otherwise an undecided gated metric leaves it undecided: an improvement elsewhere never hides it;
    - IMPROVEMENT only where every gated metric is decided and one improved; UNCHANGED where all are unchanged;
    - no gated metric at all is UNDECIDED: nothing was shown;
    - metrics reported beside the gated ones (not gated) never change it, nor does the rows' order."""
    gated = [v for g, v in rows if g]
    verdict = _outcome(rows).verdict
    if stats.REGRESSION in gated:
        assert verdict == stats.REGRESSION
    elif stats.UNDECIDED in gated or not gated:
        assert verdict == stats.UNDECIDED
    elif stats.IMPROVEMENT in gated:
        assert verdict == stats.IMPROVEMENT
    else:
        assert verdict == stats.UNCHANGED
    shuffled = list(rows)
    rng.shuffle(shuffled)
    assert _outcome(shuffled).verdict == verdict
    assert _outcome([(True, v) for v in gated]).verdict == verdict


@PROPERTIES
@given(ROWS)
def test_a_configuration_whose_run_failed_is_undecided(rows):
    """A configuration whose comparison ended on a failed run shows nothing, whatever its rows say."""
    assert _outcome(rows, error="head run failed (oom)").verdict == stats.UNDECIDED


@PROPERTIES
@given(st.lists(ROWS, max_size=5))
def test_a_runs_status_is_its_worst_configurations(configs):
    """Properties of the A/B run's status and exit code (ABReport) from its configurations:
    - any configuration's regression fails the run (exit 1);
    - otherwise any undecided configuration, or none at all, leaves it undecided (exit 3);
    - it passes (exit 0) only where every configuration improved or is unchanged."""
    outcomes = [_outcome(rows) for rows in configs]
    report = ABReport(outcomes, 0.05, 0.01, 0.02, 0.01, 1.0, False, "base", "head")
    verdicts = [o.verdict for o in outcomes]
    if stats.REGRESSION in verdicts:
        assert (report.status, report.exit_code) == (stats.REGRESSION, 1)
    elif stats.UNDECIDED in verdicts or not verdicts:
        assert (report.status, report.exit_code) == (stats.UNDECIDED, 3)
    else:
        assert (report.status, report.exit_code) == ("pass", 0)


@PROPERTIES
@given(st.lists(st.sampled_from((*GATE_VERDICTS, INSUFFICIENT)), max_size=8), st.booleans())
def test_a_comparisons_status_hides_no_undecided_row(verdicts, allow_insufficient):
    """Properties of `distbench compare`'s status and exit code (CompareReport) from its rows:
    - any regression fails it (exit 1);
    - otherwise any undecided row, or no decided row at all, leaves it undecided (exit 3): improvements
      elsewhere hide neither;
    - rows that lack runs leave it undecided unless allow_insufficient, which lets them pass beside decided rows;
    - it passes (exit 0) only where every decided row improved or is unchanged."""
    rows = [CompareRow(("k",), "cfg", f"m{i}", [], [], v) for i, v in enumerate(verdicts)]
    report = CompareReport(rows, [], 0.05, 0.01, 6, 0.01, 0.02, allow_insufficient)
    decided = [v for v in verdicts if v not in (stats.UNDECIDED, INSUFFICIENT)]
    if stats.REGRESSION in verdicts:
        expected = (stats.REGRESSION, 1)
    elif stats.UNDECIDED in verdicts or not decided:
        expected = (stats.UNDECIDED, 3)
    elif INSUFFICIENT in verdicts and not allow_insufficient:
        expected = (stats.UNDECIDED, 3)
    else:
        expected = ("pass", 0)
    assert (report.status, report.exit_code) == expected
