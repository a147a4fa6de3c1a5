"""A series drawn with its intervals and change points (matplotlib, Agg), for the series that changed: asv
0.6's own graphs draw neither the interval asv stores nor what distbench history found."""

from __future__ import annotations

from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from .report import Found  # noqa: E402
from .series import Series  # noqa: E402


def series_plot(series: Series, found: list[Found], path: Path) -> Path:
    """Each point with its interval (hollow where flagged), a dashed line before each change's first bad
    point, and each segment's median between the changes."""
    fig, ax = plt.subplots(figsize=(9, 4))
    xs = range(len(series.points))
    for x, p in zip(xs, series.points, strict=True):
        err = [[p.value - p.low], [p.high - p.value]] if p.low is not None and p.high is not None else None
        face = "none" if p.flagged else "C0"
        ax.errorbar(x, p.value, yerr=err, fmt="o", color="C0", markerfacecolor=face, capsize=2)
    index = {id(p): i for i, p in enumerate(series.points)}
    for f in found:
        at = index[id(f.first_bad)]
        ax.axvline(at - 0.5, color="C3", linestyle="--")
        ax.annotate(f"{f.change.percent:+.2f}%", (at - 0.5, f.change.after), color="C3", xytext=(4, 4),
                    textcoords="offset points")  # fmt: skip
    ax.set_xticks(list(xs), [p.commit[:7] for p in series.points], rotation=90, fontsize=7)
    ax.set_ylabel(series.unit)
    ax.set_title(f"{series.label} (hollow: flagged, left out)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
