"""bisect's verdict rules, one test each, on probe records written by hand (no processes, no comparisons run):
which verdict a bisect whose ends do not hold ends with, which revision its words name, and the range it
reports. Each was shown failing on the one-line bug it names."""

from __future__ import annotations

from distbench.gate import stats
from distbench.gate.bisect import Bisection, MetricRow, ProbeRecord, Verdict, step_time_reason
from test_bisect import setup_of

N = 4
NODE = "tests/test_x.py::test_y"


def perf(confirm: ProbeRecord | None) -> Verdict:
    return Bisection(setup_of(N), [confirm] if confirm else []).verdict()


def confirm(outcome: str, error: str | None = None, failed: str | None = None) -> ProbeRecord:
    return ProbeRecord(kind="confirm", base=0, head=N, outcome=outcome, error=error, failed=failed)


def test_a_confirm_not_run_yet_is_undecided_over_the_whole_range_without_a_reason():
    """No confirm yet: undecided over 0..n, and no "(None)" where there is no error to give."""
    assert perf(None) == Verdict("undecided", "could not tell whether bad is slower than good", 0, N)


def test_an_undecided_confirm_gives_its_error_in_brackets_and_only_where_it_has_one():
    assert perf(confirm("undecided", error="the gate ran out of pairs")) == Verdict(
        "undecided", "could not tell whether bad is slower than good (the gate ran out of pairs)", 0, N
    )
    assert perf(confirm("undecided")) == Verdict(
        "undecided", "could not tell whether bad is slower than good", 0, N
    )


def test_a_good_confirm_is_same_and_names_the_threshold_ruled_out():
    """bad not slower than good: "same" (exit 0) over 0..n, with the 2% slowdown the gate ruled out."""
    v = perf(confirm("good"))
    assert v == Verdict(
        "same",
        "bad is not slower than good (a slowdown of 2.0% ruled out on every gated metric): nothing to find",
        0,
        N,
    )
    assert v.exit_code == 0


def test_a_confirm_that_could_not_run_an_end_names_that_end_by_its_revision():
    """The side that failed is named as the good end (candidate 0) or the bad end (candidate n), else "an end"."""
    assert perf(confirm("skip", error="boom", failed="base")) == Verdict(
        "ends", "the good end 0/4 rev0 could not be run: boom", 0, N
    )
    assert perf(confirm("skip", error="boom", failed="head")) == Verdict(
        "ends", "the bad end 4/4 rev4 could not be run: boom", 0, N
    )
    assert perf(confirm("skip", error="boom")) == Verdict("ends", "an end could not be run: boom", 0, N)


def node_bisect(*ends: tuple[int, str, str | None]) -> Verdict:
    probes = [ProbeRecord(kind="end", base=None, head=i, outcome=o, error=e) for i, o, e in ends]
    return Bisection(setup_of(N, "test"), probes).verdict()


def test_a_test_that_passes_at_the_bad_end_is_same_over_the_whole_range():
    assert node_bisect((N, "good", None)) == Verdict(
        "same", f"{NODE} passes at the bad end: nothing to find", 0, N
    )


def test_a_test_that_cannot_run_at_the_bad_end_says_so_and_that_it_must_fail_there():
    assert node_bisect((N, "skip", "no GPU")) == Verdict(
        "ends", f"{NODE} cannot run (no GPU) at the bad end; it must fail at it", 0, N
    )


def test_a_test_that_fails_at_the_good_end_says_it_must_pass_there():
    assert node_bisect((N, "bad", None), (0, "bad", None)) == Verdict(
        "ends", f"{NODE} fails at the good end; it must pass at it", 0, N
    )


def test_a_value_in_a_state_file_error_is_shown_whole_up_to_60_characters_else_cut_to_60_with_an_ellipsis():
    from distbench.gate.bisect import _short

    assert _short("a" * 58) == repr("a" * 58)  # 60 characters with its quotes: whole
    assert _short("a" * 59) == "'" + "a" * 56 + "..."  # 61: its first 57, then "..."
    assert len(_short("a" * 59)) == 60


NOT_SAMPLED = (
    "the step time moved and the device's kernel time was not sampled: followed on step time (a host-side change, "
    "or a device-side one the run could not show)"
)


def device(verdict: str, gated: bool = False, high: float | None = 0.01) -> MetricRow:
    return MetricRow(
        metric="device_compute_s", gated=gated, verdict=verdict, estimate=0.0, low=-0.01, high=high
    )


def test_step_time_reason_says_the_device_time_was_not_sampled_where_no_row_has_an_interval():
    """No device row, or one without both ends of its interval: "not sampled", never a figure half made up."""
    assert step_time_reason([]) == NOT_SAMPLED
    assert step_time_reason([device(stats.UNCHANGED, high=None)]) == NOT_SAMPLED


def test_step_time_reason_takes_an_ungated_device_row_where_no_device_row_is_gated():
    """The device row that was sampled but not gated still says what the device time did."""
    assert step_time_reason([device(stats.UNCHANGED)]) == (
        "the step time moved and the device's kernel time did not (device_compute_s +0.00% [-1.00%, +1.00%], a "
        "slowdown ruled out): a host-side change, followed on step time"
    )


def test_step_time_reason_says_the_device_time_moved_with_the_step_time_where_it_regressed():
    assert step_time_reason([device(stats.REGRESSION, gated=True)]) == (
        "the step time moved and the device's kernel time with it (device_compute_s +0.00% [-1.00%, +1.00%]): "
        "followed on step time"
    )


def test_step_time_reason_says_the_device_time_got_faster_where_it_improved():
    assert step_time_reason([device(stats.IMPROVEMENT, gated=True)]) == (
        "the step time moved and the device's kernel time got faster (device_compute_s +0.00% [-1.00%, +1.00%]): "
        "a host-side change, followed on step time"
    )


def step_row(estimate: float | None, low: float, high: float, metric: str = "step_time_s") -> MetricRow:
    return MetricRow(
        metric=metric, gated=True, verdict=stats.REGRESSION, estimate=estimate, low=low, high=high
    )


def found(rest: str | None, ends: MetricRow, mid: list[MetricRow]) -> str:
    """The verdict's words over 3 candidates: the confirm found bad slower by `ends`, the search's one probe
    found candidate 1 bad (its rows `mid`), and the remainder (1 against 2) answered `rest`."""
    probes = [
        ProbeRecord(kind="confirm", base=0, head=2, outcome="bad", metric="step_time_s", rows=[ends]),
        ProbeRecord(kind="search", base=0, head=1, outcome="bad", metric=mid[0].metric, rows=mid),
    ]
    if rest:
        probes.append(ProbeRecord(kind="remainder", base=1, head=2, outcome=rest))
    v = Bisection(setup_of(2), probes).verdict()
    assert (v.status, v.first_bad) == ("culprit", (1,))
    return v.message


MORE = (
    "the first bad one is 1/2 rev1; more than one change may lie in the history: bad is +10.0% against good on "
    "step_time_s, past 1/2 rev1's +2.0% [+1.0%, +3.0%], so a further change may lie after it"
)


def test_an_undecided_remainder_with_the_ends_slowdown_past_the_culprits_interval_says_more_may_lie_after_it():
    assert found("undecided", step_row(0.10, 0.08, 0.12), [step_row(0.02, 0.01, 0.03)]) == MORE


def test_a_good_remainder_rules_out_a_further_change_whatever_the_ends_slowdown():
    assert (
        found("good", step_row(0.10, 0.08, 0.12), [step_row(0.02, 0.01, 0.03)])
        == "the first bad one is 1/2 rev1"
    )


def test_the_culprits_interval_is_read_on_the_confirms_metric_not_on_the_one_its_probe_followed():
    mid = [step_row(0.09, 0.0, 0.12, "device_compute_s"), step_row(0.02, 0.01, 0.03)]
    assert found("undecided", step_row(0.10, 0.08, 0.12), mid) == MORE


def test_no_further_words_where_the_ends_slowdown_has_no_estimate_or_lies_within_the_culprits_interval():
    bare = "the first bad one is 1/2 rev1"
    assert found("undecided", step_row(None, 0.08, 0.12), [step_row(0.02, 0.01, 0.03)]) == bare
    assert found("undecided", step_row(0.10, 0.08, 0.12), [step_row(0.02, 0.01, 0.10)]) == bare
