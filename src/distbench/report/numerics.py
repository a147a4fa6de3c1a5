"""The numerics comparison's part of `distbench ab`'s report (gate/numerics.py): a verdict per configuration,
the tolerance and how it was derived, and the loss and gradient norm of both variants step by step."""

from __future__ import annotations

from typing import Any

from ..gate.numerics import (
    DIVERGED,
    IDENTICAL,
    METRICS,
    NOT_COMPARED,
    RECIPES,
    SKIPPED,
    NumericsOutcome,
    tolerance_statement,
)
from .tables import md_table

VERDICT_HEAD = ["Config", "Recipe", "Numerics", "Detail"]
STEP_HEAD = ["Step", "Metric", "Base", "Head", "Head - base", "Tolerance", "Set by"]


def summary(outcomes: list[NumericsOutcome]) -> str:
    """One line: what the configurations' numerics came to."""
    counts: dict[str, int] = {}
    for o in outcomes:
        counts[o.kind] = counts.get(o.kind, 0) + 1
    head = (
        "NUMERICS DIVERGED"
        if DIVERGED in counts
        else "numerics NOT COMPARED"
        if NOT_COMPARED in counts
        else "numerics: the same loss"
    )
    return f"{head} ({', '.join(f'{n} {k}' for k, n in sorted(counts.items()))})"


def verdict_rows(outcomes: list[NumericsOutcome]) -> list[list[str]]:
    return [[o.label, o.recipe, o.kind.upper(), o.detail] for o in outcomes]


def step_rows(o: NumericsOutcome) -> list[list[str]]:
    """Every step and metric of one configuration (none where it was not compared)."""
    if o.base is None or o.head is None or o.tolerance is None:
        return []
    rows = []
    for step in range(len(o.base.loss)):
        for m in METRICS:
            b, h = o.base.values(m)[step], o.head.values(m)[step]
            rows.append(
                [
                    str(step),
                    m,
                    repr(b),
                    repr(h),
                    f"{h - b:+.3e}",
                    f"{o.tolerance.allowed(m, step):.3e}",
                    o.tolerance.source(m, step),
                ]
            )
    return rows


def versions(o: NumericsOutcome) -> str:
    """What each side's runs reported computing with, in a sentence."""
    return " ".join(
        f"{side}: " + ", ".join(f"{k} {v}" for k, v in o.versions[side].items() if v) + "."
        for side in ("base", "head")
        if o.versions.get(side)
    )


def to_markdown(outcomes: list[NumericsOutcome]) -> list[str]:
    if not outcomes:
        return []
    lines = ["### Numerics: head's loss and gradient norm against base's, deterministic mode", ""]
    lines += md_table(VERDICT_HEAD, verdict_rows(outcomes)) + [""]
    ran = dict.fromkeys(o.recipe for o in outcomes)
    lines += ["Recipes: " + "; ".join(f"{r}: {RECIPES[r]}" for r in ran if r in RECIPES) + ".", ""]
    for o in outcomes:
        if o.tolerance is not None:
            lines += [f"{o.label}, {o.recipe}: {tolerance_statement(o.tolerance)}. {versions(o)}", ""]
            lines += md_table(STEP_HEAD, step_rows(o)) + [""]
    return lines


def to_rich(outcomes: list[NumericsOutcome]) -> list[Any]:
    from rich.table import Table

    if not outcomes:
        return []
    out = []
    for o in outcomes:
        if o.tolerance is None or o.kind == IDENTICAL:  # the console shows the steps where they differ
            continue
        caption = f"{tolerance_statement(o.tolerance)}. {versions(o)}"
        steps = Table(*STEP_HEAD, title=f"numerics {o.label}, {o.recipe}", caption=caption)
        for cells in step_rows(o):
            steps.add_row(*cells)
        out.append(steps)
    verdicts = Table(*VERDICT_HEAD, title="numerics: head against base")
    for o, cells in zip(outcomes, verdict_rows(outcomes), strict=True):
        style = "bold red" if o.kind == DIVERGED else "yellow" if o.kind == NOT_COMPARED else ""
        style = "dim" if o.kind == SKIPPED else style
        verdicts.add_row(*cells, style=style)
    return [*out, verdicts]


def to_json(outcomes: list[NumericsOutcome]) -> list[dict[str, Any]]:
    return [o.to_json() for o in outcomes]
