"""The trace analysis as markdown: seed 004's breakdown, overlap and kernel-diff tables, from what
measure/trace.py's analyze_traces and kernel_diff return."""

from __future__ import annotations

from typing import Any


def _fmt(x: float | None, digits: int = 2, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:,.{digits}f}{suffix}"


def _fmt_count(x: float, sign: bool = False) -> str:
    """Counts are whole numbers in totals but may be fractional per step."""
    spec = ("+" if sign else "") + (",.0f" if float(x).is_integer() else ",.2f")
    return format(x, spec)


def render_breakdown_markdown(rows: dict[str, dict[str, Any]]) -> str:
    """Seed 004 tables 4.3.1 (time breakdown) and 4.4.1 (overlap) for strategy -> analyze_traces result."""
    lines = [
        "| Strategy | Idle Time (ms) | Compute Time (ms) | Non-Compute Time (ms) | Kernel Time (ms) "
        "| Idle % | Compute % | Non-Compute % |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {_fmt(r['idle_ms'])} | {_fmt(r['compute_ms'])} | {_fmt(r['non_compute_ms'])} "
            f"| {_fmt(r['kernel_ms'])} | {_fmt(r['idle_pct'], suffix='%')} | {_fmt(r['compute_pct'], suffix='%')} "
            f"| {_fmt(r['non_compute_pct'], suffix='%')} |"
        )
    lines += [
        "",
        "| Strategy | Overlap % | Communication (ms) | Exposed Communication (ms) |",
        "|---|---|---|---|",
    ]
    for name, r in rows.items():
        lines.append(
            f"| {name} | {_fmt(r['overlap_pct'], suffix='%')} | {_fmt(r['comm_ms'])} "
            f"| {_fmt(r['exposed_comm_ms'])} |"
        )
    return "\n".join(lines) + "\n"


def render_kernel_diff_markdown(
    diff: list[dict[str, Any]], name_a: str, name_b: str, name_width: int = 100
) -> str:
    """Seed 004 section 4.5 table for a `kernel_diff` result; names past `name_width` lose their middle,
    since templated kernel names run to hundreds of characters (the JSON keeps them whole)."""
    lines = [
        f"| Operation | {name_a} Duration (us) | {name_b} Duration (us) | Difference (us) | Count Change | Status |",
        "|---|---|---|---|---|---|",
    ]
    for r in diff:
        name = r["name"]
        if len(name) > name_width:
            # keep both ends: the kernel, and the functor or type that tells its variants apart
            head = name_width // 2
            name = name[:head] + "…" + name[len(name) - (name_width - head - 1) :]
        name = name.replace("|", "\\|")
        change = (
            f"{_fmt_count(r['a_count'])}→{_fmt_count(r['b_count'])} ({_fmt_count(r['count_change'], True)})"
        )
        lines.append(
            f"| `{name}` | {_fmt(r['a_us'], 0)} | {_fmt(r['b_us'], 0)} | {r['diff_us']:+,.0f} | {change} "
            f"| {r['status']} |"
        )
    return "\n".join(lines) + "\n"
