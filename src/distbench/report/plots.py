"""PNG figures for a report (matplotlib, Agg: no display on CI runners)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..metrics import GIB, METRICS  # noqa: E402
from ..scaling import baseline_runs, baseline_tokens_per_s  # noqa: E402
from .markdown import cell_warnings  # noqa: E402
from .tables import MEMORY_METRICS, Cell, rank_noun, workload_title  # noqa: E402


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _tps_spread(c: Cell, tps: float) -> tuple[float, float]:
    """How far below and above `tps` the tokens/s of the cell's p90 and p10 step times lie; (0, 0) where
    the step times' spread was not recorded."""
    med, p10, p90 = c.step("median"), c.step("p10"), c.step("p90")
    if not (med and p10 and p90):
        return 0.0, 0.0
    return tps - tps * med / p90, tps * med / p10 - tps


def throughput_plot(cells: list[Cell], path: Path, found: dict[str, list[str]]) -> Path:
    """tokens/s vs world size, one line per strategy, with ideal linear scaling from the 1-rank baseline.

    `found` is plausibility.check of the report: a point with a warning (listed by the report as implausible,
    not a result) is drawn hollow and left off its strategy's line, and an ideal line from a flagged baseline
    is dotted and says so. Bars span the tokens/s of the p10 and p90 step times.
    """
    noun = rank_noun(cells[0].cfg)
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    sizes: set[int] = set()
    flagged_any = False
    for i, strategy in enumerate(sorted({c.strategy for c in cells})):
        pts = sorted(
            (
                (c.world_size, tps, bool(cell_warnings(c, found)), c)
                for c in cells
                if c.strategy == strategy and (tps := c.metric("tokens_per_s")) is not None
            ),
            key=lambda p: p[0],
        )
        sound = [(ws, tps) for ws, tps, flagged, _ in pts if not flagged]
        ax.plot([ws for ws, _ in sound], [tps for _, tps in sound], marker="o", color=f"C{i}", label=strategy)
        for ws, tps, flagged, c in pts:
            ax.errorbar(
                ws,
                tps,
                yerr=[[v] for v in _tps_spread(c, tps)],
                color=f"C{i}",
                marker="o",
                markerfacecolor="white" if flagged else f"C{i}",
                capsize=3,
                alpha=0.6 if flagged else 1.0,
            )
            flagged_any |= flagged
            sizes.add(ws)
    # the ideal line starts at the workload's 1-rank baseline, the one the speedups are stated against
    runs = [r for c in cells for r in c.runs]
    probe = {"config": {**cells[0].cfg, "strategy": "single"}}
    base = baseline_tokens_per_s(runs, probe)
    if base and sizes:
        cold = any(found.get(r["id"]) for r in baseline_runs(runs, probe))
        xs = sorted(sizes | {1})
        label = "ideal (linear) from a flagged baseline" if cold else "ideal (linear)"
        ax.plot(xs, [base * x for x in xs], "k:" if cold else "k--", linewidth=0.8, label=label)
    if flagged_any:
        ax.plot([], [], "o", color="grey", markerfacecolor="white", label="flagged: not a result")
    ax.errorbar([], [], yerr=[], color="grey", capsize=3, label="bars: step time p10-p90")
    ax.set(xlabel=f"{noun}s", ylabel="tokens/s", title=workload_title(cells[0].cfg))
    ax.set_xticks(sorted(sizes) or [1])
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))  # beside the points, never on them
    ax.grid(alpha=0.3)
    return _save(fig, path)


def memory_plot(cells: list[Cell], path: Path) -> Path:
    """Peak allocated / reserved / NVML memory per GPU for every strategy x world size."""
    series = [(m, METRICS[m].label) for m in MEMORY_METRICS]
    labels = [f"{c.strategy}\n{c.world_size} GPU" for c in cells]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6, 1.1 * len(cells)), 4.5))
    for i, (metric, name) in enumerate(series):
        values = [(c.metric(metric) or 0.0) / GIB for c in cells]
        if any(values):
            ax.bar([x + (i - 1) * width for x in range(len(cells))], values, width, label=name)
    ax.set_xticks(range(len(cells)), labels, fontsize=8)
    ax.set(ylabel="GiB per GPU", title="Peak memory — " + workload_title(cells[0].cfg))
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def breakdown_plot(cells: list[Cell], path: Path) -> Path:
    """Compute / non-compute / idle shares of traced GPU time: stacked, and the overhead parts zoomed in.

    Compute is usually ~97% (seed 004), so a stacked bar alone hides the part that moves; the right panel
    shows non-compute and idle on their own scale.
    """
    traced = [c for c in cells if c.has_trace]
    labels = [f"{c.strategy}\n{c.world_size} GPU" for c in traced]
    parts = (
        ("compute_pct", "compute", "tab:green"),
        ("non_compute_pct", "non-compute", "tab:orange"),
        ("idle_pct", "idle", "tab:gray"),
    )
    xs = range(len(traced))
    fig, (stacked, zoom) = plt.subplots(1, 2, figsize=(max(8, 2 * len(traced)), 4.5))
    bottom = [0.0] * len(traced)
    for key, name, color in parts:
        values = [c.trace(key) or 0.0 for c in traced]
        stacked.bar(xs, values, 0.6, bottom=bottom, label=name, color=color)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    for i, (key, name, color) in enumerate(parts[1:]):
        zoom.bar(
            [x + (i - 0.5) * 0.35 for x in xs],
            [c.trace(key) or 0.0 for c in traced],
            0.35,
            label=name,
            color=color,
        )
    for ax, ylabel in ((stacked, "% of traced GPU time"), (zoom, "% (overhead only)")):
        ax.set_xticks(xs, labels, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle("Time breakdown — " + workload_title(traced[0].cfg), fontsize=9)
    return _save(fig, path)
