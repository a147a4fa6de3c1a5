"""The report's comparison with a published reference (a seed's figures) and its shortfalls, each split by
its trace breakdown (distbench.gaps)."""

from __future__ import annotations

from typing import Any

from ..gaps import GAP, explain, shortfalls
from .tables import Cell, fmt_value, md_table


def reference_table(cells: list[Cell]) -> list[str]:
    """Each configuration a reference has a figure for: the measured median beside it. Empty without one."""
    rows = []
    for c in cells:
        ref = c.runs[0].get("reference")
        tps = c.metric("tokens_per_s")
        if ref and tps:
            rows.append(
                [
                    c.strategy,
                    str(c.world_size),
                    fmt_value(tps, ",.0f"),
                    fmt_value(ref["tokens_per_s"], ",.0f"),
                    ref["title"],
                    f"{tps / ref['tokens_per_s']:.3f}",
                ]
            )
    head = ["Strategy", "GPUs", "Tokens/s", "Reference tokens/s", "Reference", "Measured / reference"]
    return md_table(head, rows) if rows else []


def _ms(x: float | None, sign: bool = False) -> str:
    return fmt_value(x, "+,.1f" if sign else ",.1f")


def shortfall_table(results: list[dict[str, Any]]) -> list[str]:
    """Each configuration more than GAP below DDP or its reference at its world size, and where its traced
    step's time went against DDP's (ms per step); "not traced" where the matrix did not trace it."""
    rows = []
    for short in shortfalls(results):
        why = explain(results, short)
        vs = (why or {}).get("vs_ddp") or {}
        rows.append(
            [
                short.strategy,
                str(short.world_size),
                fmt_value(short.tokens_per_s, ",.0f"),
                f"{short.against} ({short.target:,.0f})",
                f"{short.gap:.1%}",
                f"{_ms(why['step_ms'])} ({why['source']})" if why else "not measured",
                _ms(vs.get("step_ms"), True),
                _ms(vs.get("compute_ms"), True),
                _ms(vs.get("non_compute_ms"), True),
                _ms(vs.get("idle_ms"), True),
                _ms(vs.get("host_wait_ms"), True),
                vs.get("largest", "—"),
            ]
        )
    head = [
        "Strategy",
        "GPUs",
        "Tokens/s",
        "Below",
        "by",
        "Step ms (from)",
        "vs DDP: step",
        "compute",
        "non-compute",
        "idle",
        "host wait",
        "grew most",
    ]
    return md_table(head, rows) if rows else []


SHORTFALL_NOTE = (
    f"Configurations more than {GAP:.0%} below DDP at the same GPU count or below their reference figure, "
    "split against DDP's step (ms per step): compute, non-compute (copies, and communication that ran with "
    "nothing beside it) and idle. The split comes from each run's device-time sample (the step's length "
    "there is the sampled step's, synchronized before and after), or from HolisticTraceAnalysis where the "
    "run was traced (`--trace`, or `trace: [2]` in a matrix file), which also names the host wait: the GPU "
    "waiting for the host to launch its next kernel."
)
