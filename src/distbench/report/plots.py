"""PNG figures for a report (matplotlib, Agg: no display on CI runners)."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..metrics import GIB, METRICS  # noqa: E402
from ..scaling import baseline_tokens_per_s  # noqa: E402
from .tables import MEMORY_METRICS, Cell, workload_title  # noqa: E402


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def throughput_plot(cells: list[Cell], path: Path) -> Path:
    """tokens/s vs GPU count, one line per strategy, with ideal linear scaling from the 1-GPU baseline."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    sizes: set[int] = set()
    for strategy in sorted({c.strategy for c in cells}):
        pts = sorted(
            (c.world_size, c.metric("tokens_per_s"))
            for c in cells
            if c.strategy == strategy and c.metric("tokens_per_s") is not None
        )
        if pts:
            ax.plot(*zip(*pts, strict=True), marker="o", label=strategy)
            sizes.update(ws for ws, _ in pts)
    # the ideal line starts at the workload's 1-GPU baseline, the one the speedups are stated against
    base = baseline_tokens_per_s(
        [r for c in cells for r in c.runs], {"config": {**cells[0].cfg, "strategy": "single"}}
    )
    if base and sizes:
        xs = sorted(sizes | {1})
        ax.plot(xs, [base * x for x in xs], "k--", linewidth=0.8, label="ideal (linear)")
    ax.set(xlabel="GPUs", ylabel="tokens/s", title=workload_title(cells[0].cfg))
    ax.set_xticks(sorted(sizes) or [1])
    ax.title.set_fontsize(9)
    ax.legend(fontsize=8)
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
