"""A bisect's progress line per probe, and its report: bisect.md and bisect.json, every probe with its cost,
interval and verdict."""

from __future__ import annotations

from typing import Any

from ..errors import first_line
from ..gate.bisect import METRIC_ORDER, Bisection, ProbeRecord, Verdict, step_time_reason
from .tables import md_table

SCHEMA = "distbench.bisect/1"

#: What a probe's outcome means, by kind.
MEANING = {
    ("confirm", "bad"): "bad is slower than good: bisecting",
    ("confirm", "good"): "bad is not slower than good",
    ("search", "bad"): "matches the bad end",
    ("search", "good"): "matches the good end",
    ("remainder", "bad"): "the bad end is slower still: a further regression after this one",
    ("remainder", "good"): "it accounts for the bad end's slowdown",
    ("end", "bad"): "fails",
    ("end", "good"): "passes",
}


def _interval(r: ProbeRecord) -> str:
    row = r.row() or (r.rows[0] if r.kind == "confirm" and r.rows else None)
    if row is None or row.estimate is None:
        return "—"
    return f"{row.metric} {row.estimate:+.2%} [{row.low:+.2%}, {row.high:+.2%}] {row.verdict.upper()}"


def _what(b: Bisection, r: ProbeRecord) -> str:
    if r.base is None:
        return b.name(r.head)
    return f"{b.name(r.head)} against {b.name(r.base)}"


def meaning(r: ProbeRecord) -> str:
    if r.outcome == "skip":
        return "skipped: it could not be run" if r.kind != "confirm" else "an end could not be run"
    if r.failed:
        return f"not compared: its {r.failed} could not be run"
    if r.outcome == "undecided":
        return "undecided"
    return MEANING[(r.kind, r.outcome)]


def probe_line(b: Bisection, r: ProbeRecord) -> str:
    """One probe as it ends, for the terminal."""
    number = next(i for i, p in enumerate(b.probes, 1) if p is r)
    cost = f"{r.pairs} pairs, {r.seconds:.0f} s" if b.setup.mode == "perf" else f"{r.seconds:.0f} s"
    line = f"probe {number} ({r.kind}): {_what(b, r)}: {_interval(r)} -> {meaning(r)}; {cost}"
    if r.kind == "confirm" and r.metric:
        line += f"\n  {metric_reason(b)}"
    if r.error:
        line += f"\n  {first_line(r.error, 300)}"
    if r.kind == "search" and b.next_step() is not None:
        lo, hi = b.bounds()
        line += f"\n  range now: after {b.name(lo)}, up to {b.name(hi)}"
    return line


def metric_reason(b: Bisection) -> str:
    """Which metric the bisect follows and why, with what moved in the confirm."""
    c = b.confirm
    if c is None or not c.metric:
        return ""
    moved = ", ".join(f"{r.metric} {r.estimate:+.2%}" for r in c.rows if r.gated and r.estimate is not None)
    why = step_time_reason(c.rows) if c.metric == "step_time_s" else METRIC_ORDER.get(c.metric, "it moved")
    return (
        f"bisecting on {c.metric}: {why} (bad against good: {moved}); a midpoint matches the good end once a "
        f"slowdown of {b.probe_threshold:.2%} is ruled out"
    )


def _remainder(v: Verdict) -> str:
    return {
        "bad": "The remainder is still slower: the bad end is slower than the first bad one, so a further "
        "regression lies after it (bisect again with it as --good).",
        "good": "The first bad one accounts for the bad end's slowdown: the remainder is not slower.",
        "undecided": "Whether the remainder is slower still could not be decided.",
    }.get(v.remainder or "", "")


def to_markdown(b: Bisection, v: Verdict) -> str:
    s = b.setup
    lines = [f"## distbench bisect: {v.message} (exit {v.exit_code})", ""]
    lines.append(f"{s.source}: {b.n} after the good end {b.name(0)}, up to the bad end {b.name(b.n)}.  ")
    if s.mode == "test":
        lines.append(f"Test: `{s.nodeid}`: passed is good, failed is bad, anything else is skipped.")
    else:
        config = s.config or {}
        lines.append(
            f"Configuration: {config.get('strategy')} ws{config.get('world_size')} {config.get('model')} "
            f"{config.get('precision')} mb{config.get('micro_batch')}.  "
        )
        if reason := metric_reason(b):
            lines.append(reason[0].upper() + reason[1:] + ".  ")
        lines.append(
            f"Each probe is the A/B gate against the good end, at a family-wise {b.probe_alpha:.4f} (the "
            f"bisect's {s.gate.alpha} over {b.planned} planned comparisons); {b.alpha_spent():.4f} spent."
        )
    rem = _remainder(v)
    if rem:
        lines += ["", rem]
    lines += ["", *md_table(HEAD, rows(b))]
    pairs = sum(r.pairs for r in b.probes)
    seconds = sum(r.seconds for r in b.probes)
    tail = f"{len(b.probes)} probes, {pairs} pairs, {seconds:.0f} s." if s.mode == "perf" else ""
    lines += ["", tail or f"{len(b.probes)} probes, {seconds:.0f} s."]
    return "\n".join(lines) + "\n"


HEAD = ["#", "Probe", "Candidate", "Against", "Pairs", "Seconds", "Effect [interval], verdict", "Outcome"]


def rows(b: Bisection) -> list[list[str]]:
    out = []
    for i, r in enumerate(b.probes, 1):
        note = meaning(r) + (f" ({first_line(r.error, 120)})" if r.error else "")
        out.append(
            [
                str(i),
                r.kind,
                b.name(r.head),
                "—" if r.base is None else b.name(r.base),
                str(r.pairs),
                f"{r.seconds:.0f}",
                _interval(r),
                note.replace("|", "/"),
            ]
        )
    return out


def to_json(b: Bisection, v: Verdict) -> dict[str, Any]:
    """Everything the outcome rests on: every probe with its cost, interval and verdict."""
    labels = [c.label for c in b.setup.candidates]
    return {
        "schema": SCHEMA,
        "status": v.status,
        "exit_code": v.exit_code,
        "message": v.message,
        "last_good": labels[v.lo],
        "first_bad": [labels[i] for i in v.first_bad],
        "range": [v.lo, v.hi],
        "remainder": v.remainder,
        "metric": b.confirm.metric if b.confirm else None,
        "metric_reason": metric_reason(b),
        "probe_threshold": b.probe_threshold if b.setup.mode == "perf" else None,
        "planned_comparisons": b.planned,
        "probe_alpha": b.probe_alpha if b.setup.mode == "perf" else None,
        "alpha_spent": b.alpha_spent(),
        "seconds": sum(r.seconds for r in b.probes),
        "pairs": sum(r.pairs for r in b.probes),
        "setup": b.setup.model_dump(mode="json"),
        "probes": [
            {"candidate": labels[r.head], "against": None if r.base is None else labels[r.base]}
            | r.model_dump(mode="json")
            for r in b.probes
        ],
    }
