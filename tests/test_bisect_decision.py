"""bisect's decision as a state machine, over generated histories (hypothesis): each history says what every
comparison (or test run) a bisect may ask for answers, anything at any node, the ends included, and each
test states in words the properties that hold of every one. The same examples every run (the `ci` profile,
tests/properties.py), so a failure reproduces from its log alone. Its realistic histories and whole-process runs are in
tests/test_bisect.py and tests/test_bisect_e2e.py."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st

from distbench.gate import bisect, stats  # noqa: E402
from distbench.gate.bisect import Bisection  # noqa: E402
from distbench.gate.variants import VariantStartError  # noqa: E402
from properties import cases  # noqa: E402
from test_bisect import ab_report, setup_of  # noqa: E402

PROPERTIES = cases(150)


@dataclass(frozen=True)
class World:
    """What each probe answers. search[m]: the midpoint m against the good end, "good", "bad" or "undecided"
    (the gate's verdict), "head" (m cannot run) or "base" (the good end cannot run beside it); `confirm` and
    `remainder` likewise, "base" or "head" the side that cannot run (before its first pair, or at it). In a
    test bisect, `ends` are the node's outcomes at the ends and search[m] "good", "bad" or "skip". `first` is
    the first bad candidate where every answer that decided follows one step (None where they do not)."""

    n: int
    search: dict[int, str]
    confirm: str = "bad"
    remainder: str = "good"
    ends: tuple[str, str] = ("good", "bad")
    slowdown: float = 0.1  # the bad end's against good: the confirm's estimate
    share: float = 1.0  # the part of it a bad midpoint carries
    width: float = 0.01  # every interval's half width
    start: bool = True  # a side that cannot run fails to start (VariantStartError), else its first run fails
    first: int | None = None


#: What a probe of a midpoint meets, in a performance bisect and in a test bisect: "ran" (the answer of the
#: history's step), or an answer of its own (which breaks the step, unless the history keeps to one).
MIDPOINTS = {
    "perf": st.sampled_from(("ran", "ran", "ran", "good", "bad", "head", "undecided", "base")),
    "test": st.sampled_from(("ran", "ran", "ran", "good", "bad", "skip")),
}
ANSWERS = ("bad", "good", "undecided", "base", "head")
CONFIRMS, REMAINDERS = st.sampled_from(("bad",) * 4 + ANSWERS), st.sampled_from(ANSWERS)
GOOD_ENDS = st.sampled_from(("good", "good", "good", "bad", "skip"))
BAD_ENDS = st.sampled_from(("bad", "bad", "bad", "good", "skip"))


@st.composite
def worlds(draw, mode: str = "perf") -> World:
    n = draw(st.integers(2, 24))
    first = draw(st.integers(1, n))
    one_step = draw(st.booleans())
    search = {}
    for m, met in enumerate(draw(st.lists(MIDPOINTS[mode], min_size=n - 1, max_size=n - 1)), 1):
        step = "bad" if m >= first else "good"
        search[m] = step if met == "ran" or (one_step and met in ("good", "bad")) else met
    first_bad = first if one_step else None
    if mode == "test":
        return World(n, search, ends=(draw(GOOD_ENDS), draw(BAD_ENDS)), first=first_bad)
    return World(
        n,
        search,
        confirm=draw(CONFIRMS),
        remainder=draw(REMAINDERS),
        slowdown=draw(st.floats(0.002, 0.5)),
        share=draw(st.floats(0.2, 1.0)),
        width=draw(st.floats(0.0005, 0.1)),
        start=draw(st.booleans()),
        first=first_bad,
    )


VERDICT_OF = {"good": stats.UNCHANGED, "bad": stats.REGRESSION, "undecided": stats.UNDECIDED}


def world_comparator(w: World, calls: list) -> bisect.Comparator:
    """Comparisons that answer as `w` says, each call kept: (step, gate, threshold)."""

    def compare(step, *, gate, alpha, threshold):
        calls.append((step, gate, threshold))
        answer = {"confirm": w.confirm, "remainder": w.remainder}.get(step.kind) or w.search[step.head]
        d = w.slowdown
        estimate = {"confirm": d, "remainder": d * (1 - w.share)}.get(step.kind, d * w.share)
        estimate = 0.0 if answer == "good" else estimate
        effect = (estimate, estimate - w.width, estimate + w.width)
        if answer in ("base", "head"):
            if w.start:
                raise VariantStartError(answer, f"variant {answer} did not start: ImportError: no module x")
            error = f"{answer} run failed (error): ImportError: no module x"
            return ab_report(
                "step_time_s",
                stats.UNDECIDED,
                effect,
                alpha=alpha,
                threshold=threshold,
                error=error,
                failed=answer,
            )
        return ab_report("step_time_s", VERDICT_OF[answer], effect, alpha=alpha, threshold=threshold)

    return compare


def decided(b: Bisection, answer: str) -> set[int]:
    """The candidates whose own probe (a search's, or a test end's) ran and came out `answer`."""
    return {p.head for p in b.probes if p.kind in ("search", "end") and p.outcome == answer and not p.failed}


def check_a_named_culprit(b: Bisection, v: bisect.Verdict, w: World) -> None:
    """What holds of every verdict that names candidates, and of every range."""
    good, bad = decided(b, "good") | {0}, decided(b, "bad") | {b.n}
    assert v.lo in good and v.hi in bad, v  # the range runs from a known-good one to a known-bad one
    if v.first_bad:  # adjacent to a known-good one: only candidates that did not run lie between
        assert v.first_bad == tuple(range(v.lo + 1, v.hi + 1)), v
        assert all(w.search[m] in ("head", "skip") for m in v.first_bad[:-1]), v
        assert b.name(v.hi) in v.message, v.message
    if w.first is not None:  # the first change lies in the range, and among those named
        assert v.lo < w.first <= v.hi and (not v.first_bad or w.first in v.first_bad), (v, w.first)
    assert v.exit_code == (1 if v.first_bad else {"same": 0, "ends": 2, "undecided": 3}[v.status])


@PROPERTIES
@given(worlds(), st.floats(0.005, 0.2))
def test_a_performance_bisect_over_any_history_and_outcomes(w: World, threshold: float):
    """Over generated histories, where any comparison may come out good, bad or undecided, or find a side
    that cannot run, at the midpoints and at the ends:
    - it ends, within n + 2 comparisons, none asked twice;
    - a threshold given on the command line (the rule's) is the one every probe's comparison is given: the
      confirm's and the remainder's, that threshold; a search probe's, min(it, half the bad end's slowdown);
      and each record keeps the one its comparison was given;
    - a candidate that did not run is never counted good: its record is a skip (or, where the good end did
      not run beside it, undecided), and never the last good one of the range;
    - a named first bad candidate is adjacent to a known-good one (only candidates that did not run lie
      between), is itself known bad, and is the first change of a history whose answers follow one step;
    - an end that cannot run (either at the confirm, or the good end beside a midpoint) stops the bisect as
      "ends" (exit 2) naming no candidate, with the error;
    - a comparison that decided nothing spends no alpha;
    - the summary line names the first bad one and, where the remainder is slower still, a further
      regression after it."""
    calls: list = []
    b = Bisection(setup_of(w.n, threshold=threshold, min_effect=0.005), [])
    compare = world_comparator(w, calls)
    v = bisect.run(b, lambda step: bisect.compare_probe(b, step, compare))
    steps = [(p.kind, p.base, p.head) for p in b.probes]
    assert len(steps) == len(set(steps)) <= w.n + 2 and len(calls) == len(b.probes)
    for (step, _, given_threshold), p in zip(calls, b.probes, strict=True):
        wanted = min(threshold, w.slowdown / 2) if step.kind == "search" else threshold
        assert given_threshold == pytest.approx(wanted), (step, given_threshold, wanted)
        assert p.threshold == (None if p.failed else given_threshold)  # None: it decided nothing
        if p.failed:
            assert p.outcome in ("skip", "undecided") and p.alpha is None, p
    assert b.alpha_spent() == pytest.approx(b.probe_alpha * sum(not p.failed for p in b.probes))
    if w.confirm != "bad":
        assert len(b.probes) == 1 and not v.first_bad
        status = {"good": "same", "undecided": "undecided"}.get(w.confirm, "ends")
        assert v.status == status and (status != "ends" or "could not be run: " in v.message), v
        return
    if any(p.failed == "base" and p.kind == "search" for p in b.probes):
        assert v.status == "ends" and not v.first_bad and b.probes[-1].failed == "base", v
        assert "the good end 0/" in v.message and "no module x" in v.message
    check_a_named_culprit(b, v, w)
    rest = next((p for p in b.probes if p.kind == "remainder"), None)
    if rest is not None and rest.outcome == "bad":
        assert f"a further regression lies after {b.name(v.hi)}" in v.message


def node_runs(w: World):
    """The node's outcome at each candidate as `w` says, with what pytest printed of it."""

    def run_test(i: int) -> tuple[bisect.Outcome, str]:
        answer = {0: w.ends[0], w.n: w.ends[1]}.get(i) or w.search[i]
        return answer, {"good": "1 passed", "bad": "1 failed", "skip": "1 error: ImportError: no module x"}[
            answer
        ]

    return run_test


@PROPERTIES
@given(worlds("test"))
def test_a_test_bisect_over_any_history_and_outcomes(w: World):
    """Over generated histories, where the node passes, fails or cannot run (not collected, an error, a
    skip) at any candidate, the ends included:
    - the bad end, then the good end, are run first; a node that fails at the good end, or passes at the bad
      end, or cannot run at either, stops the bisect naming no candidate ("ends", exit 2, or "same", exit 0
      where it passes at the bad end), and one that cannot run says so with its error;
    - a candidate where the node did not run is never counted good (nor bad);
    - a named first bad candidate is adjacent to a known-good one, is itself known bad, and is the first
      failing one of a history that fails from one candidate on;
    - it ends within n + 1 runs, none twice."""
    b = Bisection(setup_of(w.n, mode="test"), [])
    v = bisect.run(b, lambda step: bisect.test_probe(step, node_runs(w)))
    heads = [p.head for p in b.probes]
    assert len(heads) == len(set(heads)) <= w.n + 1 and heads[:2] == [w.n, 0][: len(heads[:2])]
    assert all(p.outcome == "skip" for p in b.probes if p.failed)
    good_end, bad_end = w.ends
    if (good_end, bad_end) != ("good", "bad"):
        assert not v.first_bad and v.status == ("same" if bad_end == "good" else "ends"), v
        stopped_at = bad_end if bad_end != "bad" else good_end
        assert (stopped_at == "skip") == ("cannot run (1 error: ImportError: no module x)" in v.message), v
        return
    check_a_named_culprit(b, v, w)


SUMMARY_WORDS = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "errors", "warnings")


@PROPERTIES
@given(
    st.sampled_from((None, 0, 1, 2, 3, 4, 5, -9)),
    st.dictionaries(st.sampled_from(SUMMARY_WORDS), st.integers(1, 3)),
    st.booleans(),
)
def test_a_pytest_run_is_good_only_where_the_node_ran_and_passed(rc, counts, raised):
    """Whatever pytest's exit status (None: killed at the timeout) and summary line: the candidate is good
    only where the node ran and passed (exit 0, a count passed, none failed nor errored), bad only where it
    ran and failed (exit 1, a count failed); a node that did not run (skipped, deselected, xfailed, an error
    in collection or in a fixture, no pytest there) is a skip. What is said of it is one line, with the error
    pytest printed."""
    from distbench.gate.history import node_outcome

    said_as = {w: w.removesuffix("s") if k == 1 else w for w, k in counts.items()}  # "1 error", "2 errors"
    summary = ", ".join(f"{k} {said_as[w]}" for w, k in counts.items()) or "no tests ran"
    error = ["E   ModuleNotFoundError: No module named 'x'"] if raised else []
    outcome, said = node_outcome(rc, "\n".join(["tests/test_x.py F", *error, f"{summary} in 0.12s"]))
    passed, failed, errors = (counts.get(w, 0) for w in ("passed", "failed", "errors"))
    good = rc == 0 and passed and not failed and not errors
    assert outcome == ("good" if good else "bad" if rc == 1 and failed else "skip"), (outcome, said)
    assert "\n" not in said and said.startswith(summary) and raised == ("No module named 'x'" in said)
