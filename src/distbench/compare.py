"""`distbench compare`: did a metric move between two directories of separate runs, beyond noise?

Each side is a list of results (one per SEPARATE run: a fresh process, its own warm-up), grouped by
`results.config_key`. For every configuration and metric the per-run values go through the gate's
statistics (gate/stats.py, the same rules as the interleaved A/B gate `distbench ab`, unpaired here):
Welch's t interval on ln(value) (a metric and its reciprocal reach the same verdict), the Mann-Whitney U
p-value beside it, and the effect this many runs could have detected. The family-wise false-alarm rate
`alpha` is divided over every row (Bonferroni), so a nightly matrix of dozens of rows does not raise an
alarm by chance.

Verdict per row: regression, improvement, unchanged (a regression of `threshold` is ruled out), undecided
(the runs cannot rule it out), or insufficient-data (fewer than `min_runs` usable runs on a side, including a
configuration that exists on one side only). Runs whose NVML sampling saw throttling, and runs whose status
is not "ok", are excluded and listed in the report. Runs of separate invocations carry their process's own
bias (up to 6-8% for host-bound steps on 2x H200): prefer `distbench ab`, whose pairs cancel it.

Exit codes (`CompareReport.exit_code`, also the exit status of `distbench compare`):
    0  no regression, and every row decided
    1  at least one regression (takes precedence)
    3  undecided: a row could not rule out a regression, or lacked runs, or there was nothing usable to
       compare. `allow_insufficient=True` (`--allow-insufficient`) lets rows that lack runs pass, never
       undecided rows and never a comparison with no decided row at all.
(2 is left to argparse's usage errors.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .config import config_label
from .errors import ConfigError
from .gate import stats
from .gate.stats import IMPROVEMENT, REGRESSION, UNCHANGED, UNDECIDED
from .metrics import COMPARED, METRICS, fmt_metric
from .report.tables import md_table
from .results import config_key

INSUFFICIENT = "insufficient-data"

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_INSUFFICIENT = 3

TRACE_PARTS = ("compute", "non_compute", "idle")

MIN_EFFECT = 0.01  # 1%: below this a significant move is not worth a red build
THRESHOLD = 0.02  # the regression a pass must rule out
ALPHA = 0.05  # family-wise, over every row of the comparison


@dataclass(frozen=True)
class Attribution:
    """Time per step spent in one trace category (compute, non_compute, idle), median over runs."""

    part: str
    base_ms: float
    head_ms: float

    @property
    def delta_ms(self) -> float:
        return self.head_ms - self.base_ms


@dataclass
class Row:
    """One configuration x metric."""

    key: tuple
    label: str
    metric: str
    base: list[float]
    head: list[float]
    verdict: str
    effect: stats.Effect | None = None
    note: str = ""
    attribution: list[Attribution] = field(default_factory=list)

    @property
    def change(self) -> float:
        """Relative change of head over base (from the mean of log values), signed as measured."""
        return self.effect.estimate if self.effect else math.nan

    @property
    def base_median(self) -> float:
        return statistics.median(self.base) if self.base else math.nan

    @property
    def head_median(self) -> float:
        return statistics.median(self.head) if self.head else math.nan


@dataclass(frozen=True)
class Excluded:
    """A run left out of the comparison, and why."""

    side: str  # "base" or "head"
    result_id: str
    label: str
    reason: str


@dataclass
class CompareReport:
    """Every row, the excluded runs and the criteria; `exit_code` is the gate's verdict."""

    rows: list[Row]
    excluded: list[Excluded]
    alpha: float
    per_test_alpha: float
    min_runs: int
    min_effect: float
    threshold: float
    allow_insufficient: bool = False
    notes: list[str] = field(default_factory=list)

    def _with(self, verdict: str) -> list[Row]:
        return [r for r in self.rows if r.verdict == verdict]

    @property
    def regressions(self) -> list[Row]:
        return self._with(REGRESSION)

    @property
    def improvements(self) -> list[Row]:
        return self._with(IMPROVEMENT)

    @property
    def insufficient(self) -> list[Row]:
        return self._with(INSUFFICIENT)

    @property
    def undecided(self) -> list[Row]:
        return self._with(UNDECIDED)

    @property
    def status(self) -> str:
        """ "regression", "undecided" or "pass"."""
        if self.regressions:
            return REGRESSION
        decided = [r for r in self.rows if r.verdict not in (UNDECIDED, INSUFFICIENT)]
        if self.undecided or not decided or (self.insufficient and not self.allow_insufficient):
            return UNDECIDED
        return "pass"

    @property
    def exit_code(self) -> int:
        return {REGRESSION: EXIT_REGRESSION, UNDECIDED: EXIT_INSUFFICIENT}.get(self.status, EXIT_OK)

    def summary(self) -> str:
        counts = {
            v: len(self._with(v)) for v in (REGRESSION, IMPROVEMENT, UNCHANGED, UNDECIDED, INSUFFICIENT)
        }
        throttled = sum(e.reason == "throttled" for e in self.excluded)
        parts = [f"{n} {v}" for v, n in counts.items() if n]
        if self.excluded:
            parts.append(f"{len(self.excluded)} runs excluded ({throttled} throttled)")
        verdict = {
            REGRESSION: "FAIL: significant regression",
            UNDECIDED: "UNDECIDED: could not rule out a regression (too few usable runs, or too noisy)",
            "pass": "PASS",
        }[self.status]
        return f"{verdict} (exit {self.exit_code}); " + (", ".join(parts) or "nothing to compare")

    def _criteria(self) -> str:
        return (
            f"Welch's t interval on log values at {1 - self.per_test_alpha:.3%} (family-wise alpha "
            f"{self.alpha} over {len(self.rows)} rows), Mann-Whitney U p beside it; regression when the "
            f"interval excludes 0 and the change is at least {self.min_effect:.1%}; unchanged when a "
            f"{self.threshold:.1%} regression is ruled out; at least {self.min_runs} runs per side."
        )

    def _table(self) -> tuple[list[str], list[list[str]]]:
        head = [
            "Config",
            "Metric",
            "Base median (n)",
            "Head median (n)",
            "Change [CI]",
            "Detectable",
            "p",
            "Verdict",
        ]
        body = []
        for r in sorted(self.rows, key=_row_order):
            e = r.effect
            body.append(
                [
                    r.label,
                    r.metric,
                    f"{fmt_metric(r.metric, r.base_median)} ({len(r.base)})",
                    f"{fmt_metric(r.metric, r.head_median)} ({len(r.head)})",
                    "—" if e is None else f"{e.estimate:+.2%} [{e.low:+.2%}, {e.high:+.2%}]",
                    "—" if e is None else f"±{e.detectable:.2%}",
                    "—" if e is None else f"{e.p_value:.3g}",
                    r.verdict + (f" ({r.note})" if r.note else ""),
                ]
            )
        return head, body

    def _attributions(self) -> list[tuple[Row, str]]:
        out = []
        for r in self.regressions:
            if r.attribution:
                total = sum(a.delta_ms for a in r.attribution)
                parts = ", ".join(
                    f"{a.part.replace('_', '-')} {a.base_ms:.1f} → {a.head_ms:.1f} ms ({a.delta_ms:+.1f})"
                    for a in r.attribution
                )
                out.append((r, f"step time {total:+.1f} ms/step: {parts}"))
        return out

    def to_markdown(self) -> str:
        lines = [f"## distbench compare: {self.summary()}", "", self._criteria(), ""]
        lines += [f"> {n}" for n in self.notes] + ([""] if self.notes else [])
        lines += md_table(*self._table())
        attributions = self._attributions()
        if attributions:
            lines += ["", "### Where the time went (trace breakdown, per step, largest growth first)", ""]
            lines += [f"- **{r.label} {r.metric}**: {text}" for r, text in attributions]
        if self.excluded:
            lines += ["", "### Excluded runs", ""]
            lines += md_table(
                ["Side", "Config", "Run", "Reason"],
                [[e.side, e.label, e.result_id, e.reason] for e in self.excluded],
            )
        return "\n".join(lines) + "\n"

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        style = {
            REGRESSION: "bold red",
            IMPROVEMENT: "green",
            UNCHANGED: "",
            UNDECIDED: "yellow",
            INSUFFICIENT: "yellow",
        }
        head, body = self._table()
        table = Table(*head, title="distbench compare", caption=self._criteria())
        for r, cells in zip(sorted(self.rows, key=_row_order), body, strict=True):
            table.add_row(*cells, style=style[r.verdict])
        parts: list[Any] = [table]
        parts += [Text(f"note: {n}", style="yellow") for n in self.notes]
        parts += [Text(f"{r.label} {r.metric}: {text}", style="red") for r, text in self._attributions()]
        parts += [
            Text(f"excluded {e.side} run {e.result_id} ({e.label}): {e.reason}", style="dim")
            for e in self.excluded
        ]
        status_style = {REGRESSION: "bold red", UNDECIDED: "bold yellow"}.get(self.status, "bold green")
        parts.append(Text(self.summary(), style=status_style))
        return Group(*parts)


def _row_order(r: Row) -> tuple:
    rank = {REGRESSION: 0, UNDECIDED: 1, INSUFFICIENT: 2, IMPROVEMENT: 3, UNCHANGED: 4}[r.verdict]
    return (rank, r.label, r.metric)


def _usable(results: Iterable[dict[str, Any]], side: str, excluded: list[Excluded]) -> list[dict[str, Any]]:
    """Results fit to compare; the rest are recorded in `excluded` with their reason."""
    keep = []
    for r in results:
        label = config_label(r["config"])
        if r.get("status") != "ok":
            why = f"status {r.get('status')}" + (f": {r['error']}" if r.get("error") else "")
            excluded.append(Excluded(side, r.get("id", "?"), label, why))
        elif (r.get("nvml") or {}).get("throttled"):
            excluded.append(Excluded(side, r.get("id", "?"), label, "throttled"))
        else:
            keep.append(r)
    return keep


def _values(runs: Sequence[dict[str, Any]], metric: str) -> list[float]:
    out = []
    for r in runs:
        v = (r.get("metrics") or {}).get(metric)
        if isinstance(v, (int, float)) and math.isfinite(v):
            out.append(float(v))
    return out


def _per_step_breakdown(runs: Sequence[dict[str, Any]]) -> dict[str, float] | None:
    """Median ms per step in each trace category, or None when no run has a trace.

    A trace covers a few profiled steps, not the timed ones, so its category shares are applied to the
    run's measured median step time; the parts then add up to the step time the gate compared.
    """
    per_run = []
    for r in runs:
        t, st = r.get("trace"), (r.get("metrics") or {}).get("step_time_s")
        if not t or not st:
            continue
        shares = [float(t.get(f"{p}_pct") or 0.0) for p in TRACE_PARTS]
        if sum(shares) > 0:
            per_run.append(
                {p: 1000.0 * st * s / sum(shares) for p, s in zip(TRACE_PARTS, shares, strict=True)}
            )
    if not per_run:
        return None
    return {p: statistics.median(x[p] for x in per_run) for p in TRACE_PARTS}


def _attribute(base: Sequence[dict[str, Any]], head: Sequence[dict[str, Any]]) -> list[Attribution]:
    b, h = _per_step_breakdown(base), _per_step_breakdown(head)
    if b is None or h is None:
        return []
    parts = [Attribution(p, b[p], h[p]) for p in TRACE_PARTS]
    return sorted(parts, key=lambda a: a.delta_ms, reverse=True)


def _machine(runs: Iterable[dict[str, Any]]) -> set[str]:
    return {f"{(r.get('env') or {}).get('gpu_count')}x {(r.get('env') or {}).get('gpu_model')}" for r in runs}


def _compare_metric(
    key: tuple,
    label: str,
    metric: str,
    base_runs: list[dict[str, Any]],
    head_runs: list[dict[str, Any]],
    *,
    min_runs: int,
) -> Row | None:
    """The row of one configuration x metric, its verdict left for `compare` to decide."""
    base, head = _values(base_runs, metric), _values(head_runs, metric)
    if not base and not head:
        return None
    row = Row(key, label, metric, base, head, INSUFFICIENT)
    if len(base) < min_runs or len(head) < min_runs:
        row.note = f"need {min_runs} runs per side, have {len(base)} base / {len(head)} head"
    return row


def compare(
    base: list[dict[str, Any]],
    head: list[dict[str, Any]],
    *,
    metrics: Sequence[str] | None = None,
    alpha: float = ALPHA,
    min_effect: float = MIN_EFFECT,
    threshold: float = THRESHOLD,
    min_runs: int = 6,
    allow_insufficient: bool = False,
) -> CompareReport:
    """Compare repeated runs of `head` against `base`, per configuration and metric (see module doc)."""
    if min_runs < stats.MIN_RUNS:
        raise ConfigError(f"min_runs must be at least {stats.MIN_RUNS} for an interval, got {min_runs}")
    if not 0 < alpha < 0.5:
        raise ConfigError(f"alpha must be between 0 and 0.5, got {alpha}")
    if not 0 < min_effect <= threshold < 1:
        raise ConfigError(f"need 0 < min_effect <= threshold < 1, got {min_effect} and {threshold}")
    names = tuple(metrics) if metrics else COMPARED  # the registry's `compare` metrics
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise ConfigError(f"unknown metric(s) {unknown}; known metrics: {', '.join(METRICS)}")
    excluded: list[Excluded] = []
    sides: dict[str, dict[tuple, list[dict[str, Any]]]] = {}
    for side, results in (("base", base), ("head", head)):
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for r in _usable(results, side, excluded):
            groups.setdefault(config_key(r), []).append(r)
        sides[side] = groups
    report = CompareReport([], excluded, alpha, alpha, min_runs, min_effect, threshold, allow_insufficient)
    b_machines, h_machines = _machine(base), _machine(head)
    if base and head and b_machines != h_machines:
        report.notes.append(
            f"base ran on {', '.join(sorted(b_machines))}, head on {', '.join(sorted(h_machines))}: "
            "throughput and memory are not comparable across machines"
        )
    for side in ("base", "head"):
        if not sides[side]:
            report.notes.append(f"the {side} side holds no usable result: nothing can pass")
    labels = {k: config_label(rs[0]["config"]) for g in sides.values() for k, rs in g.items()}
    for key in sorted(set(sides["base"]) | set(sides["head"]), key=lambda k: labels[k]):
        b, h = sides["base"].get(key, []), sides["head"].get(key, [])
        for metric in names:
            row = _compare_metric(key, labels[key], metric, b, h, min_runs=min_runs)
            if row is not None:
                report.rows.append(row)
    testable = [r for r in report.rows if not r.note]
    report.per_test_alpha = stats.family_alpha(alpha, len(testable))
    for row in testable:
        row.effect = stats.unpaired_effect(row.base, row.head, report.per_test_alpha)
        row.verdict = stats.verdict(
            row.effect, METRICS[row.metric].direction, threshold=threshold, min_effect=min_effect
        )
        if row.verdict == REGRESSION and METRICS[row.metric].time:  # worth attributing to trace categories
            b, h = sides["base"][row.key], sides["head"][row.key]
            row.attribution = _attribute(b, h)
    return report
