"""Bisect: the first candidate whose performance matches the bad end rather than the good one, each step
decided by the A/B gate (gate/ab.py's run_ab, its intervals and verdicts), never by one measurement; or,
with a pytest node, the first candidate where that node fails.

Candidates 0..n are ordered: 0 is the good end, n the bad end (git revisions of GOOD..BAD, oldest first, or
the lines of a variants file: gate/history.py). The state of a bisect is its list of probes; what to probe
next is a function of that list (Bisection.next_step), so a bisect killed after k probes replays them from
its state file and goes on with probe k+1.

Performance probes, each one sequential interleaved comparison through run_ab:
1. confirm: bad against good, every gated metric, at the gate's threshold. REGRESSION: the search starts on
   the metric that moved (METRIC_ORDER: device compute time where the device's kernels moved, a device-side
   change judged free of the host's noise; else the step time, host-side; else host instructions; else peak
   memory). UNCHANGED or IMPROVEMENT: good and bad do not differ, nothing to find. UNDECIDED: stop.
2. search: the candidate m nearest the middle of the range against the good end, gating that one metric.
   m *matches the bad end* when the gate's verdict of m against good is REGRESSION: slower than good beyond
   its interval, by at least min_effect. m *matches the good end* when the verdict is UNCHANGED or
   IMPROVEMENT at the probe threshold t = min(threshold, D/2), D the confirm's estimate of the bad end's
   slowdown: the interval rules out that m is slower than good by half of what bad is, so m is nearer the
   good end, and a midpoint that carries the bad end's slowdown passes as good only when its own interval
   misses (at most alpha/2 of the probes). Half of D, not its interval's low end: a sequential comparison
   stops as soon as its interval leaves 0, where that low end is near 0 and would take good midpoints
   many times the confirm's pairs to place. So the first bad candidate is the first the gate would fail
   against the good end: with two regressions, the first. A probe still UNDECIDED at its cap (the gate's
   looks continued to max_pairs pairs or its time budget) stops the search: the report gives the range
   narrowed so far, every probe's interval, and no culprit.
   Against the good end alone: the question is whether m carries a slowdown relative to good. Asked
   through the bad end, m's answer carries the bad end's interval (the confirm's) on top of its own, so
   the same decision takes more pairs whichever way it goes; asking both ends costs two comparisons for
   one answer.
3. remainder: the first bad candidate against the bad end, at the gate's threshold. REGRESSION: the bad end
   is slower still, a second regression lies after the first (bisect again from it). Where it does not
   decide, or a probe stopped the search, the bad end's slowdown against good (the confirm's) past the
   interval of the first bad candidate's own says that more than one change may lie in the history. The
   outcome's summary line names every regression so found.

A candidate that cannot be run (it does not build, its server does not start, its runs fail: it does not
import) is skipped, as `git bisect skip` skips it: the next probe is the untested candidate nearest the
middle. When only skipped candidates lie between the last good and the first bad one, the first bad one is
any of them or that first bad one, and the outcome says so. An end that cannot be run is no skip: at the
confirm, or the good end beside a midpoint, the bisect stops as "ends" (exit 2) with its error, naming no
candidate. A candidate that did not run is never counted good.

Without skips the search takes ceil(log2 n) probes, so a bisect takes at most ceil(log2 n) + 2 comparisons.
The family-wise `alpha` of the whole bisect is split equally over those planned comparisons (Bonferroni):
each comparison is a run_ab with that share as its alpha, which it divides over its metrics and looks. A
probe past the plan (after skips) spends one more share, and the outcome counts what was spent.

With a pytest node (`--test`), a probe runs the node at one candidate: passed is good, failed is bad,
anything else (not collected, skipped, a collection error, a timeout) is a skip. The ends come first: the
node must fail at the bad end and pass at the good one.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ..errors import DistbenchError
from ..metrics import METRICS
from ..results import write_json_atomic
from . import ab, stats
from .ab import ABReport
from .variants import VariantStartError

STATE_SCHEMA = "distbench.bisect-state/1"
STATE_FILE = "bisect-state.json"

#: A probe's cap on pairs and seconds: twice the gate's (an undecided probe gets the gate's looks continued).
MAX_PAIRS = 2 * ab.MAX_PAIRS
BUDGET_S = 1200.0

#: The metric a bisect follows, first of these that the confirm found regressed, and why.
METRIC_ORDER: dict[str, str] = {
    "device_compute_s": "the device's kernel time moved: a device-side change, followed on device compute "
    "time, which the host's noise does not reach",
    "device_compute_floor_s": "the device's kernel time moved: a device-side change, followed on each "
    "kernel's least disturbed time, which neither the host's noise nor NCCL beside it reaches",
    "step_time_s": "the step time moved: followed on step time",
    "host_instructions": "the training thread's instructions moved and the step time did not: a host-side "
    "change, followed on instructions per step",
    "mem_allocated_peak_bytes": "peak memory moved and no time did: followed on peak allocated memory",
}

Outcome = Literal["good", "bad", "skip", "undecided"]
Kind = Literal["confirm", "search", "remainder", "end"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class Candidate(_Strict):
    """One point of the ordered history: `spec` says how to run it (a full commit id, or a variant line)."""

    spec: Annotated[str, Field(min_length=1)]
    label: str


class Rule(_Strict):
    """The gate's rule and schedule every comparison of a performance bisect runs with."""

    alpha: Annotated[float, Field(gt=0, lt=0.5)]  # family-wise, for the whole bisect
    threshold: Annotated[float, Field(gt=0, lt=1)]
    min_effect: Annotated[float, Field(gt=0, lt=1)]
    min_pairs: Annotated[int, Field(ge=stats.MIN_RUNS)]
    max_pairs: Annotated[int, Field(ge=stats.MIN_RUNS)]
    look_every: Annotated[int, Field(ge=1)]
    interleave: Literal["windows", "runs"]


class Setup(_Strict):
    """What identifies a bisect: a state file resumes only the bisect it was written for. A performance
    bisect has the configuration its probes run and their rule; a test bisect, the node."""

    mode: Literal["perf", "test"]
    source: str  # what the candidates are, in words
    candidates: Annotated[list[Candidate], Field(min_length=2)]
    nodeid: str | None = None
    config: dict[str, Any] | None = None  # RunConfig.to_dict(), as JSON
    rule: Rule | None = None

    @model_validator(mode="after")
    def _complete(self) -> Setup:
        if self.mode == "perf" and (self.config is None or self.rule is None):
            raise ValueError("a performance bisect needs a configuration and a rule")
        if self.mode == "test" and not self.nodeid:
            raise ValueError("a test bisect needs a pytest node")
        return self

    @property
    def gate(self) -> Rule:
        """The rule of a performance bisect."""
        if self.rule is None:
            raise ValueError("a test bisect has no comparisons")
        return self.rule


class MetricRow(_Strict):
    """One metric's verdict and interval in a probe, as relative changes of head against base."""

    metric: str
    gated: bool
    verdict: str
    estimate: float | None = None
    low: float | None = None
    high: float | None = None
    level: float | None = None
    noise: float | None = None


class ProbeRecord(_Strict):
    """One probe as it ended. `outcome` says what the head is next to the base: "bad" slower (a failing
    test), "good" not slower (a passing test), "skip" it could not run, "undecided"."""

    kind: Kind
    base: Annotated[int, Field(ge=0)] | None
    head: Annotated[int, Field(ge=0)]
    outcome: Outcome
    metric: str | None = None  # the metric the outcome follows
    threshold: float | None = None  # the slowdown a good outcome rules out
    alpha: float | None = None  # the probe's family-wise share of the bisect's alpha
    rows: list[MetricRow] = []
    pairs: Annotated[int, Field(ge=0)] = 0
    seconds: Annotated[float, Field(ge=0)] = 0.0
    error: str | None = None
    failed: Literal["base", "head"] | None = None  # the side that could not be run (`error` says why)

    def row(self, metric: str | None = None) -> MetricRow | None:
        """The row of `metric` (default: the one the outcome follows)."""
        return next((r for r in self.rows if r.metric == (metric or self.metric)), None)


class State(_Strict):
    """The state file: the setup and every probe so far, in order."""

    schema_: Literal["distbench.bisect-state/1"] = Field(alias="schema")
    setup: Setup
    probes: list[ProbeRecord]


class StateFileError(DistbenchError, ValueError):
    """A state file that is damaged or belongs to another bisect; the message names it and the fix."""


@dataclass(frozen=True)
class Step:
    """The next probe: `head` against `base` (None: a test run at `head`)."""

    kind: Kind
    base: int | None
    head: int


@dataclass(frozen=True)
class Verdict:
    """How a bisect ended. status: "culprit" (first_bad has one candidate), "candidates" (skipped ones
    leave several), "same" (good and bad do not differ), "undecided" (the range lo..hi, no culprit),
    "ends" (an end could not be run, before or during the search, or a test that does not fail at bad or
    pass at good). `message`, the summary line, names every regression found: the first, and a further one
    the remainder found or the bad end's slowdown implies."""

    status: Literal["culprit", "candidates", "same", "undecided", "ends"]
    message: str
    lo: int
    hi: int
    first_bad: tuple[int, ...] = ()
    remainder: Outcome | None = None

    @property
    def exit_code(self) -> int:
        """0 nothing to find, 1 found, 2 the ends do not hold, 3 undecided (as the gate's: never a pass)."""
        return {"same": 0, "culprit": 1, "candidates": 1, "ends": 2, "undecided": 3}[self.status]


@dataclass
class Bisection:
    setup: Setup
    probes: list[ProbeRecord]

    @property
    def n(self) -> int:
        """The bad end's index."""
        return len(self.setup.candidates) - 1

    @property
    def planned(self) -> int:
        """Comparisons of a bisect without skips: the confirm, ceil(log2 n) search probes, the remainder
        (for a test: the two ends and the search)."""
        return math.ceil(math.log2(self.n)) + 2

    @property
    def probe_alpha(self) -> float:
        """Each comparison's family-wise alpha: the bisect's split over the planned comparisons."""
        return self.setup.gate.alpha / self.planned

    def name(self, i: int) -> str:
        """Candidate `i` in words: its place and label ("8/16 1a2b3c4d5e fix the loader")."""
        return f"{i}/{self.n} {self.setup.candidates[i].label}"

    def _first(self, kind: Kind, head: int | None = None) -> ProbeRecord | None:
        return next((p for p in self.probes if p.kind == kind and head in (None, p.head)), None)

    @property
    def confirm(self) -> ProbeRecord | None:
        return self._first("confirm")

    @property
    def probe_threshold(self) -> float:
        """The slowdown a search probe must rule out to call its midpoint good: the gate's threshold, or half
        the bad end's slowdown where that is less (see the module doc)."""
        row = self.confirm.row() if self.confirm else None
        if row is None or row.estimate is None:
            return self.setup.gate.threshold
        worse, _, _ = stats.worse_axis(METRICS[row.metric].direction, row.estimate, row.low, row.high)
        return min(self.setup.gate.threshold, worse / 2)

    def _ends_hold(self) -> bool:
        if self.setup.mode == "perf":
            return self.confirm is not None and self.confirm.outcome == "bad"
        bad, good = self._first("end", self.n), self._first("end", 0)
        return bad is not None and good is not None and bad.outcome == "bad" and good.outcome == "good"

    def _status(self) -> dict[int, Outcome]:
        """Every candidate's known outcome against the good end: the ends, then the search's probes."""
        known: dict[int, Outcome] = {0: "good", self.n: "bad"}
        known.update({p.head: p.outcome for p in self.probes if p.kind == "search"})
        return known

    def bounds(self) -> tuple[int, int]:
        """(last good, first bad) as known so far."""
        known = self._status()
        hi = min(i for i, o in known.items() if o == "bad")
        return max(i for i, o in known.items() if o == "good" and i < hi), hi

    def next_step(self) -> Step | None:
        """The probe to run next, or None when the bisect is over."""
        n = self.n
        if self.setup.mode == "perf" and self.confirm is None:
            return Step("confirm", 0, n)
        if self.setup.mode == "test":
            for end, wanted in ((n, "bad"), (0, "good")):
                record = self._first("end", end)
                if record is None:
                    return Step("end", None, end)
                if record.outcome != wanted:
                    return None
        if not self._ends_hold() or "undecided" in self._status().values():
            return None
        lo, hi = self.bounds()
        known = self._status()
        open_ = [i for i in range(lo + 1, hi) if i not in known]
        if open_:
            middle = (lo + hi) / 2
            m = min(open_, key=lambda i: (abs(i - middle), i))
            return Step("search", 0 if self.setup.mode == "perf" else None, m)
        if self.setup.mode == "perf" and hi < n and self._first("remainder") is None:
            return Step("remainder", hi, n)
        return None

    def verdict(self) -> Verdict:
        """How the bisect ended (or stands, while next_step is not None)."""
        ends = self._ends_verdict()
        if ends is not None:
            return ends
        lo, hi = self.bounds()
        further = self._further(hi)
        cut = next((p for p in self.probes if p.kind == "search" and p.outcome == "undecided"), None)
        if cut is not None:
            where = (
                f"the first change lies after {self.name(lo)}, up to {self.name(hi)} ({hi - lo} candidates); "
                f"no culprit named{further}"
            )
            if cut.failed == "base":
                return Verdict(
                    "ends",
                    f"the good end {self.name(0)} could not be run beside {self.name(cut.head)} ({cut.error}): "
                    + where,
                    lo,
                    hi,
                )
            return Verdict("undecided", f"the probe of {self.name(cut.head)} was undecided: {where}", lo, hi)
        remainder = self._first("remainder")
        rest = remainder.outcome if remainder else None
        skipped = tuple(i for i in range(lo + 1, hi) if self._status().get(i) == "skip")
        if skipped:
            return Verdict(
                "candidates",
                f"the first bad one is {self.name(hi)} or "
                + ("the one" if len(skipped) == 1 else f"one of the {len(skipped)}")
                + f" skipped before it: {'; '.join(self.name(i) for i in skipped)}{further}",
                lo,
                hi,
                (*skipped, hi),
                rest,
            )
        return Verdict("culprit", f"the first bad one is {self.name(hi)}{further}", lo, hi, (hi,), rest)

    def _ends_verdict(self) -> Verdict | None:
        """The verdict when the ends do not hold (or are not known yet): nothing to find, an end that could not
        be run, or a confirm that could not tell; None once they hold."""
        n, setup = self.n, self.setup
        if setup.mode == "perf":
            c = self.confirm
            if c is None or c.outcome == "undecided":
                why = f" ({c.error})" if c and c.error else ""
                return Verdict("undecided", f"could not tell whether bad is slower than good{why}", 0, n)
            if c.outcome == "good":
                return Verdict(
                    "same",
                    f"bad is not slower than good (a slowdown of {setup.gate.threshold:.1%} ruled out on every "
                    "gated metric): nothing to find",
                    0,
                    n,
                )
            if c.outcome != "bad":
                end = {"base": f"the good end {self.name(0)}", "head": f"the bad end {self.name(n)}"}
                return Verdict(
                    "ends", f"{end.get(c.failed or '', 'an end')} could not be run: {c.error}", 0, n
                )
            return None
        for i, wanted, says in ((n, "bad", "fail at"), (0, "good", "pass at")):
            r = self._first("end", i)
            if r is None or r.outcome == wanted:
                continue
            if r.outcome == "good":
                return Verdict("same", f"{setup.nodeid} passes at the bad end: nothing to find", 0, n)
            what = "fails" if r.outcome == "bad" else f"cannot run ({r.error})"
            end_name = "good" if i == 0 else "bad"
            return Verdict("ends", f"{setup.nodeid} {what} at the {end_name} end; it must {says} it", 0, n)
        return None

    def _further(self, hi: int) -> str:
        """Words on a further regression after the first bad candidate `hi` ("" where none is known): the
        remainder found the bad end slower still; or, where the remainder did not decide, the bad end's slowdown
        against good (the confirm's estimate) lies past the interval of hi's own, so the range narrowed does not
        explain the ends' difference and more than one change may lie in the history."""
        rest = self._first("remainder")
        if rest is not None and rest.outcome == "bad":
            return f"; the bad end is slower still: a further regression lies after {self.name(hi)}"
        c, probe = self.confirm, self._first("search", hi)
        if c is None or probe is None or (rest is not None and rest.outcome == "good"):
            return ""
        ends, mid = c.row(), probe.row(c.metric)
        if ends is None or mid is None or ends.estimate is None or mid.estimate is None:
            return ""
        direction = METRICS[ends.metric].direction
        d = stats.worse_axis(direction, ends.estimate, ends.low, ends.high)[0]
        e, low, high = stats.worse_axis(direction, mid.estimate, mid.low, mid.high)
        if d <= high:
            return ""
        return (
            f"; more than one change may lie in the history: bad is {d:+.1%} against good on {ends.metric}, "
            f"past {self.name(hi)}'s {e:+.1%} [{low:+.1%}, {high:+.1%}], so a further change may lie after it"
        )

    def alpha_spent(self) -> float:
        """The family-wise alpha the comparisons run so far spent (their shares, summed)."""
        return sum(p.alpha or 0.0 for p in self.probes)


def step_time_reason(rows: list[MetricRow]) -> str:
    """Why a bisect follows the step time, in words that match the device figure beside it: the device-side
    row of the confirm (gated where there is one) was ruled out, got faster, moved without being decided, or
    was not sampled. (A confirm printed "the device's kernel time did not" move beside device_compute_s
    +2.19%, undecided: that figure had moved, it was only not decided.)"""
    device = ab.DEVICE_METRIC.values()
    rows = [r for r in rows if r.metric in device and r.estimate is not None]
    row = next((r for r in rows if r.gated), rows[0] if rows else None)
    if row is None or row.low is None or row.high is None:
        return (
            "the step time moved and the device's kernel time was not sampled: followed on step time (a "
            "host-side change, or a device-side one the run could not show)"
        )
    figure = f"{row.metric} {row.estimate:+.2%} [{row.low:+.2%}, {row.high:+.2%}]"
    if row.verdict == stats.UNCHANGED:
        return (
            f"the step time moved and the device's kernel time did not ({figure}, a slowdown ruled out): a "
            "host-side change, followed on step time"
        )
    if row.verdict == stats.IMPROVEMENT:
        return (
            f"the step time moved and the device's kernel time got faster ({figure}): a host-side change, "
            "followed on step time"
        )
    if row.verdict == stats.UNDECIDED:
        return (
            f"the step time moved; the device's kernel time moved by {row.estimate:+.2%} but was not "
            f"decided ({figure}): host-side or device-side, followed on step time"
        )
    return f"the step time moved and the device's kernel time with it ({figure}): followed on step time"


def chosen_metric(rows: list[MetricRow]) -> str | None:
    """The metric a bisect follows: the first of METRIC_ORDER that regressed (then any other gated one)."""
    regressed = [r.metric for r in rows if r.gated and r.verdict == stats.REGRESSION]
    return next((m for m in (*METRIC_ORDER, *regressed) if m in regressed), None)


def _rows(report: ABReport) -> list[MetricRow]:
    (o,) = report.outcomes
    out = []
    for r in o.rows:
        e = r.effect
        out.append(
            MetricRow(
                metric=r.metric,
                gated=r.gated,
                verdict=r.verdict,
                **(
                    {}
                    if e is None
                    else {
                        "estimate": e.estimate,
                        "low": e.low,
                        "high": e.high,
                        "level": e.level,
                        "noise": e.noise,
                    }
                ),
            )
        )
    return out


#: A gate verdict of head against base, as what the head is next to the base.
OUTCOME_OF: dict[str, Outcome] = {
    stats.REGRESSION: "bad",
    stats.UNCHANGED: "good",
    stats.IMPROVEMENT: "good",
    stats.UNDECIDED: "undecided",
}


class Comparator(Protocol):
    """Runs one comparison of candidate `head` against candidate `base` (run_ab through the variants'
    servers); VariantStartError when a candidate cannot be started or built."""

    def __call__(
        self, step: Step, *, gate: tuple[str, ...] | None, alpha: float, threshold: float
    ) -> ABReport: ...


class Tester(Protocol):
    """Runs the pytest node at candidate `index`: ("good" passed, "bad" failed, "skip" could not run, why)."""

    def __call__(self, index: int) -> tuple[Outcome, str]: ...


def compare_probe(b: Bisection, step: Step, compare: Comparator) -> ProbeRecord:
    """One performance probe: run its comparison and say what the head is next to the base."""
    if step.kind == "confirm":
        gate, threshold, metric = None, b.setup.gate.threshold, None
    else:
        assert b.confirm is not None and b.confirm.metric
        metric = b.confirm.metric
        gate = (metric,)
        threshold = b.probe_threshold if step.kind == "search" else b.setup.gate.threshold
    alpha = b.probe_alpha
    common: dict[str, Any] = {"kind": step.kind, "base": step.base, "head": step.head}
    try:
        report = compare(step, gate=gate, alpha=alpha, threshold=threshold)
    except VariantStartError as e:
        side = _side(e.label)
        return ProbeRecord(**common, outcome=_failed(step, side), error=str(e), failed=side)
    (o,) = report.outcomes
    rows = _rows(report)
    pairs = len(o.pairs)
    if o.error:
        side = _side(o.failed)
        outcome = _failed(step, side)
        return ProbeRecord(**common, outcome=outcome, rows=rows, pairs=pairs, error=o.error, failed=side)
    common["alpha"] = alpha
    if step.kind == "confirm":
        metric, outcome = chosen_metric(rows), OUTCOME_OF[o.verdict]
    else:
        row = next((r for r in rows if r.metric == metric and r.gated), None)
        outcome = OUTCOME_OF[row.verdict] if row else "undecided"
    return ProbeRecord(**common, outcome=outcome, metric=metric, threshold=threshold, rows=rows, pairs=pairs)


def _side(label: str | None) -> Literal["base", "head"]:
    """The side a failure names: the base, or else the head (the candidate the probe asks about)."""
    return "base" if label == "base" else "head"


def _failed(step: Step, side: str) -> Outcome:
    """A comparison whose `side` could not run: a skip for the midpoint of a search, or for either end at the
    confirm (the bisect stops there: the ends do not hold); undecided otherwise (the good end failed beside a
    midpoint, which stops the search, or the remainder's comparison did). It decided nothing, so it spends no
    alpha."""
    if step.kind == "confirm" or (step.kind == "search" and side == "head"):
        return "skip"
    return "undecided"


def test_probe(step: Step, run_test: Tester) -> ProbeRecord:
    """One probe of a pytest node: the node at the step's head."""
    outcome, detail = run_test(step.head)
    failed: Literal["head"] | None = "head" if outcome == "skip" else None
    return ProbeRecord(
        kind=step.kind, base=None, head=step.head, outcome=outcome, error=detail or None, failed=failed
    )


def run(
    b: Bisection,
    probe: Callable[[Step], ProbeRecord],
    *,
    state_path: Path | None = None,
    on_probe: Callable[[ProbeRecord], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> Verdict:
    """Probe until next_step has nothing more; each probe is timed, appended and saved before the next."""
    while (step := b.next_step()) is not None:
        t0 = clock()
        record = probe(step).model_copy(update={"seconds": clock() - t0})
        b.probes.append(record)
        if state_path is not None:
            save_state(state_path, b)
        if on_probe:
            on_probe(record)
    return b.verdict()


def save_state(path: Path, b: Bisection) -> None:
    state = State.model_validate({"schema": STATE_SCHEMA, "setup": b.setup, "probes": b.probes})
    write_json_atomic(path, state.model_dump(mode="json", by_alias=True))


def load_state(path: Path) -> State:
    """The state file at `path`, validated; StateFileError naming it for anything else (it is only parsed as
    JSON, never run)."""
    fix = "remove it to start over, or give another --output"
    try:
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise StateFileError(f"cannot read the bisect state {path}: {e.strerror}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise StateFileError(f"{path} is not a {STATE_SCHEMA} file (not JSON: {e}); {fix}") from None
    schema = raw.get("schema") if isinstance(raw, dict) else None
    if schema != STATE_SCHEMA:
        raise StateFileError(f"{path} is not a {STATE_SCHEMA} file (its schema is {schema!r}); {fix}")
    try:
        return State.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        raise StateFileError(
            f"{path} is a damaged {STATE_SCHEMA} file ({loc}: {err['msg'].lower()}); {fix}"
        ) from None


def resume(path: Path, setup: Setup) -> Bisection:
    """The bisect of `setup` with the probes its state file at `path` holds (none if there is no file);
    StateFileError when the file is damaged or was written for another bisect."""
    if not path.exists():
        return Bisection(setup, [])
    state = load_state(path)
    old, new = state.setup.model_dump(mode="json"), setup.model_dump(mode="json")
    if old != new:
        key, there, here = _difference(old, new)
        raise StateFileError(
            f"{path} belongs to another bisect ({key} differs: {_short(there)} there, {_short(here)} here); "
            "give the same arguments to resume it, or another --output"
        )
    return Bisection(setup, list(state.probes))


def _difference(old: Any, new: Any, key: str = "") -> tuple[str, Any, Any]:
    """The first key (dotted, into nested objects) where two setups differ, and its two values."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in [*new, *(k for k in old if k not in new)]:
            if old.get(k) != new.get(k):
                return _difference(old.get(k), new.get(k), f"{key}.{k}" if key else k)
    return key, old, new


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 60 else text[:57] + "..."
