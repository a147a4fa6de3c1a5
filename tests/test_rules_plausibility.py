"""The plausibility rules' words and bounds (plausibility.py), each against numbers written out here: the whole
message a finding prints (the figures a reader acts on: milliseconds, percentages, which run, what to do), and
where each bound lies (a figure exactly at a bound is not past it)."""

from __future__ import annotations

from typing import Any

from distbench.measure.devicetime import DEVICE_BOUND_RATIO
from distbench.plausibility import annotate, check, host_bound, rel_spread, repeat_notes
from test_plausibility import run, side_by_side


def own_warnings(r: dict[str, Any]) -> list[str]:
    """The warnings of `r` checked on its own (a 1-rank run: no speedup to judge)."""
    return check([r]).get(r["id"], [])


def with_step_times(r: dict[str, Any], **st: float | None) -> dict[str, Any]:
    r["step_time_s"] = {k: v for k, v in {**r["step_time_s"], **st}.items() if v is not None}
    for k, v in st.items():
        if v is None:
            r["step_time_s"].pop(k, None)
    return r


# --- a run's own measurement ---------------------------------------------------------------------------------


def test_a_spread_wider_than_the_median_prints_p10_p90_std_and_median_in_milliseconds() -> None:
    r = with_step_times(run("single", 1, 1000), median=1.0, p10=0.2, p90=2.05, std=0.4)
    assert own_warnings(r) == [
        "step times spread wider than their median: p10-p90 200.0-2050.0 ms, std 400.0 ms, median 1000.0 ms; its "
        "throughput is not a measurement (contention? too few steps?)"
    ]


def test_a_spread_of_the_std_alone_counts_and_a_figure_not_recorded_prints_as_zero() -> None:
    """Without p10 and p90 the std alone is the width; without a std, the p10-p90 width; what was not recorded
    prints as 0.0 ms."""
    r = with_step_times(run("single", 1, 1000), median=0.010, p10=None, p90=None, std=0.020)
    assert own_warnings(r) == [
        "step times spread wider than their median: p10-p90 0.0-0.0 ms, std 20.0 ms, median 10.0 ms; its "
        "throughput is not a measurement (contention? too few steps?)"
    ]
    r = with_step_times(run("single", 1, 1000), median=0.010, p10=0.001, p90=0.012, std=None)
    assert own_warnings(r)[0].startswith(
        "step times spread wider than their median: p10-p90 1.0-12.0 ms, std 0.0 ms"
    )


def test_a_spread_exactly_as_wide_as_the_median_is_not_flagged() -> None:
    r = with_step_times(run("single", 1, 1000), median=0.5, p10=0.25, p90=0.75, std=0.0)
    assert own_warnings(r) == []


def test_the_relative_spread_is_zero_where_a_figure_of_it_is_missing() -> None:
    """(p90 - p10) / median; 0 where the median is missing or zero, or p10 or p90 was not recorded."""
    assert rel_spread({"step_time_s": {"median": 0.5, "p10": 0.25, "p90": 1.0}}) == 1.5
    for st in (
        {},
        {"median": 0.0, "p10": 0.25, "p90": 1.0},
        {"median": 0.5, "p90": 1.0},
        {"median": 0.5, "p10": 0.25},
    ):
        assert rel_spread({"step_time_s": st}) == 0.0, st
    assert rel_spread({}) == 0.0


def test_a_run_below_its_repeats_says_by_how_much_and_why_it_matters() -> None:
    """The first run of the set, on 1 rank, 20% below its two repeats: both reasons, in that order."""
    first = run("single", 1, 800, created="2026-11-23T06:00:00+00:00")
    results = [first, run("single", 1, 1000), run("single", 1, 1000)]
    assert check(results)[first["id"]] == [
        "slower than its repeats: 800 tokens/s, 20% below the median of its 2 other repeat(s) (1,000): the "
        "first run of the set, a cold start; add warm-up steps or discard it: as a 1-rank reference it "
        "inflates every speedup measured against it"
    ]


def test_a_run_exactly_at_its_repeats_bound_is_not_below_them() -> None:
    """The bound is the median less the larger of 10% and the repeats' spread: 900 against 1,000 and 1,000."""
    r = run("single", 1, 900, created="2026-11-23T06:00:30+00:00")
    assert check([r, run("single", 1, 1000), run("single", 1, 1000)]).get(r["id"]) is None


# --- the speedup against the 1-rank reference ------------------------------------------------------------------


def two_ranks_side_by_side(estimate: float, low: float, high: float) -> list[dict[str, Any]]:
    """single on 1 rank and ddp on 2, measured side by side: the paired speedup 1 + estimate, its interval
    1 + low to 1 + high."""
    r = side_by_side(run("ddp", 2, 1800), estimate, 0.0)
    r["side_by_side"]["vs_reference"].update(low=low, high=high)
    return [run("single", 1, 1000), r]


def scaling_warnings(results: list[dict[str, Any]]) -> list[str]:
    return check(results).get(results[-1]["id"], [])


def test_superlinear_beyond_the_paired_interval_names_the_speedup_reference_and_noise() -> None:
    """A paired speedup 3.00x on 2 ranks whose interval reaches 20% below it (2.4x) and 10% above (3.3x): the
    noise is the larger half, 20%, and 3.00 > 2 x 1.2."""
    assert scaling_warnings(two_ranks_side_by_side(2.0, 1.4, 2.3)) == [
        "superlinear: 3.00x the tokens/s of single on 1 rank (1,000, median of 1 run(s)) on 2 rank(s), beyond "
        "linear by more than the step-time spread (+-20%); the 1-rank run was likely cold, contended or short "
        "of CPU: rerun it on a quiet machine"
    ]


def test_a_speedup_exactly_at_linear_plus_its_noise_is_within_noise() -> None:
    """3.00x on 2 ranks with a noise of exactly 50% (the interval reaches 1.5x): not beyond 2 x 1.5, yet
    above linear by more than 10%."""
    (w,) = scaling_warnings(two_ranks_side_by_side(2.0, 0.5, 2.0))
    assert w == (
        "superlinear within noise: 3.00x the tokens/s of single on 1 rank (1,000, median of 1 run(s)) on 2 "
        "rank(s), above linear only inside a step-time spread of +-50%: an artefact of noisy runs, not a "
        "result; take more steps or repeats"
    )


def test_a_speedup_exactly_ten_percent_above_linear_is_not_superlinear() -> None:
    """2.2x on 2 ranks (2 x 1.1 exactly) with a 20% noise: neither superlinear bound is passed, and it is a
    gain far beyond its noise."""
    assert scaling_warnings(two_ranks_side_by_side(1.2, 0.76, 1.2)) == []
    (w,) = scaling_warnings(
        two_ranks_side_by_side(1.5, 0.75, 1.5)
    )  # 2.5x, noise 30%: above 2.2, inside 2 x 1.3
    assert w.startswith("superlinear within noise: 2.50x")


def test_a_speedup_whose_distance_from_one_equals_its_noise_shows_neither_gain_nor_loss() -> None:
    """1.25x on 2 ranks whose interval reaches 0.9375x: a noise of exactly 25%, and |1.25 - 1| is no larger."""
    assert scaling_warnings(two_ranks_side_by_side(0.25, -0.0625, 0.25)) == [
        "speedup within noise: 1.25x the tokens/s of single on 1 rank (1,000, median of 1 run(s)) on 2 "
        "rank(s), inside the step-time spread (+-25%): it shows neither a gain nor a loss; take more steps or "
        "repeats"
    ]


def test_against_a_flagged_reference_the_warning_quotes_the_references_first_finding_by_its_name() -> None:
    ref = with_step_times(run("single", 1, 1000), median=0.010, p10=0.002, p90=0.0205, std=0.004)
    r = run("ddp", 2, 1800)
    assert check([ref, r])[r["id"]] == [
        "against a flagged reference: every 1-rank run of single it would be measured against is flagged "
        'itself ("step times spread wider than their median"), so it has no speedup or efficiency; rerun the '
        "reference"
    ]


# --- what would not hold on a repeat -----------------------------------------------------------------------------


def test_a_paired_speedup_whose_interval_is_wider_than_three_percent_may_not_repeat() -> None:
    """1.5x with an interval of 1.35x-1.6x: 10.0% below and 6.7% above, over 6 rounds."""
    r = side_by_side(run("ddp", 2, 1800), 0.5, 0.0)
    r["side_by_side"]["vs_reference"].update(low=0.35, high=0.6)
    assert repeat_notes(r) == [
        "its speedup may not repeat: 95% interval -10.0%/+6.7% over 6 rounds (wider than +/-3%), as its "
        "windows moved against single ws1 gpt2-tiny fp32 mb2's in the same rounds: the step itself varies; "
        "take more windows"
    ]


def test_tokens_per_s_whose_interval_is_wider_than_five_percent_may_not_repeat() -> None:
    """A step of 0.1 s whose interval is 0.08-0.125 s: tokens/s 20.0% below and 25.0% above."""
    r = run("ddp", 2, 1800)
    r["metrics"]["step_time_s"] = 0.1
    r["step_time_s"]["interval"] = [0.08, 0.125]
    assert repeat_notes(r) == [
        "its tokens/s may not repeat: 95% interval -20.0%/+25.0% (wider than +/-5%), as its windows' times "
        "spread 4% (p10-p90)"
    ]


def test_a_failed_run_gets_no_notes_whatever_figures_it_carries() -> None:
    r = side_by_side(run("ddp", 2, 1800), 0.5, 0.2)
    r["status"] = "error"
    annotate([r])
    assert r["notes"] == [] and r["warnings"] == []


# --- a table's host-bound line ---------------------------------------------------------------------------------


def busy(r: dict[str, Any], ratio: float) -> dict[str, Any]:
    r["metrics"]["busy_ratio"] = ratio
    return r


def test_a_table_is_host_bound_by_ddps_row_at_its_smallest_world_size() -> None:
    rows = [
        busy(run("ddp", 4, 3000), 0.95),
        busy(run("ddp", 2, 1800), 0.4),
        busy(run("single", 1, 1000), 0.95),
    ]
    assert host_bound(rows) == (
        "Host-bound: the device was busy 40% of ddp ws2's step (under 90%), so the speedups here measure the "
        "host's launch speed as much as the strategies; a larger model or micro-batch measures the GPU"
    )


def test_without_ddp_the_speedups_reference_decides_then_the_first_row() -> None:
    rows = [busy(run("zero2", 2, 1800), 0.95), busy(run("single", 1, 1000), 0.3)]
    line = host_bound(rows)
    assert line is not None and line.startswith("Host-bound: the device was busy 30% of single ws1's step")
    (alone,) = [busy(run("zero2", 2, 1800), 0.3)]
    line = host_bound([alone])
    assert line is not None and line.startswith("Host-bound: the device was busy 30% of zero2 ws2's step")


def test_a_device_busy_exactly_the_bound_is_device_bound() -> None:
    assert host_bound([busy(run("ddp", 2, 1800), DEVICE_BOUND_RATIO)]) is None


# --- the host: contention and speed --------------------------------------------------------------------------


def with_waits(r: dict[str, Any], waits: list[tuple[float, float]], steps: list[float]) -> dict[str, Any]:
    """`r` with one timed window per rank whose main and autograd threads waited `waits[rank]` seconds for a
    CPU, and its timed steps."""
    r["host"] = {
        "speed": [
            [{"ref_s": [0.007, 0.007], "threads": {"main_wait_s": m, "autograd_wait_s": a}}] for m, a in waits
        ]
    }
    r["step_time_s"]["steps"] = steps
    return r


def contended(r: dict[str, Any]) -> list[str]:
    return [w for w in own_warnings(r) if w.startswith("a contended host")]


def test_a_contended_host_counts_both_training_threads_waits_of_the_most_delayed_rank() -> None:
    """Rank 1's main thread waited 1.5 s and its autograd thread 0.5 s of 20 s of timed steps: 2,000 ms, 10%."""
    r = with_waits(run("single", 1, 1000), [(0.05, 0.0), (1.5, 0.5)], [2.5] * 8)
    assert contended(r) == [
        "a contended host: the training threads of rank 1 waited 2,000 ms for a CPU, 10% of the 20.00 s of timed "
        "steps: another process had their cores; rerun on a quiet machine"
    ]


def test_a_wait_of_exactly_five_percent_of_the_timed_steps_is_not_contention() -> None:
    r = with_waits(run("single", 1, 1000), [(0.15, 0.05)], [0.5] * 8)  # 0.2 s of 4 s
    assert contended(r) == []


def test_a_run_without_thread_readings_is_not_contended() -> None:
    r = run("single", 1, 1000)
    r["step_time_s"]["steps"] = [0.01] * 8
    assert contended(r) == []


def with_refs(
    r: dict[str, Any], refs: list[list[float]], spread: tuple[float, float, float]
) -> dict[str, Any]:
    """`r`, host-bound, with per-rank reference readings and step times (p10, median, p90)."""
    r["host"] = {"speed": [[{"ref_s": ref}] for ref in refs]}
    r["regime"] = {"regime": "host-bound"}
    p10, med, p90 = spread
    return with_step_times(r, p10=p10, median=med, p90=p90, std=0.0)


def host_speed(r: dict[str, Any]) -> list[str]:
    return [w for w in own_warnings(r) if w.startswith("the host ran at different speeds")]


def test_the_host_speed_finding_names_the_fastest_and_slowest_reading_of_the_rank_that_moved_most() -> None:
    r = with_refs(run("single", 1, 1000), [[0.5, 0.55], [0.5, 0.6875]], (0.4, 0.5, 0.6))
    assert host_speed(r) == [
        "the host ran at different speeds: the same launch work took 500.00-687.50 ms (x1.38) on one rank "
        "around this run's windows, and its step times, not device-bound, spread 40% with it; compare such "
        "runs with `distbench ab --bind-cpus` (interleaved windows on one core), not as separate runs"
    ]


def test_a_host_that_moved_by_exactly_the_bound_or_a_step_that_moved_by_exactly_its_bound_is_steady() -> None:
    """x1.25 exactly (0.5 to 0.625 s) is not past HOST_SPEED_RATIO; step times spread exactly 10% (9.5-10.5
    around 10) are not past HOST_MOVED."""
    assert host_speed(with_refs(run("single", 1, 1000), [[0.5, 0.625]], (0.4, 0.5, 0.6))) == []
    assert host_speed(with_refs(run("single", 1, 1000), [[0.5, 0.6875]], (9.5, 10.0, 10.5))) == []


def test_a_rank_without_two_positive_readings_is_left_out_of_the_host_speed() -> None:
    """A rank with no reading, or one of 0 s (nothing to divide by), says nothing; the rank that moved still
    does."""
    r = with_refs(run("single", 1, 1000), [[], [0.0, 0.7], [0.5, 0.6875]], (0.4, 0.5, 0.6))
    (w,) = host_speed(r)
    assert "500.00-687.50 ms (x1.38)" in w


# --- the set -------------------------------------------------------------------------------------------------------


def test_the_first_run_of_a_set_is_the_earliest_created_wherever_it_is_listed() -> None:
    """The cold start is the run created first, not the one listed first (a report loads files in name
    order)."""
    early = run("single", 1, 800, created="2026-11-23T06:00:00+00:00")
    later = run("single", 1, 1000, created="2026-11-23T06:05:00+00:00")
    found = check([later, run("single", 1, 1000), run("single", 1, 1000), early])
    assert "the first run of the set, a cold start" in found[early["id"]][0] and later["id"] not in found


def test_an_empty_set_or_one_of_failed_runs_has_nothing_to_check() -> None:
    """A failed run is not checked even where it carries a figure (a partial measurement)."""
    failed = with_step_times(run("single", 1, 1000), median=0.010, p10=0.002, p90=0.0205)
    failed["status"] = "error"
    assert check([]) == {} and check([failed]) == {}


def test_annotating_a_set_again_gives_the_same_warnings() -> None:
    """A report reloads saved results, which carry the warnings annotate wrote: checking them again still
    finds the flagged reference a speedup would be measured against."""
    ref = with_step_times(run("single", 1, 1000), median=0.010, p10=0.002, p90=0.0205, std=0.004)
    results = [ref, run("ddp", 2, 1800)]
    annotate(results)
    once = [list(r["warnings"]) for r in results]
    assert once[1][0].startswith("against a flagged reference")
    annotate(results)
    assert [r["warnings"] for r in results] == once
