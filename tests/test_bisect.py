"""`distbench bisect`'s search over simulated histories: every probe is a real run_ab comparison of synthetic
runs drawn from each candidate's true step time with noise, so the search, its statistics and its honesty
are held to what each history really is, over many seeds. Each property comes with a bite: a search with
that property broken (planted from outside by monkeypatching) fails the same check. Below them: the command's
path from its flags to each comparison, what a test-mode run counts as good, the outcome's words, and the
clean-up after a kill. The decision as a state machine over generated histories is in
tests/test_bisect_decision.py; the end-to-end runs on git histories are in tests/test_bisect_e2e.py."""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from distbench.config import RunConfig
from distbench.errors import ConfigError
from distbench.gate import bisect, stats
from distbench.gate.ab import run_ab
from distbench.gate.bisect import Bisection, Candidate, ProbeRecord, Setup, StateFileError, Step
from distbench.gate.variants import VariantStartError

CFG = RunConfig(strategy="ddp", world_size=1, model="gpt2-tiny", steps=6, windows=3, deterministic=False)


def setup_of(n: int, mode: str = "perf", **rule) -> Setup:
    """n + 1 candidates; a performance bisect at the gate's rule (alpha, threshold, min_effect as `distbench ab`
    has them), on a schedule of 3 to 9 pairs a probe judged every 3, with `rule` on top."""
    candidates = [Candidate(spec=f"{i:040x}", label=f"rev{i}") for i in range(n + 1)]
    if mode == "test":
        return Setup(mode="test", source="simulated", candidates=candidates, nodeid="tests/test_x.py::test_y")
    gate = {"alpha": 0.05, "threshold": 0.02, "min_effect": 0.01, "interleave": "windows"}
    schedule = {"min_pairs": 3, "max_pairs": 9, "look_every": 3}
    r = bisect.Rule(**{**gate, **schedule, **rule})
    return Setup(mode="perf", source="simulated", candidates=candidates, config=CFG.to_dict(), rule=r)


def unimportable() -> str:
    """The error of a failure result where the model's module does not import in the rank: a JobError's text,
    whose first line says only where it failed, the rank's traceback of the ImportError below it."""
    from distbench.errors import ConfigError
    from distbench.runtime.pool import JobError, RankOutcome, failure_summary

    try:
        try:
            import sleepy_missing_module  # noqa: F401
        except ImportError as e:
            raise ConfigError(f"model factory 'sleepy.model:build' raised ImportError: {e}") from None
    except ConfigError:
        rank = RankOutcome(0, "error", "ConfigError", traceback.format_exc())
    return str(JobError("bench_setup", 1, [rank], failure_summary([rank], 900)))


def effect_of(effect: tuple[float, float, float], alpha: float) -> stats.Effect:
    return stats.Effect(9, *effect, 1 - alpha, 0.01, 0.5, 0.01)


def ab_report(metric, verdict, effect, *, alpha, threshold, error=None, failed=None):
    """run_ab's report of one configuration over 9 pairs, gating `metric`: its verdict and effect (estimate,
    low, high); or, with `error`, the `failed` side's run failed at the first pair, no pair kept."""
    from distbench.gate.ab import ABReport, ConfigOutcome, Pair, Row

    row = Row("cfg", metric, True, [1.0] * 9, [1 + effect[0]] * 9, verdict, effect_of(effect, alpha))
    pairs = [] if error else [Pair("AB", {"id": "base"}, {"id": "head"})] * 9
    o = ConfigOutcome(CFG, "cfg", pairs=pairs, gated=(metric,), rows=[] if error else [row])
    o.error, o.failed = error, failed
    return ABReport([o], alpha, alpha, threshold, 0.01, 1.0, False, "", "")


class History:
    """Candidates with a true step time each (a step function of regressions); a run is that time times a
    process bias (fresh processes every round) times the median of 3 window noises. `broken` candidates do
    not start, the runs of `crashes` fail (their module does not import in the rank); `device` adds a device
    compute time that moves with `device_slower` only."""

    def __init__(
        self,
        n: int,
        slower: dict[int, float],
        seed: int,
        run_sd: float = 0.002,
        window_sd: float = 0.003,
        broken: frozenset[int] = frozenset(),
        crashes: frozenset[int] = frozenset(),
        device_slower: dict[int, float] | None = None,
    ) -> None:
        self.rng = np.random.default_rng(seed)
        self.run_sd, self.window_sd, self.broken, self.crashes = run_sd, window_sd, broken, crashes
        self.level = [math.prod(f for i, f in slower.items() if i <= k) for k in range(n + 1)]
        self.device = (
            None
            if device_slower is None
            else [math.prod(f for i, f in device_slower.items() if i <= k) for k in range(n + 1)]
        )
        self.comparisons: list[Step] = []

    def run(self, k: int) -> dict:
        if k in self.crashes:
            return {"status": "error", "error": unimportable()}
        noise = math.exp(self.rng.normal(0, self.run_sd))
        value = 0.05 * self.level[k] * noise * float(np.median(np.exp(self.rng.normal(0, self.window_sd, 3))))
        metrics = {"step_time_s": value}
        regime = None
        if self.device is not None:
            metrics["device_compute_s"] = 0.04 * self.device[k] * math.exp(self.rng.normal(0, 0.002))
            regime = {"regime": "device-bound", "busy_ratio": 0.95}
        return {"status": "ok", "id": f"r{self.rng.integers(1 << 30)}", "metrics": metrics, "regime": regime}

    def compare(self, b: Bisection):
        def go(step: Step, *, gate, alpha, threshold):
            self.comparisons.append(step)
            if step.head in self.broken:
                raise VariantStartError("head", f"variant head ({step.head}) did not start: ImportError")
            s = b.setup.gate
            return run_ab(
                [CFG],
                lambda c: self.run(step.base),
                lambda c: self.run(step.head),
                alpha=alpha,
                threshold=threshold,
                min_effect=s.min_effect,
                min_pairs=s.min_pairs,
                max_pairs=s.max_pairs,
                look_every=s.look_every,
                gate=gate,
            )

        return go


def bisect_sim(history: History, n: int, **setup) -> tuple[Bisection, bisect.Verdict]:
    b = Bisection(setup_of(n, **setup), [])
    compare = history.compare(b)
    verdict = bisect.run(b, lambda step: bisect.compare_probe(b, step, compare))
    return b, verdict


def comparisons(b: Bisection) -> int:
    return sum(p.outcome != "skip" for p in b.probes)


# ---- mutants: searches with one property broken, planted from outside -------------------------------------


def linear_next_step(self: Bisection) -> Step | None:
    """A search that walks from the good end one candidate at a time."""
    if self.confirm is None:
        return Step("confirm", 0, self.n)
    if self.confirm.outcome != "bad" or "undecided" in self._status().values():
        return None
    lo, hi = self.bounds()
    return Step("search", 0, lo + 1) if lo + 1 < hi else None


def point_estimate_probe(b: Bisection, step: Step, compare) -> ProbeRecord:
    """A probe that trusts its point estimate: the midpoint is bad when its effect is past half the threshold,
    whatever its interval says (one noisy measurement decides, as in a plain `git bisect run`)."""
    record = REAL_COMPARE_PROBE(b, step, compare)
    row = record.row()
    if step.kind != "search" or row is None or row.estimate is None:
        return record
    outcome = "bad" if row.estimate > b.probe_threshold / 2 else "good"
    return record.model_copy(update={"outcome": outcome})


REAL_COMPARE_PROBE = bisect.compare_probe


# ---- the search finds the culprit in ceil(log2 n) + 2 comparisons -----------------------------------------


def check_the_bound(seeds: range) -> None:
    """n = 16, a 10% slowdown at a culprit that moves with the seed: found, within ceil(log2 16) + 2."""
    bound = math.ceil(math.log2(16)) + 2
    for seed in seeds:
        culprit = 1 + seed * 7 % 16
        b, v = bisect_sim(History(16, {culprit: 1.10}, seed), 16)
        assert v.first_bad == (culprit,), v.message
        assert comparisons(b) <= bound, f"{comparisons(b)} comparisons, above the bound {bound}"
        assert [p.kind for p in b.probes].count("remainder") == (culprit < 16)


def test_the_culprit_is_found_in_at_most_log2_n_plus_2_comparisons():
    check_the_bound(range(0, 16, 2))  # culprits 1, 15, 13, ..., 3: both ends of the range and between


def test_bite_a_linear_search_exceeds_the_bound(monkeypatch):
    monkeypatch.setattr(Bisection, "next_step", linear_next_step)
    with pytest.raises(AssertionError, match="above the bound"):
        check_the_bound(range(4, 6))


# ---- honest under noise: no wrong culprit beyond alpha, undecided names none ------------------------------


def _wrong_culprits(seeds: range, run_sd: float) -> tuple[int, int]:
    """(seeds naming a wrong culprit, seeds undecided) at a process spread of `run_sd` around a 10% step."""
    wrong = undecided = 0
    for seed in seeds:
        culprit = 1 + seed % 8
        _, v = bisect_sim(History(8, {culprit: 1.10}, 100 + seed, run_sd=run_sd), 8)
        wrong += bool(v.first_bad) and culprit not in v.first_bad
        undecided += v.status == "undecided"
        if v.status == "undecided":
            assert not v.first_bad and v.lo < culprit <= v.hi, v  # the range holds the change
    return wrong, undecided


def test_noise_never_sends_the_search_down_the_wrong_half():
    # a 2% spread between processes: the gate's intervals widen, probes take more pairs or stay undecided
    wrong, undecided = _wrong_culprits(range(20), run_sd=0.02)
    assert wrong <= 1, f"{wrong} wrong culprits in 20 (the bisect's alpha is 5%)"  # alpha x 20
    assert undecided < 20


def test_bite_a_probe_that_trusts_its_point_estimate_names_wrong_culprits(monkeypatch):
    monkeypatch.setattr(bisect, "compare_probe", point_estimate_probe)
    with pytest.raises(AssertionError, match="wrong culprits"):
        test_noise_never_sends_the_search_down_the_wrong_half()


def test_an_undecided_probe_names_no_culprit_and_reports_the_range():
    # at a 2% spread, 9 pairs tell a 10% slowdown from none, not a 2% one: the first good midpoint stays open
    b, v = bisect_sim(History(16, {5: 1.10}, 0, run_sd=0.02), 16)
    assert v.status == "undecided" and v.exit_code == 3 and not v.first_bad
    last = b.probes[-1]
    assert last.kind == "search" and last.outcome == "undecided" and last.pairs == 9  # at the cap, then stop
    assert (v.lo, v.hi) == (0, 8) and [p.outcome for p in b.probes] == ["bad", "bad", "undecided"]
    assert all(p.row() is not None and p.row().low is not None for p in b.probes[1:])  # every interval kept


def test_bite_a_search_that_reads_undecided_as_good_names_a_culprit(monkeypatch):
    monkeypatch.setitem(bisect.OUTCOME_OF, stats.UNDECIDED, "good")
    with pytest.raises(AssertionError):
        test_an_undecided_probe_names_no_culprit_and_reports_the_range()


def test_a_regression_below_the_gate_threshold_is_bisected_on_its_own_size():
    """A 1.5% slowdown, under the gate's 2% threshold: a midpoint passes as good only once a slowdown of half
    the bad end's is ruled out, so the midpoints that carry it are not taken for good."""
    for seed in range(6):
        culprit = 1 + seed % 8
        b, v = bisect_sim(History(8, {culprit: 1.015}, 200 + seed), 8, max_pairs=24)
        assert b.probe_threshold < 0.01 and v.first_bad == (culprit,), v.message


def _probe_of(effect: tuple[float, float, float], b: Bisection) -> ProbeRecord:
    """The search probe of a midpoint whose comparison with good came out at `effect` (estimate, low, high),
    judged by the gate's verdict rule at the threshold the probe asks for."""

    def compare(step, *, gate, alpha, threshold):
        e = effect_of(effect, alpha)
        verdict = stats.verdict(e, -1, threshold=threshold, min_effect=b.setup.gate.min_effect)
        return ab_report(gate[0], verdict, effect, alpha=alpha, threshold=threshold)

    return bisect.compare_probe(b, Step("search", 0, 4), compare)


def test_a_midpoint_is_good_only_where_half_the_bad_ends_slowdown_is_ruled_out():
    # the confirm found bad 1.6% slower than good: below the gate's 2% threshold
    row = bisect.MetricRow(
        metric="step_time_s", gated=True, verdict="regression", estimate=0.016, low=0.008, high=0.024
    )
    confirm = ProbeRecord(kind="confirm", base=0, head=8, outcome="bad", metric="step_time_s", rows=[row])
    b = Bisection(setup_of(8), [confirm])
    assert _probe_of((0.009, -0.002, 0.019), b).outcome == "undecided"  # 2% ruled out, 0.8% not
    assert _probe_of((0.001, -0.004, 0.006), b).outcome == "good"
    assert _probe_of((0.015, 0.005, 0.025), b).outcome == "bad"
    assert b.probe_threshold == pytest.approx(0.008)


def test_bite_a_midpoint_good_once_the_gate_threshold_is_ruled_out(monkeypatch):
    monkeypatch.setattr(Bisection, "probe_threshold", property(lambda self: self.setup.gate.threshold))
    with pytest.raises(AssertionError):
        test_a_midpoint_is_good_only_where_half_the_bad_ends_slowdown_is_ruled_out()


# ---- two regressions, a revision that does not run, no regression ----------------------------------------


def test_two_regressions_report_the_first_and_a_remainder_still_slower():
    for seed in range(4):
        b, v = bisect_sim(History(16, {5: 1.10, 12: 1.10}, 300 + seed), 16)
        assert v.status == "culprit" and v.first_bad == (5,), v.message
        assert v.remainder == "bad" and "a further regression lies after 5/16 rev5" in v.message  # both named
        (rest,) = [p for p in b.probes if p.kind == "remainder"]
        assert (rest.base, rest.head) == (5, 16) and rest.row().verdict == stats.REGRESSION


REAL_NEXT_STEP = Bisection.next_step


def without_remainder(self: Bisection) -> Step | None:
    """A search that stops at the culprit, never comparing it with the bad end."""
    step = REAL_NEXT_STEP(self)
    return None if step is not None and step.kind == "remainder" else step


def against_the_bad_end(b: Bisection, step: Step, compare) -> ProbeRecord:
    """A probe that compares the midpoint with the bad end: it matches bad when it is not faster than bad."""
    if step.kind != "search":
        return REAL_COMPARE_PROBE(b, step, compare)
    record = REAL_COMPARE_PROBE(b, Step("search", b.n, step.head), compare)
    row = record.row()
    if row is None:
        return record
    outcome = {stats.IMPROVEMENT: "good", stats.UNCHANGED: "bad"}.get(row.verdict, record.outcome)
    return record.model_copy(update={"outcome": outcome})


@pytest.mark.parametrize("mutant", ["without-remainder", "against-the-bad-end"])
def test_bite_a_search_without_the_remainder_check_or_against_the_bad_end_fails(monkeypatch, mutant):
    if mutant == "without-remainder":
        monkeypatch.setattr(Bisection, "next_step", without_remainder)
    else:
        monkeypatch.setattr(bisect, "compare_probe", against_the_bad_end)
    with pytest.raises(AssertionError):
        test_two_regressions_report_the_first_and_a_remainder_still_slower()


def test_a_revision_that_does_not_run_is_skipped_and_reported():
    # the midpoint 8 does not import: the search goes around it and still names 11
    b, v = bisect_sim(History(16, {11: 1.10}, 7, broken=frozenset({8})), 16)
    assert v.status == "culprit" and v.first_bad == (11,)
    skips = [p for p in b.probes if p.outcome == "skip"]
    assert [(p.head, p.pairs) for p in skips] == [(8, 0)] and "did not start" in skips[0].error
    # the commit that brought the slowdown fails to run itself: the first bad one is it or the next
    b, v = bisect_sim(History(16, {9: 1.10}, 8, crashes=frozenset({9})), 16)
    assert v.status == "candidates" and v.first_bad == (9, 10) and v.exit_code == 1, v.message
    skip = next(p for p in b.probes if p.outcome == "skip")
    assert "skipped" in v.message and skip.head == 9
    # its real error, in one line: not where it failed ("job bench_setup failed ... raised ConfigError")
    assert skip.error == (
        "head run failed (error): distbench.errors.ConfigError: model factory 'sleepy.model:build' raised "
        "ImportError: No module named 'sleepy_missing_module'"
    )


@pytest.mark.parametrize("as_", ["good", "bad"])
def test_bite_a_search_that_ignores_skips_names_a_culprit_it_cannot_know(monkeypatch, as_):
    def skip_as(b, step, compare):
        record = REAL_COMPARE_PROBE(b, step, compare)
        return record.model_copy(update={"outcome": as_}) if record.outcome == "skip" else record

    monkeypatch.setattr(bisect, "compare_probe", skip_as)
    with pytest.raises(AssertionError):
        test_a_revision_that_does_not_run_is_skipped_and_reported()


def test_no_regression_means_nothing_to_find():
    for seed in range(4):
        b, v = bisect_sim(History(16, {}, 400 + seed), 16)
        assert v.status == "same" and v.exit_code == 0 and not v.first_bad, v.message
        assert [p.kind for p in b.probes] == ["confirm"]


def sign_of_the_first_probe(b: Bisection, step: Step, compare) -> ProbeRecord:
    """A bisect that takes bad for slower whenever the first probe's estimate is above zero, whatever the
    gate's verdict, and then searches on the step time."""
    record = REAL_COMPARE_PROBE(b, step, compare)
    row = record.row("step_time_s")
    if step.kind != "confirm" or row is None or row.estimate is None:
        return record
    slower = row.estimate > 0
    return record.model_copy(update={"outcome": "bad" if slower else "good", "metric": "step_time_s"})


def test_bite_a_search_that_does_not_confirm_the_ends_differ_names_a_culprit(monkeypatch):
    monkeypatch.setattr(bisect, "compare_probe", sign_of_the_first_probe)
    with pytest.raises(AssertionError, match="'same'"):
        test_no_regression_means_nothing_to_find()


def test_an_end_that_does_not_run_stops_the_bisect():
    b, v = bisect_sim(History(4, {2: 1.1}, 9, broken=frozenset({4})), 4)
    assert v.status == "ends" and v.exit_code == 2 and "did not start" in v.message
    assert len(b.probes) == 1


# ---- the metric follows the regime of the change ----------------------------------------------------------


@pytest.mark.parametrize(
    ("device_slower", "expected"), [({6: 1.05}, "device_compute_s"), ({}, "step_time_s")]
)
def test_the_bisect_follows_the_metric_that_moved(device_slower, expected):
    # a device-side change moves the kernel time (and the step); a host-side one moves the step alone
    h = History(8, {6: 1.05}, 11, device_slower=device_slower)
    b, v = bisect_sim(h, 8)
    assert b.confirm.metric == expected and v.first_bad == (6,)
    search = [p for p in b.probes if p.kind == "search"]
    assert search and all([r.metric for r in p.rows if r.gated] == [expected] for p in search)
    from distbench.report.bisect import metric_reason

    assert metric_reason(b).startswith(f"bisecting on {expected}: ")
    assert ("device-side" if expected == "device_compute_s" else "host-side") in metric_reason(b)


def _confirm_rows(device: str, verdict: str, estimate: float, low: float, high: float) -> list:
    step = bisect.MetricRow(metric="step_time_s", gated=True, verdict=stats.REGRESSION, estimate=0.031,
                            low=0.02, high=0.042)  # fmt: skip
    dev = bisect.MetricRow(metric=device, gated=True, verdict=verdict, estimate=estimate, low=low, high=high)
    return [step, dev]


@pytest.mark.parametrize(
    ("verdict", "estimate", "low", "high", "says", "never"),
    [
        # the confirm that printed "did not" beside +2.19%: moved, only not decided
        (stats.UNDECIDED, 0.0219, -0.004, 0.048, "moved by +2.19% but was not decided", "did not"),
        (
            stats.UNCHANGED,
            0.001,
            -0.003,
            0.005,
            "the device's kernel time did not (device_compute_s +0.10%",
            "not decided",
        ),  # fmt: skip
        (stats.IMPROVEMENT, -0.03, -0.04, -0.02, "got faster", "did not"),
    ],
)
def test_the_step_time_reason_says_what_the_device_figure_did(verdict, estimate, low, high, says, never):
    """Bisect's words match the device figure printed beside them: ruled out, faster, or moved without a
    decision (then neither "did not" nor "host-side" is claimed)."""
    words = bisect.step_time_reason(_confirm_rows("device_compute_s", verdict, estimate, low, high))
    assert says in words and never not in words, words
    assert ("host-side change" in words) == (verdict != stats.UNDECIDED)
    assert "was not sampled" in bisect.step_time_reason(
        _confirm_rows("device_compute_s", verdict, 0, 0, 0)[:1]
    )


def test_a_device_floor_that_regressed_is_followed_not_called_unmoved():
    """At two ranks the gated device figure is the floor: a regression of it is followed on it, as
    device_compute_s is at one rank, and never explained as step time with an unmoved device."""
    rows = _confirm_rows("device_compute_floor_s", stats.REGRESSION, 0.03, 0.02, 0.04)
    assert bisect.chosen_metric(rows) == "device_compute_floor_s"


def test_bite_the_old_fixed_words_contradict_an_undecided_device_figure(monkeypatch):
    """The fixed sentence of before ("the device's kernel time did not") fails the first case."""
    monkeypatch.setattr(bisect, "step_time_reason", lambda rows: "the step time moved and the device's "
                        "kernel time did not (or was not sampled): a host-side change, followed on step time")  # fmt: skip
    with pytest.raises(AssertionError):
        test_the_step_time_reason_says_what_the_device_figure_did(stats.UNDECIDED, 0.0219, -0.004, 0.048,
                                                                  "moved by +2.19% but was not decided", "did not")  # fmt: skip


def test_bite_following_the_step_time_on_a_device_side_change(monkeypatch):
    order = dict(reversed(bisect.METRIC_ORDER.items()))
    monkeypatch.setattr(bisect, "METRIC_ORDER", order)
    with pytest.raises(AssertionError):
        test_the_bisect_follows_the_metric_that_moved({6: 1.05}, "device_compute_s")


# ---- --test: the first failing candidate, same search and skips -------------------------------------------


def run_tests(n: int, first_fail: int, skips: frozenset[int] = frozenset(), fail_good: bool = False):
    calls: list[int] = []

    def tester(i: int) -> tuple[bisect.Outcome, str]:
        calls.append(i)
        if i in skips:
            return "skip", "ERROR collecting tests/test_x.py"
        return ("bad", "1 failed") if i >= first_fail or (fail_good and i == 0) else ("good", "1 passed")

    b = Bisection(setup_of(n, mode="test"), [])
    v = bisect.run(b, lambda step: bisect.test_probe(step, tester))
    return b, v, calls


def test_the_first_failing_candidate_is_found_with_the_same_search_and_skips():
    for first in (1, 7, 16):
        b, v, calls = run_tests(16, first)
        assert v.first_bad == (first,) and v.exit_code == 1
        assert calls[:2] == [16, 0] and len(calls) <= math.ceil(math.log2(16)) + 2
    b, v, calls = run_tests(16, 11, skips=frozenset({8}))
    assert v.first_bad == (11,) and 8 in calls and b.probes[2].outcome == "skip"
    b, v, _ = run_tests(16, 9, skips=frozenset({9}))
    assert v.status == "candidates" and v.first_bad == (9, 10)


def test_bite_a_test_bisect_that_takes_a_skip_for_a_pass(monkeypatch):
    real = bisect.test_probe

    def skip_passes(step, run_test):
        record = real(step, run_test)
        return record.model_copy(update={"outcome": "good"}) if record.outcome == "skip" else record

    monkeypatch.setattr(bisect, "test_probe", skip_passes)
    with pytest.raises(AssertionError):
        test_the_first_failing_candidate_is_found_with_the_same_search_and_skips()


def test_the_ends_of_a_test_bisect_must_hold():
    _, v, calls = run_tests(8, 99)  # passes everywhere
    assert v.status == "same" and v.exit_code == 0 and calls == [8]
    _, v, calls = run_tests(8, 5, fail_good=True)
    assert v.status == "ends" and v.exit_code == 2 and "fails at the good end" in v.message


# ---- resumable: the state file, validated, and no probe done twice ----------------------------------------


class Killed(Exception):
    """Stands for the process being killed between two probes."""


def test_a_killed_bisect_resumes_without_redoing_its_probes(tmp_path):
    state = tmp_path / bisect.STATE_FILE
    history = History(16, {11: 1.10}, 21)
    b = Bisection(setup_of(16), [])
    compare = history.compare(b)

    def dies_after_three(step):
        if len(b.probes) == 3:
            raise Killed
        return bisect.compare_probe(b, step, compare)

    with pytest.raises(Killed):
        bisect.run(b, dies_after_three, state_path=state)
    done = list(history.comparisons)
    assert len(done) == 3 and len(json.loads(state.read_text())["probes"]) == 3

    again = bisect.resume(state, setup_of(16))
    assert again.probes == b.probes
    v = bisect.run(
        again, lambda step: bisect.compare_probe(again, step, history.compare(again)), state_path=state
    )
    rest = history.comparisons[3:]
    assert v.first_bad == (11,) and not set(done) & set(rest), (done, rest)
    assert len(json.loads(state.read_text())["probes"]) == len(done) + len(rest) <= 6


def test_bite_a_resume_that_forgets_the_state_redoes_probes(monkeypatch, tmp_path):
    monkeypatch.setattr(
        bisect,
        "load_state",
        lambda path: bisect.State.model_validate(
            {"schema": bisect.STATE_SCHEMA, "setup": setup_of(16), "probes": []}
        ),
    )
    with pytest.raises(AssertionError):
        test_a_killed_bisect_resumes_without_redoing_its_probes(tmp_path)


class _Payload:
    """Unpickling this creates the file it names: a state file read by pickle would run it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.touch, (self.marker,))


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"{not json", "json"),
        (b"\xff\xfe garbage", "json"),
        (json.dumps({"schema": "distbench.result/1", "id": "x"}).encode(), "schema"),
        ("pickle", "json"),
        ("wrong-type", "probes.0.head"),
    ],
    ids=["not-json", "not-utf8", "a-result-file", "a-pickle", "a-wrong-type"],
)
def test_a_damaged_or_foreign_state_file_is_refused_in_one_line(tmp_path, content, says):
    state = tmp_path / bisect.STATE_FILE
    marker = tmp_path / "payload-ran"
    if content == "pickle":
        content = pickle.dumps(_Payload(marker))
    elif content == "wrong-type":
        good = {"schema": bisect.STATE_SCHEMA, "setup": setup_of(4).model_dump(mode="json")}
        probe = {"kind": "confirm", "base": 0, "head": "4", "outcome": "bad"}
        content = json.dumps({**good, "probes": [probe]}).encode()
    state.write_bytes(content)
    with pytest.raises(StateFileError) as e:
        bisect.resume(state, setup_of(4))
    message = str(e.value)
    assert str(state) in message and says in message.lower() and "\n" not in message
    assert not marker.exists()


def test_a_state_file_of_another_bisect_is_refused_naming_what_differs(tmp_path):
    state = tmp_path / bisect.STATE_FILE
    b = Bisection(setup_of(4), [])
    bisect.save_state(state, b)
    with pytest.raises(
        StateFileError,
        match=r"another bisect \(rule.threshold differs: 0.02 there, 0.05 here\)",
    ):
        bisect.resume(state, setup_of(4, threshold=0.05))
    with pytest.raises(StateFileError, match="candidates differs"):
        bisect.resume(state, setup_of(5))


def test_the_report_lists_every_probe_with_its_cost_interval_and_verdict(tmp_path):
    from distbench.report import bisect as render

    b, v = bisect_sim(History(16, {11: 1.10}, 5, broken=frozenset({8})), 16)
    md, js = render.to_markdown(b, v), render.to_json(b, v)
    assert md.startswith("## distbench bisect: the first bad one is 11/16 rev11 (exit 1)")
    assert "Bisecting on step_time_s" in md and "accounts for the bad end's slowdown" in md
    table = [ln for ln in md.splitlines() if ln.startswith("| ") and not ln.startswith("| #")]
    assert len(table) == len(b.probes) == len(js["probes"])
    for probe, line in zip(js["probes"], table, strict=True):
        assert probe["pairs"] == int(line.split("|")[5]) and probe["candidate"] in line
        if probe["outcome"] != "skip":
            row = next(r for r in probe["rows"] if r["metric"] == "step_time_s")
            assert f"[{row['low']:+.2%}, {row['high']:+.2%}] {row['verdict'].upper()}" in line
    assert js["first_bad"] == ["rev11"] and js["last_good"] == "rev10" and js["remainder"] == "good"
    skip = next(p for p in b.probes if p.outcome == "skip")
    line = render.probe_line(b, skip)
    assert line.startswith(f"probe {b.probes.index(skip) + 1} (search): 8/16 rev8 against 0/16 rev0: ")
    assert "skipped: it could not be run; 0 pairs" in line and "did not start" in line
    assert js["alpha_spent"] == pytest.approx(b.probe_alpha * comparisons(b))


# ---- bad input: one line, exit 2, before anything runs ----------------------------------------------------


@pytest.fixture(scope="module")
def history(tmp_path_factory) -> tuple[Path, list[str]]:
    from bisect_history import build_history

    repo = tmp_path_factory.mktemp("bisect") / "repo"
    return repo, build_history(repo, 2)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--variants", "{v}", "--good", "HEAD~1"], "--variants replaces --good"),
        ([], "give --good REV"),
        (["--good", "no-such-rev"], "--good no-such-rev is not a commit of"),
        (["--good", "HEAD", "--bad", "HEAD~1"], "is not an ancestor of --bad HEAD~1"),
        (["--good", "HEAD"], "HEAD..HEAD holds no revision"),
        (["--good", "HEAD~1", "--repo", "{tmp}"], "is not in a git repository"),
        (["--variants", "{bad}"], ":3: variant line 3: unknown item 'colour'"),
        (["--variants", "{one}"], "needs at least two variants"),
        (["--good", "HEAD~1", "-s", "ddp,fsdp_grad"], "bisect follows one configuration"),
        (["--good", "HEAD~1", "--min-pairs", "2"], "need 3 <= --min-pairs"),
        (["--good", "HEAD~1", "--state"], "damaged distbench.bisect-state/1 file (probes.0.head"),
    ],
    ids=lambda x: x if isinstance(x, str) else None,
)
def test_bad_input_is_refused_in_one_line(history, tmp_path, monkeypatch, capsys, args, says):
    from distbench.cli import main

    repo, _ = history
    files = {"v": "path=.\npath=.\n", "bad": "path=.\n\ncolour=red\n", "one": "# one\npath=.\n"}
    for name, text in files.items():
        (tmp_path / f"{name}.txt").write_text(text)
    out = tmp_path / "out"
    if "--state" in args:
        args = [a for a in args if a != "--state"]
        good = {"schema": bisect.STATE_SCHEMA, "setup": setup_of(2).model_dump(mode="json")}
        probe = {"kind": "confirm", "base": 0, "head": "2", "outcome": "bad"}
        out.mkdir()
        (out / bisect.STATE_FILE).write_text(json.dumps({**good, "probes": [probe]}))
    args = [
        a.format(v=tmp_path / "v.txt", bad=tmp_path / "bad.txt", one=tmp_path / "one.txt", tmp=tmp_path)
        for a in args
    ]
    monkeypatch.chdir(repo)
    assert main(["bisect", "--device", "cpu", "-o", str(out), *args]) == 2
    printed = capsys.readouterr().out.strip()
    assert printed.startswith("error:") and says in " ".join(printed.split()), printed


def test_a_revision_whose_build_fails_cannot_start_and_every_checkout_goes(history, tmp_path):
    """--build runs in each revision's own worktree; one that fails makes its candidate a skip (its
    variant does not start), the others run from their worktree, and close() removes them all."""
    from distbench.gate.history import Checkouts, from_git

    repo, ids = history
    hist = from_git(repo, ids[0], ids[2])
    assert hist.kind == "user" and [c.spec for c in hist.candidates] == ids
    fails_at_1 = (
        "import pathlib, sys; sys.exit(3 * ('revision 1' in pathlib.Path('sleepy/model.py').read_text()))"
    )
    co = Checkouts(hist, tmp_path / "checkouts", tmp_path / "logs", [sys.executable, "-c", fails_at_1])
    try:
        good = co.variant(0, "base")
        assert good.path == (str(tmp_path / "checkouts" / "candidate-0"),) and good.tree is None
        assert "revision 0" in (Path(good.path[0]) / "sleepy" / "model.py").read_text()
        with pytest.raises(VariantStartError, match=r"1/?.* does not build: `.* -c .*` exited 3") as e:
            co.variant(1, "head")
        assert e.value.label == "head" and (tmp_path / "logs" / "build-1.log").exists()
    finally:
        co.close()
    assert not any((tmp_path / "checkouts").iterdir())
    listed = subprocess.run(["git", "worktree", "list"], cwd=repo, capture_output=True, text=True).stdout
    assert len(listed.splitlines()) == 1


def test_distbench_s_own_history_runs_each_revision_s_own_src_and_a_rev_line_is_checked_out_once(
    tmp_path, monkeypatch
):
    """A repository whose bad revision holds src/distbench is distbench's own history: its revisions are
    tree= variants. A rev= line of a variants file is checked out once, from the repository around here."""
    from bisect_history import git
    from distbench.gate.history import Checkouts, from_file, from_git

    repo = tmp_path / "repo"
    (repo / "src" / "distbench").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    for i in range(3):
        (repo / "src" / "distbench" / "__init__.py").write_text(f"REVISION = {i}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "-m", f"revision {i}")
    hist = from_git(repo, "HEAD~2", "HEAD")
    assert hist.kind == "distbench" and hist.source.startswith("revisions of distbench")
    co = Checkouts(hist, tmp_path / "checkouts", tmp_path / "logs")
    try:
        v = co.variant(1, "head")
        assert v.tree == str(tmp_path / "checkouts" / "candidate-1") and v.path == () and v.label == "head"
        assert "REVISION = 1" in (Path(v.tree) / "src" / "distbench" / "__init__.py").read_text()
    finally:
        co.close()
    lines = tmp_path / "lines.txt"
    lines.write_text("rev=HEAD~2\nrev=HEAD,env.X=1\n")
    monkeypatch.chdir(repo)
    co = Checkouts(from_file(lines), tmp_path / "lines", tmp_path / "logs")
    try:
        v = co.variant(1, "base")
        assert v.rev is None and v.env == {"X": "1"} and v.tree == str(tmp_path / "lines" / "candidate-1")
        assert co.variant(1, "head").tree == v.tree  # once
    finally:
        co.close()


# ---- the command's path from its flags to each comparison -------------------------------------------------


def test_the_command_line_s_threshold_is_the_one_every_probe_s_comparison_runs_with(
    history, tmp_path, monkeypatch
):
    """`distbench bisect --threshold 0.05` over two commits, the first making the step 3% slower: through the
    command's own path (the candidates' worktrees, each probe's flags, `distbench ab`'s alternate) run_ab is
    given 0.05 for the confirm and the remainder, half the bad end's 3% for the search, and each probe's share
    of the bisect's alpha; bisect.json records the same. Only the variants' servers and run_ab stand in."""
    from distbench.cli import main

    repo, ids = history
    given_to_run_ab = []

    class Server:
        protocol = 2

        def __init__(self, variant, workdir, device, log_dir):
            self.candidate = int(Path(variant.path[0]).name.removeprefix("candidate-"))

        def run(self, cfg, timeout):
            return {"status": "ok", "candidate": self.candidate}

        def start(self): ...
        def recycle(self): ...
        def close(self): ...
        def remove_checkout(self): ...

    def run_ab(configs, run_base, run_head, *, threshold, alpha, **_):
        given_to_run_ab.append((threshold, alpha))
        base, head = (run(configs[0])["candidate"] for run in (run_base, run_head))
        slower = 0.03 * ((head >= 1) - (base >= 1))
        effect = (slower, slower - 0.004, slower + 0.004)
        verdict = stats.verdict(effect_of(effect, alpha), -1, threshold=threshold, min_effect=0.01)
        return ab_report("step_time_s", verdict, effect, alpha=alpha, threshold=threshold)

    monkeypatch.setattr("distbench.gate.variants.VariantProcess", Server)
    monkeypatch.setattr("distbench.gate.ab.run_ab", run_ab)
    monkeypatch.chdir(repo)
    out = tmp_path / "out"
    flags = ["--device", "cpu", "-s", "single", "-n", "1", "--threshold", "0.05", "--min-effect", "0.01"]
    assert main(["bisect", *flags, "--good", ids[0], "-o", str(out)]) == 1
    share = 0.05 / 3  # the bisect's alpha over ceil(log2 2) + 2 planned comparisons
    expected = [(0.05, share), (0.015, share), (0.05, share)]
    assert [pytest.approx(pair) for pair in given_to_run_ab] == expected  # approx() takes no nested lists
    probes = json.loads((out / "bisect.json").read_text())["probes"]
    assert [(p["kind"], p["threshold"]) for p in probes] == [
        ("confirm", 0.05),
        ("search", 0.015),
        ("remainder", 0.05),
    ]


# ---- what a test-mode run counts as good: a node that did not run is not a pass ----------------------------


@pytest.mark.parametrize(
    ("rc", "output", "outcome"),
    [
        (0, "1 passed in 6.04s", "good"),
        (1, "E   assert 1 == 2\n=== short test summary info ===\n1 failed in 2.72s", "bad"),
        (0, "1 skipped in 4.06s", "skip"),
        (0, "1 xfailed in 3.46s", "skip"),
        (1, "E       ImportError: No module named 'x'\n1 error in 4.01s", "skip"),  # a fixture's error
        (2, "E   ModuleNotFoundError: No module named 'y'\nInterrupted: 1 error\n1 error in 1.6s", "skip"),
        (1, "/usr/bin/python: No module named pytest", "skip"),  # a candidate without pytest
        (4, "ERROR: not found: tests/test_a.py::nope", "skip"),
        (None, "", "skip"),  # killed at the timeout
        (0, "1 passed, 1 error in 0.3s", "skip"),  # a teardown's error: the node did not pass cleanly
        (0, "1 passed, 2 errors in 0.3s", "skip"),
    ],
    ids=[
        "passed",
        "failed",
        "skipped",
        "xfailed",
        "fixture-error",
        "collection-error",
        "no-pytest",
        "not-found",
        "timeout",
        "passed-with-an-error",
        "passed-with-errors",
    ],
)
def test_what_pytest_printed_at_a_candidate_is_judged_as_it_ran(rc, output, outcome):
    from distbench.gate.history import node_outcome

    assert node_outcome(rc, output)[0] == outcome


# ---- bisect's words ---------------------------------------------------------------------------------------


def test_an_undecided_bisect_over_two_regressions_says_more_than_one_change_may_lie_there():
    """Two 10% slowdowns (3 and 12 of 16) at a 2% spread: a probe near the first stays undecided at its cap.
    The range narrowed (after 0, up to 4) holds only the first; the bad end's +21% lies past the interval of
    4's own slowdown, so the summary says a further change may lie after it. One slowdown says nothing so."""
    b, v = bisect_sim(History(16, {3: 1.10, 12: 1.10}, 0, run_sd=0.02), 16)
    assert v.status == "undecided" and (v.lo, v.hi) == (0, 4) and not v.first_bad
    assert (
        "no culprit named; more than one change may lie in the history: bad is +21.1% against good on "
        in (v.message)
    )
    assert "past 4/16 rev4's +8.7% [+4.0%, +13.7%], so a further change may lie after it" in v.message
    b, v = bisect_sim(History(16, {5: 1.10}, 0, run_sd=0.02), 16)
    assert v.status == "undecided" and "the first change lies after 0/16 rev0, up to 8/16 rev8" in v.message
    assert "more than one" not in v.message


def test_a_comparison_in_which_nothing_ran_is_not_headed_as_one():
    """The sub-report (ab.md) of a probe whose head never ran is headed by its error, not by a verdict."""
    from distbench.report import gate as render

    h = History(2, {}, 0, crashes=frozenset({1}))
    b = Bisection(setup_of(2), [])
    report = h.compare(b)(Step("search", 0, 1), gate=None, alpha=0.05, threshold=0.02)
    md = render.to_markdown(report)
    assert md.startswith(
        "## distbench ab: NOT COMPARED: head run failed (error): distbench.errors.ConfigError: model factory"
    )
    assert "UNDECIDED" not in md and "No module named 'sleepy_missing_module' (exit 3); " in md


# ---- a killed bisect's worktrees go at the next bisect command ---------------------------------------------


@pytest.mark.parametrize(
    "command", [["--cleanup"], ["--good", "no-such-rev"]], ids=["cleanup", "usage-error"]
)
def test_a_killed_bisect_s_worktrees_are_removed_by_the_next_bisect_command(
    history, tmp_path, monkeypatch, command
):
    """A bisect killed after checking two candidates out leaves their worktrees; the next `distbench bisect`,
    with --cleanup or with flags that fail (a usage error), removes them, and leaves a running bisect's."""
    from distbench.cli import main
    from distbench.gate.history import Checkouts, from_git

    repo, ids = history
    hist = from_git(repo, ids[0], ids[2])
    pid = os.fork()  # the killed bisect: a copy of this process, killed once it checked two candidates out
    if pid == 0:
        try:
            killed = Checkouts(hist, tmp_path / "killed", tmp_path / "logs")
            killed.variant(1, "head")
            killed.variant(2, "head")
        finally:
            os.kill(os.getpid(), signal.SIGKILL)
    assert os.waitpid(pid, 0)[1] == signal.SIGKILL
    running = Checkouts(hist, tmp_path / "running", tmp_path / "logs")
    try:
        running.variant(0, "base")
        assert len(worktrees(repo)) == 4  # the repository's own, two of the killed bisect's, one running
        monkeypatch.chdir(repo)
        assert main(["bisect", *command]) == (0 if command == ["--cleanup"] else 2)
        assert worktrees(repo) == [str(repo), str(tmp_path / "running" / "candidate-0")]
        assert not (tmp_path / "killed" / "candidate-1").exists()
    finally:
        running.close()


def worktrees(repo: Path) -> list[str]:
    listed = subprocess.run(
        ["git", "worktree", "list", "--porcelain"], cwd=repo, capture_output=True, text=True
    )
    return [line.split(" ", 1)[1] for line in listed.stdout.splitlines() if line.startswith("worktree ")]


# ---- what a bisect walks: the candidates of a git history or a variants file -----------------------------


def test_a_git_history_s_candidates_are_the_good_end_then_each_first_parent_revision_labelled_by_subject(
    tmp_path, capfd
):
    """from_git, given any folder of the repository, reads the repository at its top: GOOD, then each revision
    up to BAD, each labelled by its short id and subject (a revision without a subject, the bad end's too, by
    its id alone), printing nothing of git's own. A repository that is not distbench runs on this distbench's
    PYTHONPATH, its worktree and its src/ both, under the label asked for."""
    from bisect_history import git
    from distbench.gate.history import Checkouts, from_git

    repo = tmp_path / "repo"
    (repo / "src" / "pkg").mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    for i, subject in enumerate(["before", "the good end", "", "two words", ""]):
        (repo / "src" / "pkg" / "__init__.py").write_text(f"REVISION = {i}\n")
        git(repo, "add", "-A")
        git(repo, "commit", "-q", "--allow-empty-message", "-m", subject)
    ids = [git(repo, "rev-parse", f"HEAD~{k}") for k in (3, 2, 1, 0)]
    capfd.readouterr()
    hist = from_git(repo / "src", "HEAD~3", "HEAD")
    assert capfd.readouterr() == ("", "")
    assert [c.spec for c in hist.candidates] == ids
    assert [c.label for c in hist.candidates] == [
        f"{ids[0][:10]} the good end",
        ids[1][:10],
        f"{ids[2][:10]} two words",
        ids[3][:10],
    ]
    assert (hist.kind, hist.repo) == ("user", repo)
    assert hist.source == "revisions of repo (on PYTHONPATH of this distbench)"
    co = Checkouts(hist, tmp_path / "checkouts", tmp_path / "logs")
    try:
        tree = tmp_path / "checkouts" / "candidate-1"
        v = co.variant(1, "head")
        assert (v.label, v.path, v.tree) == ("head", (str(tree), str(tree / "src")), None)
    finally:
        co.close()


def test_a_merge_is_one_step_of_the_history(tmp_path):
    """Only the first-parent line is walked: a branch merged into main is one candidate, the merge, not each of
    the branch's commits."""
    from bisect_history import git
    from distbench.gate.history import from_git

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "good")
    git(repo, "checkout", "-q", "-b", "side")
    git(repo, "commit", "-q", "--allow-empty", "-m", "on the side")
    git(repo, "checkout", "-q", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "on main")
    git(repo, "merge", "-q", "--no-ff", "-m", "the merge", "side")
    hist = from_git(repo, "HEAD~2", "HEAD")
    assert [c.label.split(" ", 1)[1] for c in hist.candidates] == ["good", "on main", "the merge"]


def test_a_history_that_cannot_be_bisected_is_refused_naming_what_is_wrong(tmp_path):
    """A --repo that is not a folder, and a --bad that is not a commit, are refused in words that name them."""
    from bisect_history import git
    from distbench.gate.history import from_git

    with pytest.raises(ConfigError, match=r"^--repo .*missing is not a directory$"):
        from_git(tmp_path / "missing", "HEAD~1", "HEAD")
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    with pytest.raises(ConfigError, match=rf"^--bad nope is not a commit of {repo}$"):
        from_git(repo, "HEAD", "nope")


def test_a_variants_file_s_candidates_are_its_lines_less_comments_and_blanks(tmp_path):
    """--variants: one candidate a line, in order, what follows a line's first `#` and blank lines left out,
    each labelled by its spec and run under the label asked for; the source names the file. An unreadable file
    is refused naming it."""
    from distbench.gate.history import Checkouts, from_file

    (tmp_path / "a").mkdir()
    lines = tmp_path / "lines.txt"
    lines.write_text(
        f"# good first\npath={tmp_path}  # the good end # a note\n\n   \nenv.X=1\npath={tmp_path / 'a'}\n"
    )
    hist = from_file(lines)
    specs = [f"path={tmp_path}", "env.X=1", f"path={tmp_path / 'a'}"]
    assert [(c.spec, c.label) for c in hist.candidates] == [(s, s) for s in specs]
    assert (hist.kind, hist.source, hist.repo) == ("variants", "variants of lines.txt", None)
    v = Checkouts(hist, tmp_path / "checkouts", tmp_path / "logs").variant(1, "head")
    assert (v.label, v.env) == ("head", {"X": "1"})
    lines.write_bytes(b"path=.\n\xff\n")
    with pytest.raises(ConfigError, match=r"^cannot read --variants .*lines\.txt: 'utf-8' codec"):
        from_file(lines)
    with pytest.raises(ConfigError, match=r"^cannot read --variants .*nowhere\.txt: \[Errno 2\]"):
        from_file(tmp_path / "nowhere.txt")


def test_a_variants_file_is_read_as_utf_8_whatever_the_locale(tmp_path, ascii_locale):
    """The file's bytes are UTF-8 under any locale: an environment value of `café` reads as written where the
    locale's own encoding is ASCII."""
    from distbench.gate.history import from_file

    lines = tmp_path / "lines.txt"
    lines.write_bytes("env.X=caf\u00e9\nenv.X=2\n".encode())
    assert from_file(lines).candidates[0].spec == "env.X=caf\u00e9"


def test_a_bisect_forgets_the_worktrees_whose_folders_are_gone(history, tmp_path):
    """Checkouts prunes its repository first: an (unlocked) worktree whose folder was deleted is no longer
    listed, so its path can be checked out again."""
    from distbench.gate.history import Checkouts, from_git

    repo, ids = history
    gone = tmp_path / "gone"
    subprocess.run(
        ["git", "worktree", "add", "--detach", str(gone), ids[0]], cwd=repo, check=True, capture_output=True
    )
    shutil.rmtree(gone)
    assert str(gone) in worktrees(repo)
    Checkouts(from_git(repo, ids[0], ids[2]), tmp_path / "checkouts", tmp_path / "logs").close()
    assert str(gone) not in worktrees(repo)


# ---- how a candidate's processes run ----------------------------------------------------------------------


def _state_of(pid: int) -> str:
    """A process's state letter, "gone" once it was reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def test_a_logged_run_gives_its_exit_status_and_last_line_and_leaves_nothing_of_its_group_running(tmp_path):
    """run_logged runs the command in the folder and environment given, with no input (here its stdin is a
    pipe nobody writes), its output to the log (its folders made); it answers the exit status and the last
    line printed (undecodable bytes replaced, trailing blank lines dropped), and kills whatever the command
    left running in its process group."""
    from distbench.gate.history import run_logged

    script = (
        "import os, subprocess, sys\n"
        "child = subprocess.Popen(['sleep', '30'])\n"
        "open('child.pid', 'w').write(str(child.pid))\n"
        "print(os.getcwd(), os.environ['WHO'], repr(sys.stdin.read()), flush=True)\n"
        "print('to stderr', file=sys.stderr, flush=True)\n"
        "sys.stdout.buffer.write(b'last \\xff\\n\\n')\n"
        "sys.exit(5)\n"
    )
    log = tmp_path / "logs" / "deeper" / "run.log"
    read, write = os.pipe()
    stdin = os.dup(0)
    os.dup2(read, 0)
    try:
        rc, tail = run_logged(
            [sys.executable, "-c", script], tmp_path, {**os.environ, "WHO": "me"}, 20.0, log
        )
    finally:
        os.dup2(stdin, 0)
        for fd in (stdin, read, write):
            os.close(fd)
    child = int((tmp_path / "child.pid").read_text())
    try:
        assert (rc, tail) == (5, "last \N{REPLACEMENT CHARACTER}")
        assert log.read_bytes().startswith(f"{tmp_path} me ''\nto stderr\n".encode())
        for _ in range(200):
            if _state_of(child) in ("Z", "gone"):
                break
            time.sleep(0.01)
        assert _state_of(child) in ("Z", "gone"), "the command's child outlived it"
    finally:
        if _state_of(child) not in ("Z", "gone"):
            os.kill(child, signal.SIGKILL)
    assert run_logged(["true"], None, dict(os.environ), 20.0, log) == (0, "(no output)")  # the folder exists


def test_a_run_past_its_timeout_is_killed_and_answers_none(tmp_path):
    """A command still running at the timeout is killed with its group; its exit status is None."""
    from distbench.gate.history import run_logged

    start = time.monotonic()
    rc, tail = run_logged(
        ["sh", "-c", "echo started; exec sleep 30"], None, dict(os.environ), 0.5, tmp_path / "l"
    )
    assert (rc, tail) == (None, "started") and time.monotonic() - start < 10


FAKE_PYTEST = """#!/bin/sh
# stands in for a candidate's interpreter running pytest: records what it was given, prints as pytest would
printf '%s\\n' "$@" > argv.txt
printf '%s\\n' "$PYTHONPATH" > pythonpath.txt
printf '%s\\n' "$WHO" > who.txt
case "$9" in
  *::passes) echo "t.py ."; echo "1 passed in 0.01s" ;;
  *::fails) echo "E   assert 1 == 2"; echo "1 failed in 0.01s"; exit 1 ;;
  *::skips) echo "1 skipped in 0.01s" ;;
  *::missing) echo "ERROR: not found: $9"; exit 4 ;;
  *::hangs) exec sleep 30 ;;
  *::undecodable) printf 'captured \\377\\n1 passed in 0.01s\\n' ;;
esac
"""


def test_a_node_runs_from_the_candidate_s_checkout_with_its_code_first_on_pythonpath(tmp_path, monkeypatch):
    """run_test runs `PYTHON -m pytest -q -x -p no:cacheprovider -m "" NODE` with the candidate's interpreter:
    a tree= candidate from its tree, its src/ first on PYTHONPATH; a path= candidate from its first path, its
    paths first; the variant's environment over this one's. It judges what was printed: a pass is good, a
    failure bad with pytest's error; a node that did not run is a skip saying why, with its log's name."""
    from distbench.gate.history import run_test
    from distbench.gate.variants import Variant

    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTEST)
    fake.chmod(0o755)
    tree, a, b = (tmp_path / name for name in ("tree", "a", "b"))
    for folder in (tree, a, b):
        folder.mkdir()
    monkeypatch.setenv("PYTHONPATH", "/outer")
    monkeypatch.setenv("WHO", "outer")
    head = Variant("head", python=str(fake), tree=str(tree), env={"WHO": "head"})
    assert run_test(head, "t.py::passes", 20.0, tmp_path / "p.log") == ("good", "1 passed in 0.01s")
    argv = (tree / "argv.txt").read_text().splitlines()
    assert argv == ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "", "t.py::passes"]
    assert (tree / "pythonpath.txt").read_text() == f"{tree / 'src'}{os.pathsep}/outer\n"
    assert (tree / "who.txt").read_text() == "head\n"
    monkeypatch.delenv("PYTHONPATH")
    user = Variant("base", python=str(fake), path=(str(a), str(b)))
    outcome = run_test(user, "t.py::fails", 20.0, tmp_path / "f.log")
    assert outcome == ("bad", "1 failed in 0.01s: assert 1 == 2")
    assert (a / "pythonpath.txt").read_text() == f"{a}{os.pathsep}{b}\n" and (
        a / "who.txt"
    ).read_text() == "outer\n"
    assert run_test(user, "t.py::skips", 20.0, tmp_path / "s.log") == (
        "skip",
        "t.py::skips: nothing ran (skipped, deselected or xfailed): 1 skipped in 0.01s (log: s.log)",
    )
    assert run_test(user, "t.py::missing", 20.0, tmp_path / "m.log") == (
        "skip",
        "t.py::missing: exited 4: ERROR: not found: t.py::missing (log: m.log)",
    )
    assert run_test(user, "t.py::hangs", 0.6, tmp_path / "h.log") == (
        "skip",
        "t.py::hangs: timed out after 1 s: (no output) (log: h.log)",
    )
    assert run_test(user, "t.py::undecodable", 20.0, tmp_path / "u.log") == ("good", "1 passed in 0.01s")
    here = tmp_path / "here"
    here.mkdir()
    monkeypatch.chdir(here)  # a candidate of this checkout, neither tree nor path: from where the bisect runs
    assert run_test(Variant("x", python=str(fake)), "t.py::passes", 20.0, tmp_path / "x.log")[0] == "good"
    assert (here / "pythonpath.txt").read_text() == "\n"


def test_a_process_is_running_until_it_has_ended_and_asking_sends_it_nothing():
    """_running: a live process runs, and is left as it was (the question is signal 0: a SIGHUP would end this
    one); one that exited and was reaped does not run."""
    from distbench.gate.history import _running

    hup = (
        "import signal, time; signal.signal(signal.SIGHUP, signal.SIG_DFL); print(flush=True); time.sleep(30)"
    )
    live = subprocess.Popen([sys.executable, "-c", hup], stdout=subprocess.PIPE)
    try:
        live.stdout.readline()  # its SIGHUP handler is the default one
        assert _running(live.pid)
        time.sleep(0.05)
        assert live.poll() is None
    finally:
        live.kill()
        live.wait()
    ended = subprocess.Popen(["true"])
    ended.wait()
    assert _running(os.getpid()) and not _running(ended.pid)


def test_a_build_past_the_timeout_makes_its_revision_a_skip_saying_so(history, tmp_path):
    """--build is held to the checkouts' timeout: a build still running then is killed, and its revision does
    not start, said to have timed out."""
    from distbench.gate.history import Checkouts, from_git

    repo, ids = history
    hangs = [sys.executable, "-c", "import time; time.sleep(30)"]
    co = Checkouts(from_git(repo, ids[0], ids[2]), tmp_path / "co", tmp_path / "logs", hangs, timeout=0.6)
    try:
        start = time.monotonic()
        with pytest.raises(
            VariantStartError, match=r"does not build: `.* -c .*` timed out after 1 s: \(no output\)"
        ):
            co.variant(1, "head")
        assert time.monotonic() - start < 20
    finally:
        co.close()


def test_only_the_worktrees_of_bisects_of_this_host_whose_process_is_gone_are_removed(tmp_path, monkeypatch):
    """remove_abandoned(repo), from any working directory: of the worktrees locked by a bisect (the lock names
    its process and host), those of this host whose process has ended go, and are listed; a running bisect's,
    another host's, one locked for another reason and an unlocked one stay."""
    import socket

    from bisect_history import git
    from distbench.gate.history import OWNER, remove_abandoned

    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q", "-b", "main")
    git(repo, "commit", "-q", "--allow-empty", "-m", "one")
    ended = subprocess.Popen(["true"])
    ended.wait()
    host = socket.gethostname()
    locks = {
        "ended": OWNER.format(pid=ended.pid, host=host),
        "running": OWNER.format(pid=os.getpid(), host=host),
        "elsewhere": OWNER.format(pid=ended.pid, host=host + "-other"),
        "foreign": "kept by hand",
        "unlocked": None,
    }
    for name, lock in locks.items():
        locked = ["--lock", "--reason", lock] if lock else []
        git(repo, "worktree", "add", "-q", "--detach", *locked, str(tmp_path / name), "HEAD")
    monkeypatch.chdir(tmp_path)
    assert remove_abandoned(repo) == [str(tmp_path / "ended")]
    assert sorted(worktrees(repo)) == sorted([str(repo)] + [str(tmp_path / n) for n in locks if n != "ended"])
    assert not (tmp_path / "ended").exists()
