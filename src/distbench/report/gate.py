"""The A/B gate's report: one row per configuration and metric, as markdown and as a rich table."""

from __future__ import annotations

from typing import Any

from ..gate.ab import ABReport, ConfigOutcome, Row
from ..gate.numerics import EXIT_DIVERGED, exit_status
from ..gate.stats import REGRESSION, UNDECIDED
from ..metrics import METRICS, fmt_metric
from . import numerics
from .tables import md_table

#: The verdict of a configuration, or the heading of a report, where no pair ran: no comparison was made.
NOT_COMPARED = "NOT COMPARED"


def level(report: ABReport) -> str:
    """The confidence level of every interval in the report, as a percentage (98.75% at alpha 5% over 4)."""
    return f"{100 * (1 - report.per_test_alpha):.4g}%"


def head(report: ABReport) -> list[str]:
    """The speed table's columns. The effect's interval is named with its level, the one the verdict is
    decided by; the rank test's p stays in ab.json (criteria says why it decides nothing)."""
    return [
        "Config",
        "Regime",
        "Metric",
        "Pairs",
        "Base median",
        "Head median",
        f"Effect [{level(report)} CI]",
        "Detectable",
        "Verdict",
    ]


def _regime(o: ConfigOutcome) -> str:
    r = o.regime or {}
    return f"{r['regime']} ({r['busy_ratio']:.2f})" if r.get("regime") else "—"


def _cells(o: ConfigOutcome, r: Row) -> list[str]:
    import statistics

    e = r.effect
    eff = "—" if e is None else f"{e.estimate:+.2%} [{e.low:+.2%}, {e.high:+.2%}]"
    return [
        o.label,
        _regime(o),
        r.metric + ("" if r.gated else " (reported)"),
        str(len(r.base)),
        fmt_metric(r.metric, statistics.median(r.base)),
        fmt_metric(r.metric, statistics.median(r.head)),
        eff,
        "—" if e is None else f"±{e.detectable:.2%}",
        r.verdict.upper() if r.gated else "—",
    ]


def rows(report: ABReport) -> list[list[str]]:
    out = []
    for o in report.outcomes:
        if o.error:
            out.append(
                [
                    o.label,
                    _regime(o),
                    "—",
                    str(len(o.pairs)),
                    "—",
                    "—",
                    "—",
                    "—",
                    f"{'UNDECIDED' if o.pairs else NOT_COMPARED} ({o.error})",
                ]
            )
        out += [_cells(o, r) for r in o.rows]
    return out


def summary(report: ABReport) -> str:
    """The report's heading: its status, what each configuration came to, its time. A report in which no pair
    ran (a variant that failed at its first run: a commit that does not import) is no comparison, and is
    headed by the failure instead."""
    took = f"{report.elapsed_s:.0f} s" + (" (time budget ran out)" if report.budget_exhausted else "")
    if report.numerics:
        first = numerics.summary(report.numerics)
        if not report.speed:
            return f"{first}; speed not compared (exit {report.exit_code})"
        return f"{first}; speed: {speed_summary(report, took)}"
    return speed_summary(report, took)


def speed_summary(report: ABReport, took: str) -> str:
    """summary's part on speed."""
    if not any(o.pairs for o in report.outcomes):
        never = next((o.error for o in report.outcomes if o.error), "no configuration ran")
        return f"{NOT_COMPARED}: {never} (exit {report.exit_code}); {took}"
    counts: dict[str, int] = {}
    for o in report.outcomes:
        counts[o.verdict] = counts.get(o.verdict, 0) + 1
    head = {
        REGRESSION: "FAIL: regression",
        UNDECIDED: "UNDECIDED: could not rule out a regression",
        "pass": "PASS",
    }[report.status]
    parts = ", ".join(f"{n} {v}" for v, n in sorted(counts.items()))
    return f"{head} (exit {report.exit_code}); {parts}; {took}"


def criteria(report: ABReport) -> str:
    windows = any(o.interleave == "windows" for o in report.outcomes)
    how = (
        "Paired runs alternating AB/BA, fresh processes each round, their timed windows interleaved "
        "(ABBA); step_time_s's effect per round = the 20%-trimmed mean of the adjacent windows' log "
        "ratios, other metrics' = the log ratio of the runs; a Student-t interval over rounds at "
        if windows
        else "Paired runs alternating AB/BA; effect = mean log ratio per pair with a Student-t interval at "
    )
    return (
        f"{how}"
        f"{level(report)} (family-wise alpha {report.alpha} over configurations, gated "
        f"metrics and looks); regression when the interval excludes 0 and the effect is at least "
        f"{report.min_effect:.1%}; unchanged when a regression of {report.threshold:.1%} is ruled out; "
        f"otherwise undecided. Detectable = smallest effect found with 80% power at this noise and count. "
        f"{rank_test_note(report)}"
    )


def rank_test_note(report: ABReport) -> str:
    """Why the Wilcoxon signed-rank p (ab.json's effect.p_value) is no verdict: with n pairs its exact
    two-sided value cannot fall below 2 / 2^n, which at the gate's pair counts stays above the per-test alpha
    (0.031 at 6 pairs against 1.25%), so it could not flag a regression whatever the data; the interval
    decides."""
    n = [r.effect.n for o in report.outcomes for r in o.rows if r.effect is not None]
    if not n:
        return ""
    floor = 2.0 ** (1 - min(n))
    why = (
        f"above the per-test alpha {report.per_test_alpha:.3g}, so it could not flag a regression"
        if floor > report.per_test_alpha
        else f"the per-test alpha is {report.per_test_alpha:.3g}"
    )
    return (
        f"The Wilcoxon signed-rank p (ab.json) is a cross-check that decides nothing: at {min(n)} pairs its "
        f"smallest value is {floor:.3g}, {why}."
    )


def ruled_out(o: ConfigOutcome, threshold: float) -> str:
    """What one configuration's comparison decided, in a line: the regression it found with its interval, or
    else the largest slowdown its gated metrics still allow (the top of their intervals, turned so that up is
    worse)."""
    gated = [r for r in o.rows if r.gated and r.effect is not None]
    if o.error or not gated:
        return f"{o.label}: nothing ruled out ({o.error or 'too few pairs for an interval'})"
    if o.verdict == REGRESSION:
        found = [r for r in gated if r.verdict == REGRESSION]
        return f"{o.label}: a regression found, nothing ruled out: " + "; ".join(
            f"{r.metric} {r.effect.estimate:+.2%} [{r.effect.low:+.2%}, {r.effect.high:+.2%}]"
            for r in found
            if r.effect
        )
    tops = {r.metric: r.effect.worse(METRICS[r.metric].direction)[2] for r in gated if r.effect}
    worst = max(tops, key=lambda m: tops[m])
    if tops[worst] < threshold:
        return f"{o.label}: a slowdown of more than {tops[worst]:+.2%} ruled out (widest: {worst})"
    return (
        f"{o.label}: could not rule out a {threshold:.0%} slowdown ({worst} may be up to {tops[worst]:+.2%}; "
        f"{len(o.pairs)} pairs)"
    )


def to_markdown(report: ABReport) -> str:
    lines = [
        f"## distbench ab: {summary(report)}",
        "",
        f"base: {report.base_desc}  ",
        f"head: {report.head_desc}",
        "",
    ]
    if not report.speed:
        return "\n".join([*lines, *numerics.to_markdown(report.numerics)]) + "\n"
    lines += [
        criteria(report),
        "",
        "What each configuration decided:",
        "",
        *[f"- {ruled_out(o, report.threshold)}" for o in report.outcomes],
        "",
    ]
    if report.sizing:
        lines += ["Sizes on this card (+AC: activation checkpointing):", ""]
        lines += [f"- {line}" for line in report.sizing] + [""]
    lines += md_table(head(report), rows(report))
    lines += ["", *numerics.to_markdown(report.numerics)] if report.numerics else []
    return "\n".join(lines) + "\n"


def to_rich(report: ABReport) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(*head(report), title="distbench ab", caption=criteria(report))
    for cells in rows(report):
        style = (
            "bold red"
            if cells[-1].startswith("REGRESSION")
            else "yellow"
            if cells[-1].startswith(("UNDECIDED", NOT_COMPARED))
            else ""
        )
        table.add_row(*cells, style=style)
    style = {REGRESSION: "bold red", UNDECIDED: "bold yellow"}.get(report.status, "bold green")
    ruled = "\n".join(ruled_out(o, report.threshold) for o in report.outcomes)
    if exit_status(report.numerics) == EXIT_DIVERGED:
        style = "bold red"
    parts: list[Any] = [Text(f"base: {report.base_desc}\nhead: {report.head_desc}")]
    parts += [table, Text(ruled)] if report.speed else []
    parts += [*numerics.to_rich(report.numerics), Text(summary(report), style=style)]
    return Group(*parts)


def to_json(report: ABReport) -> dict[str, Any]:
    """Everything the verdicts rest on, for the record (results/ and the job summary's artifact)."""

    def row(r: Row) -> dict[str, Any]:
        e = r.effect
        return {
            "metric": r.metric,
            "gated": r.gated,
            "base": r.base,
            "head": r.head,
            "verdict": r.verdict,
            "effect": None if e is None else e.__dict__,
        }

    return {
        "status": report.status,
        "exit_code": report.exit_code,
        "alpha": report.alpha,
        "per_test_alpha": report.per_test_alpha,
        "threshold": report.threshold,
        "min_effect": report.min_effect,
        "elapsed_s": report.elapsed_s,
        "budget_exhausted": report.budget_exhausted,
        "looks": list(report.looks),
        "sizing": list(report.sizing),
        "base": report.base_desc,
        "head": report.head_desc,
        "speed_compared": report.speed,
        "numerics": numerics.to_json(report.numerics),
        "configs": [
            {
                "label": o.label,
                "config": o.cfg.to_dict(),
                "verdict": o.verdict,
                "error": o.error,
                "regime": o.regime,
                "gated": list(o.gated),
                "device_metric": o.device,
                "ruled_out": ruled_out(o, report.threshold),
                "interleave": o.interleave,
                "note": o.note,
                "orders": [p.order for p in o.pairs],
                "window_log_ratios": [p.window_log_ratios for p in o.pairs],
                "base_ids": [p.base["id"] for p in o.pairs],
                "head_ids": [p.head["id"] for p in o.pairs],
                "rows": [row(r) for r in o.rows],
            }
            for o in report.outcomes
        ],
    }
