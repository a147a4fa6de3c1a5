"""Markdown tables in the shape of seed 004: strategy x world size, throughput, scaling, time, MFU, memory.

Repeated runs of one configuration are aggregated by their median. Speedup and scaling efficiency follow
the one rule of distbench.scaling (the 1-rank baseline: `single` when it ran, else the same strategy).
"""

from __future__ import annotations

from typing import Any

from ..config import config_label
from ..errors import first_line
from ..measure.timing import step_stats
from ..metrics import METRICS, fmt_metric
from ..plausibility import check
from .gaps import SHORTFALL_NOTE, reference_table, shortfall_table
from .tables import (
    MEMORY_METRICS,
    Cell,
    cells_by_workload,
    fmt_value,
    has_device_memory,
    md_table,
    rank_noun,
    scaling_of,
    workload_title,
)


def machine_line(env: dict[str, Any]) -> str:
    gpus = f"{env.get('gpu_count')}x {env.get('gpu_model')}" if env.get("gpu_count") else "CPU only"
    sw = ", ".join(
        f"{k} {env[k]}"
        for k in ("torch", "cuda", "nccl", "driver", "deepspeed", "transformers")
        if env.get(k)
    )
    commit = f", commit {str(env['git_commit'])[:12]}" if env.get("git_commit") else ""
    return f"{gpus}" + (f"; {sw}" if sw else "") + commit


def cell_warnings(cell: Cell, found: dict[str, list[str]]) -> list[str]:
    """The distinct plausibility warnings of a cell's runs (`found` is `plausibility.check` of the report)."""
    return list(dict.fromkeys(w for r in cell.runs for w in found.get(r["id"], [])))


def throughput_table(cells: list[Cell], found: dict[str, list[str]]) -> list[str]:
    rows = []
    for c in cells:
        speedup, eff = scaling_of(cells, c)
        p10, p90 = c.step("p10"), c.step("p90")
        spread = f" [{p10 * 1000:.1f}–{p90 * 1000:.1f}]" if p10 is not None and p90 is not None else ""
        median = c.step("median") or c.metric("step_time_s")
        rows.append(
            [
                c.strategy,
                str(c.world_size),
                str(len(c.runs)),
                fmt_metric("tokens_per_s", c.metric("tokens_per_s")),
                fmt_metric("tokens_per_s", c.metric("tokens_per_s_per_gpu")),
                fmt_value(speedup, ".2f", "x"),
                fmt_metric("scaling_efficiency", eff),
                fmt_value(None if median is None else median * 1000, ".1f", spread),
                fmt_metric("mfu", c.metric("mfu")),
                c.throttled(),
                f"**{n}**" if (n := len(cell_warnings(c, found))) else "—",
            ]
        )
    noun = rank_noun(cells[0].cfg)
    return md_table(
        [
            "Strategy",
            f"{noun}s",
            "Runs",
            "Tokens/s",
            f"Tokens/s/{noun}",
            f"Speedup vs 1 {noun}",
            "Scaling eff.",
            "Step time ms median [p10–p90]",
            "MFU",
            "Throttled",
            "Warnings",
        ],
        rows,
    )


def warnings_list(cells: list[Cell], found: dict[str, list[str]]) -> list[str]:
    """One bullet per plausibility warning under a throughput table; none when nothing is implausible."""
    return [f"- {c.strategy} ws{c.world_size}: {w}" for c in cells for w in cell_warnings(c, found)]


def memory_table(cells: list[Cell]) -> list[str]:
    rows = [
        [c.strategy, str(c.world_size)] + [fmt_metric(m, c.metric(m)) for m in MEMORY_METRICS] for c in cells
    ]
    return md_table(["Strategy", "GPUs", *(METRICS[m].label for m in MEMORY_METRICS)], rows)


TRACE_COLUMNS = (
    ("compute_ms", "Compute ms", ".1f"),
    ("non_compute_ms", "Non-compute ms", ".1f"),
    ("idle_ms", "Idle ms", ".1f"),
    ("compute_pct", "Compute %", ".2f"),
    ("non_compute_pct", "Non-compute %", ".2f"),
    ("idle_pct", "Idle %", ".2f"),
    ("overlap_pct", "Comm overlap %", ".2f"),
    ("exposed_comm_ms", "Exposed comm ms", ".1f"),
)


def trace_table(cells: list[Cell]) -> list[str]:
    rows = [
        [c.strategy, str(c.world_size)] + [fmt_value(c.trace(k), spec) for k, _, spec in TRACE_COLUMNS]
        for c in cells
        if c.has_trace
    ]
    return md_table(["Strategy", "GPUs", *(title for _, title, _ in TRACE_COLUMNS)], rows)


def spread_table(cells: list[Cell]) -> list[str]:
    """Run-to-run spread of configurations run 3+ times: separate runs, not steps of one run (seed 004's
    repeat target is a coefficient of variation of at most 0.3%)."""
    rows = []
    for c in cells:
        tps = [t for t in ((r.get("metrics") or {}).get("tokens_per_s") for r in c.runs) if t is not None]
        if len(tps) >= 3:
            st = step_stats(tps)  # the same median and sample CV as a run's step times
            rows.append(
                [
                    c.strategy,
                    str(c.world_size),
                    str(len(tps)),
                    fmt_value(min(tps), ",.0f"),
                    fmt_value(st["median"], ",.0f"),
                    fmt_value(max(tps), ",.0f"),
                    f"{100 * st['cv']:.2f}%",
                ]
            )
    return (
        md_table(["Strategy", "GPUs", "Separate runs", "Tokens/s min", "median", "max", "CV"], rows)
        if rows
        else []
    )


def kernel_diff_sections(cells: list[Cell], top: int = 8) -> list[str]:
    """Seed 004 section 4.5: what changes between strategies at the kernel level, each traced strategy
    against DDP at the same GPU count (the largest changes first)."""
    from ..measure.trace import kernel_diff
    from .trace import render_kernel_diff_markdown

    def traced(c: Cell) -> dict[str, Any] | None:
        return next((r["trace"] for r in c.runs if (r.get("trace") or {}).get("top_kernels")), None)

    lines: list[str] = []
    traces = [(c, t) for c in cells if (t := traced(c)) is not None]
    base = {c.world_size: t for c, t in traces if c.strategy == "ddp"}
    for c, t in traces:
        if c.strategy == "ddp" or c.world_size not in base:
            continue
        diff = kernel_diff(base[c.world_size], t, top=top)
        lines += [
            "",
            f"#### ddp → {c.strategy}, {c.world_size} GPUs (per step, top {top} changes)",
            "",
            render_kernel_diff_markdown(diff, "ddp", c.strategy, name_width=70).rstrip("\n"),
        ]
    return lines


def failures_table(results: list[dict[str, Any]]) -> list[str]:
    bad = [r for r in results if r.get("status") != "ok"]
    return (
        md_table(
            ["Config", "Status", "Error"],
            [[config_label(r["config"]), str(r.get("status")), first_line(r.get("error"), 200)] for r in bad],
        )
        if bad
        else []
    )


def machines(results: list[dict[str, Any]]) -> list[str]:
    return sorted({machine_line(r.get("env") or {}) for r in results})


def report_markdown(results: list[dict[str, Any]], images: dict[tuple, list[tuple[str, str]]]) -> str:
    """The full report; `images` maps a workload to (caption, relative path) pairs to embed."""
    from .nodes import node_scaling_table

    lines = [
        "# distbench report",
        "",
        f"{len(results)} results.",
        "",
        "Machine: " + "; ".join(machines(results)),
    ]
    lines += [
        "",
        "Speedup is tokens/s over the 1-rank baseline of the same workload (`single` when it ran, "
        "else the same strategy on 1 rank): measured side by side with it, the paired windows' ratio, "
        "else the ratio of the two runs' medians; scaling efficiency = speedup / ranks. Step times are medians "
        "over steady-state steps, [p10–p90] their spread; repeated runs are aggregated by median. "
        "Throttled runs are not comparable. Figures the plausibility checks reject (superlinear scaling "
        "beyond noise, a speedup within noise, a run far below its repeats, a step-time spread wider than "
        "its median) are counted under Warnings and listed below their table: they are not results.",
    ]
    found = check(results)
    for wk, cells in cells_by_workload(results).items():
        lines += ["", f"## {workload_title(cells[0].cfg)}", "", "### Throughput and scaling", ""]
        lines += throughput_table(cells, found)
        warned = warnings_list(cells, found)
        if warned:
            lines += ["", "### Implausible figures (warnings, not results)", ""] + warned
        against = reference_table(cells)
        if against:
            lines += ["", "### Against the reference", ""] + against
        short = shortfall_table([r for c in cells for r in c.runs])
        if short:
            lines += ["", "### Shortfalls and their trace breakdown", "", SHORTFALL_NOTE, ""] + short
        nodes = node_scaling_table(cells)
        if nodes:
            lines += ["", "### Within a node and across nodes", ""] + nodes
        if has_device_memory(cells):
            lines += ["", "### Peak memory per GPU", ""] + memory_table(cells)
        if any(c.has_trace for c in cells):
            lines += ["", "### Trace breakdown (compute / non-compute / idle)", ""] + trace_table(cells)
            diffs = kernel_diff_sections(cells)
            if diffs:
                lines += ["", "### Kernel changes against DDP"] + diffs
        spread = spread_table(cells)
        if spread:
            lines += ["", "### Run-to-run spread (separate runs)", ""] + spread
        for caption, path in images.get(wk, []):
            lines += ["", f"![{caption}]({path})"]
    failures = failures_table(results)
    if failures:
        lines += ["", "## Failed runs", ""] + failures
    return "\n".join(lines) + "\n"


def job_summary_markdown(results: list[dict[str, Any]]) -> str:
    """A compact summary for $GITHUB_STEP_SUMMARY: machine, throughput tables and failures."""
    ok = sum(r.get("status") == "ok" for r in results)
    lines = [f"## distbench: {ok}/{len(results)} runs ok", ""]
    if results:
        lines += ["Machine: " + "; ".join(machines(results)), ""]
    found = check(results)
    for cells in cells_by_workload(results).values():
        lines += [f"### {workload_title(cells[0].cfg)}", ""] + throughput_table(cells, found) + [""]
        warned = warnings_list(cells, found)
        if warned:
            lines += ["Implausible figures (warnings, not results):", ""] + warned + [""]
    failures = failures_table(results)
    if failures:
        lines += ["### Failed runs", ""] + failures
    return "\n".join(lines) + "\n"
