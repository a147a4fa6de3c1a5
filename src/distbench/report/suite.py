"""`distbench ab --numerics suite`'s report (gate/suite_ab.py): per strategy, the invariant tests that fail under
head and pass under base, those that fail on both sides, and those head fixed."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from ..gate.suite_ab import MODULES, SuiteComparison
from .tables import md_table

HEAD = ["Strategy", "Fail under head only", "Fail on both", "Fail under base only"]


def summary(c: SuiteComparison) -> str:
    """One line: what the two test runs came to, and the exit status."""
    n = sum(len(v) for v in c.regressions.values())
    if n:
        head = f"SUITE: {n} test(s) fail under head and pass under base"
    elif c.errors:
        head = "suite NOT COMPARED: " + "; ".join(f"{side}: {why}" for side, why in c.errors.items())
    else:
        head = "suite: no test fails under head that passes under base"
    return f"{head} (exit {c.exit_code})"


def rows(c: SuiteComparison) -> list[list[str]]:
    names = sorted(set(c.regressions) | set(c.both) | set(c.fixed))
    return [
        [
            s,
            *(
                ", ".join(t.split("::")[-1] for t in d.get(s, [])) or "—"
                for d in (c.regressions, c.both, c.fixed)
            ),
        ]
        for s in names
    ]


def to_markdown(c: SuiteComparison, base: str, head: str) -> str:
    counts = "; ".join(
        f"{side}: " + ", ".join(f"{n} {k}" for k, n in by.items()) for side, by in c.counts.items()
    )
    lines = [
        "## distbench ab: the invariant tests under base and head",
        "",
        f"base: {base}; head: {head}. Tests: {', '.join(MODULES)}. {counts}.",
        "",
        f"**{summary(c)}**",
        "",
    ]
    return "\n".join(lines + (md_table(HEAD, rows(c)) if rows(c) else [])) + "\n"


def to_json(c: SuiteComparison, base: str, head: str) -> dict[str, Any]:
    return {"base": base, "head": head, "modules": list(MODULES), **asdict(c), "exit": c.exit_code}
