"""bisect's verdict rules, one test each, on probe records written by hand (no processes, no comparisons run):
which verdict a bisect whose ends do not hold ends with, which revision its words name, and the range it
reports. Each was shown failing on the one-line bug it names."""

from __future__ import annotations

import json

import pytest

from distbench.gate import bisect, stats
from distbench.gate.ab import ABReport, ConfigOutcome, Pair, Row
from distbench.gate.bisect import (
    STATE_FILE,
    STATE_SCHEMA,
    Bisection,
    MetricRow,
    ProbeRecord,
    StateFileError,
    Step,
    Verdict,
    compare_probe,
    load_state,
    resume,
    save_state,
    step_time_reason,
)
from distbench.gate.variants import VariantStartError
from test_bisect import CFG, setup_of

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


def test_on_a_metric_where_higher_is_better_the_ends_drop_is_read_as_a_slowdown_past_the_culprits():
    """Throughput followed (higher is better): bad's -10% tokens/s against good is a +10% slowdown, past the
    culprit's +2% [+1%, +3%], so the words say a further change may lie after it, signs turned as the gate's."""
    ends = MetricRow(
        metric="tokens_per_s", gated=True, verdict=stats.REGRESSION, estimate=-0.10, low=-0.12, high=-0.08
    )
    mid = MetricRow(
        metric="tokens_per_s", gated=True, verdict=stats.REGRESSION, estimate=-0.02, low=-0.03, high=-0.01
    )
    probes = [
        ProbeRecord(kind="confirm", base=0, head=2, outcome="bad", metric="tokens_per_s", rows=[ends]),
        ProbeRecord(kind="search", base=0, head=1, outcome="bad", metric="tokens_per_s", rows=[mid]),
        ProbeRecord(kind="remainder", base=1, head=2, outcome="undecided"),
    ]
    assert Bisection(setup_of(2), probes).verdict().message == (
        "the first bad one is 1/2 rev1; more than one change may lie in the history: bad is +10.0% against good "
        "on tokens_per_s, past 1/2 rev1's +2.0% [+1.0%, +3.0%], so a further change may lie after it"
    )


def test_a_culprit_whose_probe_kept_no_row_of_the_confirms_metric_gets_a_verdict_without_further_words():
    """Nothing to set beside the ends' slowdown (a state file whose probe holds only another metric's row):
    the culprit is still named, with no claim about a further change, rather than no verdict at all."""
    device_only = [step_row(0.02, 0.01, 0.03, "device_compute_s")]
    assert found("undecided", step_row(0.10, 0.08, 0.12), device_only) == "the first bad one is 1/2 rev1"


def search(head: int, outcome: str) -> ProbeRecord:
    return ProbeRecord(kind="search", base=0, head=head, outcome=outcome, metric="step_time_s")


BAD_CONFIRM = ProbeRecord(kind="confirm", base=0, head=N, outcome="bad", metric="step_time_s")


def test_an_undecided_probe_counts_the_candidates_left_between_the_range_ends():
    """Good at 2, undecided at 3, the bad end at 4: 2 candidates (3 and 4) may hold the first change."""
    probes = [BAD_CONFIRM, search(2, "good"), search(3, "undecided")]
    assert Bisection(setup_of(N), probes).verdict() == Verdict(
        "undecided",
        "the probe of 3/4 rev3 was undecided: the first change lies after 2/4 rev2, up to 4/4 rev4 (2 "
        "candidates); no culprit named",
        2,
        4,
    )


def test_one_skipped_candidate_before_the_first_bad_one_is_named_as_the_one_and_the_remainder_is_kept():
    """A skipped candidate may be the culprit: "3 or the one skipped before it: 2"; the remainder's answer
    (the bad end not slower than 3) stays in the verdict, for the report's line on a further regression."""
    probes = [BAD_CONFIRM, search(2, "skip"), search(1, "good"), search(3, "bad")]
    probes.append(ProbeRecord(kind="remainder", base=3, head=N, outcome="good"))
    assert Bisection(setup_of(N), probes).verdict() == Verdict(
        "candidates",
        "the first bad one is 3/4 rev3 or the one skipped before it: 2/4 rev2",
        1,
        3,
        (2, 3),
        "good",
    )


def test_several_skipped_candidates_are_counted_and_each_named():
    probes = [BAD_CONFIRM, search(2, "skip"), search(1, "skip"), search(3, "bad")]
    v = Bisection(setup_of(N), probes).verdict()
    assert (v.status, v.first_bad) == ("candidates", (1, 2, 3))
    assert v.message == "the first bad one is 3/4 rev3 or one of the 2 skipped before it: 1/4 rev1; 2/4 rev2"


def test_no_remainder_is_asked_when_the_first_bad_one_is_the_bad_end_itself():
    """Every candidate before the bad end was good: nothing lies after it to be slower, and a comparison of the
    bad end with itself would spend a share of alpha on nothing."""
    probes = [BAD_CONFIRM, search(2, "good"), search(3, "good")]
    b = Bisection(setup_of(N), probes)
    assert b.next_step() is None
    assert b.verdict() == Verdict("culprit", "the first bad one is 4/4 rev4", 3, 4, (4,))


def test_a_test_bisect_finds_its_ends_by_candidate_whatever_order_its_state_lists_them_in():
    """A state file listing the good end's run first (merged or written by hand) still searches: read by
    position, the good end's pass would be taken for the bad end's failure and 4/4 named culprit unprobed."""
    ends = [
        ProbeRecord(kind="end", base=None, head=0, outcome="good"),
        ProbeRecord(kind="end", base=None, head=N, outcome="bad"),
    ]
    assert Bisection(setup_of(N, "test"), ends).next_step() == Step("search", None, 2)


def test_a_test_bisect_runs_its_node_at_the_midpoint_alone_against_no_base():
    """A test probe has no base (a Step's None): the node runs at one candidate, nothing is compared."""
    ends = [
        ProbeRecord(kind="end", base=None, head=N, outcome="bad"),
        ProbeRecord(kind="end", base=None, head=0, outcome="good"),
    ]
    assert Bisection(setup_of(N, "test"), ends).next_step() == Step("search", None, 2)


def report(rows: list[Row], pairs: int = 9, error: str | None = None, failed: str | None = None) -> ABReport:
    """run_ab's report of one configuration: `rows` over `pairs` pairs; with `error`, the `failed` side's run
    failed after them."""
    o = ConfigOutcome(CFG, "cfg", pairs=[Pair("AB", {}, {})] * pairs, rows=rows, error=error, failed=failed)
    return ABReport([o], 0.01, 0.01, 0.02, 0.01, 1.0, False, "", "")


def row(metric: str, verdict: str, gated: bool = True, effect: bool = True) -> Row:
    e = stats.Effect(9, 0.05, 0.03, 0.07, 0.99, 0.01, 0.01, 0.01) if effect else None
    return Row("cfg", metric, gated, [1.0] * 9, [1.05] * 9, verdict, e)


def probe_midpoint(answer: ABReport) -> ProbeRecord:
    """Candidate 2 of 4 against the good end, where the confirm followed the step time."""
    b = Bisection(setup_of(N), [BAD_CONFIRM])
    return compare_probe(b, Step("search", 0, 2), lambda step, **_: answer)


def test_a_search_probe_follows_only_the_gated_row_of_the_confirms_metric():
    """The device time regressed beside it, ungated step time too: the midpoint's outcome is the gated step
    time's verdict alone (good), not the first row that regressed."""
    rows = [row("device_compute_s", stats.REGRESSION), row("step_time_s", stats.UNCHANGED)]
    assert probe_midpoint(report(rows)).outcome == "good"
    rows = [row("step_time_s", stats.REGRESSION, gated=False), row("device_compute_s", stats.UNCHANGED)]
    assert probe_midpoint(report(rows)).outcome == "undecided"


def test_a_search_probe_whose_report_has_no_gated_row_of_its_metric_is_undecided():
    """No answer on the metric followed (the gate judged none): undecided, which stops the search with the
    range so far, never a guess of good or bad."""
    record = probe_midpoint(report([row("device_compute_s", stats.REGRESSION)]))
    assert (record.outcome, record.metric, record.pairs) == ("undecided", "step_time_s", 9)


def test_a_comparison_that_failed_part_way_keeps_the_rows_and_pairs_it_measured():
    """The midpoint's run failed after 4 pairs: a skip whose record still shows the 4 pairs and what they
    measured, so the report tells a late failure from one at the first pair."""
    rows = [row("step_time_s", stats.UNDECIDED)]
    record = probe_midpoint(report(rows, pairs=4, error="rank 0 died", failed="head"))
    assert (record.outcome, record.failed, record.error, record.pairs) == ("skip", "head", "rank 0 died", 4)
    assert [r.metric for r in record.rows] == ["step_time_s"]
    assert record.alpha is None  # it decided nothing, so it spends no alpha


def test_a_metric_the_gate_could_not_estimate_is_kept_as_a_row_without_an_interval():
    record = probe_midpoint(report([row("step_time_s", stats.UNDECIDED, effect=False)]))
    assert record.rows == [MetricRow(metric="step_time_s", gated=True, verdict=stats.UNDECIDED)]


def test_a_search_probe_is_never_run_without_the_metric_the_confirm_chose():
    """A state whose bad confirm names no metric (written by hand) stops before any comparison, rather than
    gating the midpoint on no metric at all."""
    asked = []
    b = Bisection(setup_of(N), [BAD_CONFIRM.model_copy(update={"metric": None})])
    with pytest.raises(AssertionError):
        compare_probe(b, Step("search", 0, 2), lambda step, **kw: asked.append(step))
    assert asked == []


def test_a_test_probe_that_could_not_run_names_the_candidate_as_the_side_that_failed():
    """A skip records why and that the head (the one candidate a test probe runs) failed, as a performance
    probe's does; a pass or a failure names no failed side and no empty error."""
    assert bisect.test_probe(Step("search", None, 2), lambda i: ("skip", "not collected")) == ProbeRecord(
        kind="search", base=None, head=2, outcome="skip", error="not collected", failed="head"
    )
    assert bisect.test_probe(Step("search", None, 2), lambda i: ("bad", "")) == ProbeRecord(
        kind="search", base=None, head=2, outcome="bad"
    )


FIX = "remove it to start over, or give another --output"


def test_a_state_file_that_cannot_be_read_says_so_with_the_systems_reason(tmp_path):
    with pytest.raises(StateFileError) as e:
        load_state(tmp_path)
    assert str(e.value) == f"cannot read the bisect state {tmp_path}: Is a directory"


def test_a_state_file_that_holds_no_json_object_is_refused_as_another_schema_with_the_fix(tmp_path):
    """A JSON list (another tool's output) has no schema: refused in words, with what to do, not a crash."""
    path = tmp_path / STATE_FILE
    path.write_text("[1, 2]")
    with pytest.raises(StateFileError) as e:
        load_state(path)
    assert str(e.value) == f"{path} is not a {STATE_SCHEMA} file (its schema is None); {FIX}"


def test_a_damaged_state_file_names_the_field_and_pydantics_reason_in_lower_case(tmp_path):
    path = tmp_path / STATE_FILE
    path.write_text(json.dumps({"schema": STATE_SCHEMA, "setup": setup_of(N).model_dump(mode="json")}))
    with pytest.raises(StateFileError) as e:
        load_state(path)
    assert str(e.value) == f"{path} is a damaged {STATE_SCHEMA} file (probes: field required); {FIX}"


def resume_with(tmp_path, there: dict, here: dict) -> Bisection:
    """Resume a bisect whose state file was written with configuration `there`, given configuration `here`."""
    path = tmp_path / STATE_FILE
    save_state(path, Bisection(setup_of(N).model_copy(update={"config": there}), [BAD_CONFIRM]))
    return resume(path, setup_of(N).model_copy(update={"config": here}))


def test_another_bisects_state_file_names_the_setting_that_differs_and_the_fix(tmp_path):
    with pytest.raises(StateFileError) as e:
        resume_with(tmp_path, {"steps": 6}, {"steps": 8})
    assert str(e.value) == (
        f"{tmp_path / STATE_FILE} belongs to another bisect (config.steps differs: 6 there, 8 here); give the "
        "same arguments to resume it, or another --output"
    )


def test_a_setting_only_the_state_file_has_is_named_as_what_differs(tmp_path):
    """A setting the new arguments lack (None here) is as much a difference as a changed one."""
    with pytest.raises(StateFileError, match=r"\(config\.extra differs: 1 there, None here\)"):
        resume_with(tmp_path, {"steps": 6, "extra": 1}, {"steps": 6})


def test_a_nested_setting_that_is_a_table_on_one_side_only_is_named_with_both_values(tmp_path):
    with pytest.raises(StateFileError, match=r"\(config\.opt differs: \{'lr': 1\} there, 5 here\)"):
        resume_with(tmp_path, {"opt": {"lr": 1}}, {"opt": 5})


def test_a_setup_holding_tuples_resumes_from_the_lists_its_state_file_holds(tmp_path):
    """Setups are compared as JSON holds them: RunConfig's betas (a tuple) match the list the file wrote, so a
    resumed bisect does not refuse its own state."""
    b = resume_with(tmp_path, {"betas": (0.9, 0.95)}, {"betas": (0.9, 0.95)})
    assert b.probes == [BAD_CONFIRM]


def test_each_probe_records_the_seconds_its_own_probe_took():
    """The report's cost per probe: the clock's difference across that probe alone (3.5 s, then 2 s), not
    the clock's reading nor anything before it."""
    ticks = iter([100.0, 103.5, 200.0, 202.0])
    answers = {2: "good", 3: "good"}
    b = Bisection(setup_of(N), [BAD_CONFIRM])

    def probe(step: Step) -> ProbeRecord:
        return search(step.head, answers.get(step.head, "bad"))

    bisect.run(b, probe, clock=lambda: next(ticks))
    assert [(p.head, p.seconds) for p in b.probes[1:]] == [(2, 3.5), (3, 2.0)]


def test_a_good_end_that_cannot_start_beside_a_midpoint_stops_the_search_and_never_skips_the_midpoint():
    """The failure is the good end's (its label "base"): undecided with failed="base", which stops the search
    as "ends"; read as the midpoint's own failure it would skip a candidate that was never tried."""

    def compare(step: Step, **_: object) -> ABReport:
        raise VariantStartError("base", "rev0 does not import")

    record = compare_probe(Bisection(setup_of(N), [BAD_CONFIRM]), Step("search", 0, 2), compare)
    assert (record.outcome, record.failed, record.error) == ("undecided", "base", "rev0 does not import")
