"""The statistical compare gate: did a metric move between two sets of runs, beyond noise, and which way?

Each side is a list of results (one per SEPARATE run: a fresh process, its own warm-up). Results are grouped
by `results.config_key`; for every configuration and metric the gate compares the per-run values:

* change: relative change of the medians, (head - base) / base, read through METRIC_DIRECTIONS so that
  "worse" means slower, less throughput or more memory. The decision is taken on the log ratio
  ln(head / base) with the noise as the spread of ln(value), so a metric and its reciprocal reach the same
  verdict: on 4x H200 a slowdown read +42.2% in step time and -29.8% in tokens/s, and a linear threshold of
  +-28-30% flagged the first and passed the second. The threshold is shown as the equivalent increase.
* significance: two-sided Mann-Whitney U over the per-run values. Chosen over Welch's t because run-level
  GPU timings are not normal: one run that lands on a noisy neighbour, a clock dip or a late NCCL warm-up is
  an outlier that drags a mean and inflates a variance, while a rank test shrugs it off. With 6 runs a side
  the exact test can still reach p = 0.0022, so alpha = 0.01 is usable at the minimum run count (Welch's t
  with n = 6 would lean on a normality assumption it cannot check).
* noise-aware threshold: a significant change also has to exceed max(min_effect, noise_k x SE), where
  SE = pooled run-to-run CV (of ln values) x sqrt(1/n_base + 1/n_head) is the standard error of the log
  ratio. Metrics that can be zero (memory of an offloaded component) fall back to the linear change and CV.
  Significance alone is not enough: with tight enough runs a real but tiny 0.2% drift is "significant" and
  not worth a red build (the min_effect floor), and at alpha = 0.01 one configuration in a hundred would
  be flagged by chance, too often for a nightly matrix of dozens (the noise_k x SE term). The threshold
  shrinks as runs are added, so more repeats resolve what noise hides; a multiple of the CV alone would stay
  blind to a 16% slowdown on runs that vary by 8%, however many were collected.

Verdict per row: regression, improvement, unchanged, or insufficient-data (fewer than `min_runs` usable runs
on a side, including a configuration that exists on one side only). Runs whose NVML sampling saw throttling,
and runs whose status is not "ok", are excluded and listed in the report.

Exit codes (`CompareReport.exit_code`, also the exit status of `distbench compare`):
    0  no significant regression, and every row had enough runs
    1  at least one significant regression (takes precedence)
    3  no regression found, but some rows lacked runs: the gate could not decide, so it does not pass.
       `allow_insufficient=True` (`--allow-insufficient`) turns this into 0 for jobs that knowingly run less.
(2 is left to argparse's usage errors.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError
from .report.markdown import config_label, fmt_metric, md_table
from .results import METRIC_DIRECTIONS, config_key

REGRESSION = "regression"
IMPROVEMENT = "improvement"
UNCHANGED = "unchanged"
INSUFFICIENT = "insufficient-data"

EXIT_OK = 0
EXIT_REGRESSION = 1
EXIT_INSUFFICIENT = 3

#: Compared by default: one throughput, one time, the efficiency and the memory figures; the per-GPU and
#: percentage variants are redundant with these and would only repeat a verdict.
DEFAULT_METRICS = (
    "tokens_per_s",
    "step_time_s",
    "mfu",
    "mem_allocated_peak_bytes",
    "mem_reserved_peak_bytes",
    "nvml_mem_used_peak_bytes",
    "busbw_gbps",
)
#: Metrics whose regression is worth attributing to compute / non-compute / idle time.
TIME_METRICS = frozenset({"tokens_per_s", "tokens_per_s_per_gpu", "samples_per_s", "samples_per_s_per_gpu",
                          "step_time_s", "mfu", "tflops_per_gpu"})
TRACE_PARTS = ("compute", "non_compute", "idle")

MIN_EFFECT = 0.01  # 1%: below this a move is not worth a red build whatever the noise
#: A change must exceed 5 standard errors of the log ratio: at the minimum of 6 runs a side that
#: is 2.9 pooled CVs, the margin that keeps identical reruns quiet across a whole nightly matrix of
#: configurations; with more runs it tightens like the standard error does.
NOISE_K = 5.0


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
    change: float = math.nan  # (head - base) / base of medians, signed as measured
    p_value: float = math.nan
    noise_cv: float = math.nan
    threshold: float = math.nan
    note: str = ""
    attribution: list[Attribution] = field(default_factory=list)

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
    min_runs: int
    min_effect: float
    noise_k: float
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
    def status(self) -> str:
        """"regression", "insufficient-data" (gate undecided) or "pass"."""
        if self.regressions:
            return REGRESSION
        if (self.insufficient or not self.rows) and not self.allow_insufficient:
            return INSUFFICIENT
        return "pass"

    @property
    def exit_code(self) -> int:
        return {REGRESSION: EXIT_REGRESSION, INSUFFICIENT: EXIT_INSUFFICIENT}.get(self.status, EXIT_OK)

    def summary(self) -> str:
        counts = {v: len(self._with(v)) for v in (REGRESSION, IMPROVEMENT, UNCHANGED, INSUFFICIENT)}
        throttled = sum(e.reason == "throttled" for e in self.excluded)
        parts = [f"{n} {v}" for v, n in counts.items() if n]
        if self.excluded:
            parts.append(f"{len(self.excluded)} runs excluded ({throttled} throttled)")
        verdict = {REGRESSION: "FAIL: significant regression",
                   INSUFFICIENT: f"UNDECIDED: fewer than {self.min_runs} usable runs per side",
                   "pass": "PASS"}[self.status]
        return f"{verdict} (exit {self.exit_code}); " + (", ".join(parts) or "nothing to compare")

    def _criteria(self) -> str:
        return (f"Mann-Whitney U two-sided, alpha={self.alpha}; a change counts when significant and larger "
                f"than max({self.min_effect:.1%}, {self.noise_k:g} x its standard error from the pooled run-to-run "
                f"CV); "
                f"at least {self.min_runs} runs per side.")

    def _table(self) -> tuple[list[str], list[list[str]]]:
        head = ["Config", "Metric", "Base median (n)", "Head median (n)", "Change", "p", "Threshold", "Verdict"]
        body = []
        for r in sorted(self.rows, key=_row_order):
            body.append([
                r.label, r.metric,
                f"{fmt_metric(r.metric, r.base_median)} ({len(r.base)})",
                f"{fmt_metric(r.metric, r.head_median)} ({len(r.head)})",
                "—" if math.isnan(r.change) else f"{r.change:+.2%}",
                "—" if math.isnan(r.p_value) else f"{r.p_value:.3g}",
                "—" if math.isnan(r.threshold) else f"±{r.threshold:.2%}",
                r.verdict + (f" ({r.note})" if r.note else ""),
            ])
        return head, body

    def _attributions(self) -> list[tuple[Row, str]]:
        out = []
        for r in self.regressions:
            if r.attribution:
                total = sum(a.delta_ms for a in r.attribution)
                parts = ", ".join(f"{a.part.replace('_', '-')} {a.base_ms:.1f} → {a.head_ms:.1f} ms "
                                  f"({a.delta_ms:+.1f})" for a in r.attribution)
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
            lines += md_table(["Side", "Config", "Run", "Reason"],
                              [[e.side, e.label, e.result_id, e.reason] for e in self.excluded])
        return "\n".join(lines) + "\n"

    def __rich__(self) -> Any:
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        style = {REGRESSION: "bold red", IMPROVEMENT: "green", UNCHANGED: "", INSUFFICIENT: "yellow"}
        head, body = self._table()
        table = Table(*head, title="distbench compare", caption=self._criteria())
        for r, cells in zip(sorted(self.rows, key=_row_order), body, strict=True):
            table.add_row(*cells, style=style[r.verdict])
        parts: list[Any] = [table]
        parts += [Text(f"note: {n}", style="yellow") for n in self.notes]
        parts += [Text(f"{r.label} {r.metric}: {text}", style="red") for r, text in self._attributions()]
        parts += [Text(f"excluded {e.side} run {e.result_id} ({e.label}): {e.reason}", style="dim")
                  for e in self.excluded]
        status_style = {REGRESSION: "bold red", INSUFFICIENT: "bold yellow"}.get(self.status, "bold green")
        parts.append(Text(self.summary(), style=status_style))
        return Group(*parts)


def _row_order(r: Row) -> tuple:
    rank = {REGRESSION: 0, INSUFFICIENT: 1, IMPROVEMENT: 2, UNCHANGED: 3}[r.verdict]
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


def _cv(xs: Sequence[float]) -> float:
    mean = statistics.fmean(xs)
    return statistics.stdev(xs) / abs(mean) if len(xs) > 1 and mean else 0.0


def _log_sd(xs: Sequence[float]) -> float:
    """Standard deviation of ln(x): the CV of a positive metric, the same for the metric and its reciprocal."""
    return statistics.stdev(math.log(x) for x in xs) if len(xs) > 1 else 0.0


def _p_value(base: Sequence[float], head: Sequence[float]) -> float:
    from scipy.stats import mannwhitneyu  # imported here: scipy.stats costs a second of CLI start-up

    if len(set(base) | set(head)) == 1:
        return 1.0  # every run identical: nothing moved (the test itself is undefined here)
    return float(mannwhitneyu(base, head, alternative="two-sided", method="auto").pvalue)


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
            per_run.append({p: 1000.0 * st * s / sum(shares) for p, s in zip(TRACE_PARTS, shares, strict=True)})
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


def _compare_metric(key: tuple, label: str, metric: str, base_runs: list[dict[str, Any]],
                    head_runs: list[dict[str, Any]], *, alpha: float, min_effect: float, noise_k: float,
                    min_runs: int) -> Row | None:
    base, head = _values(base_runs, metric), _values(head_runs, metric)
    if not base and not head:
        return None
    row = Row(key, label, metric, base, head, INSUFFICIENT)
    if len(base) < min_runs or len(head) < min_runs:
        row.note = f"need {min_runs} runs per side, have {len(base)} base / {len(head)} head"
        return row
    mb, mh = row.base_median, row.head_median
    row.change = (mh - mb) / abs(mb) if mb else (0.0 if mh == mb else math.copysign(math.inf, mh - mb))
    row.p_value = _p_value(base, head)
    se = math.sqrt(1 / len(base) + 1 / len(head))
    if min(base + head) > 0:  # log scale: a metric and its reciprocal get the same verdict
        shift = math.log(mh / mb)
        row.noise_cv = math.sqrt((_log_sd(base) ** 2 + _log_sd(head) ** 2) / 2)
        bound = max(math.log1p(min_effect), noise_k * row.noise_cv * se)
        row.threshold = math.expm1(bound)
    else:
        shift = row.change
        row.noise_cv = math.sqrt((_cv(base) ** 2 + _cv(head) ** 2) / 2)
        bound = row.threshold = max(min_effect, noise_k * row.noise_cv * se)
    if row.p_value < alpha and abs(shift) > bound:
        row.verdict = IMPROVEMENT if row.change * METRIC_DIRECTIONS[metric] > 0 else REGRESSION
    else:
        row.verdict = UNCHANGED
    if row.verdict == REGRESSION and metric in TIME_METRICS:
        row.attribution = _attribute(base_runs, head_runs)
    return row


def compare(
    base: list[dict[str, Any]],
    head: list[dict[str, Any]],
    *,
    metrics: Sequence[str] | None = None,
    alpha: float = 0.01,
    min_effect: float = MIN_EFFECT,
    noise_k: float = NOISE_K,
    min_runs: int = 6,
    allow_insufficient: bool = False,
) -> CompareReport:
    """Compare repeated runs of `head` against `base`, per configuration and metric (see module doc)."""
    if min_runs < 2:
        raise ConfigError(f"min_runs must be at least 2 for a significance test, got {min_runs}")
    names = tuple(metrics) if metrics else DEFAULT_METRICS
    unknown = [m for m in names if m not in METRIC_DIRECTIONS]
    if unknown:
        raise ConfigError(f"unknown metric(s) {unknown}; known metrics: {', '.join(METRIC_DIRECTIONS)}")
    excluded: list[Excluded] = []
    sides: dict[str, dict[tuple, list[dict[str, Any]]]] = {}
    for side, results in (("base", base), ("head", head)):
        groups: dict[tuple, list[dict[str, Any]]] = {}
        for r in _usable(results, side, excluded):
            groups.setdefault(config_key(r), []).append(r)
        sides[side] = groups
    report = CompareReport([], excluded, alpha, min_runs, min_effect, noise_k, allow_insufficient)
    b_machines, h_machines = _machine(base), _machine(head)
    if base and head and b_machines != h_machines:
        report.notes.append(f"base ran on {', '.join(sorted(b_machines))}, head on {', '.join(sorted(h_machines))}: "
                            "throughput and memory are not comparable across machines")
    labels = {k: config_label(rs[0]["config"]) for g in sides.values() for k, rs in g.items()}
    for key in sorted(set(sides["base"]) | set(sides["head"]), key=lambda k: labels[k]):
        b, h = sides["base"].get(key, []), sides["head"].get(key, [])
        for metric in names:
            row = _compare_metric(key, labels[key], metric, b, h, alpha=alpha, min_effect=min_effect,
                                  noise_k=noise_k, min_runs=min_runs)
            if row is not None:
                report.rows.append(row)
    return report
