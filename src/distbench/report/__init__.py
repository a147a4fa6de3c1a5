"""Reports from results: report.md with seed-004-style tables, PNG figures, and a GitHub job summary.

matplotlib is imported only by `write_report`, so the tables (used by the compare gate) stay cheap to import.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from .markdown import job_summary_markdown, report_markdown
from .tables import Cell, cells_by_workload, has_device_memory, rank_noun

__all__ = ["write_report", "job_summary_markdown"]


def _slug(cfg: dict[str, Any]) -> str:
    raw = (
        f"{cfg.get('model')}-{cfg.get('precision')}-s{cfg.get('seq_len')}-gb{cfg.get('global_batch')}"
        f"-mb{cfg.get('micro_batch')}" + ("-compiled" if cfg.get("compile") else "")
    )
    return re.sub(r"[^A-Za-z0-9._-]+", "_", raw)


def write_report(results: list[dict[str, Any]], out_dir: str | os.PathLike[str]) -> Path:
    """Write `out_dir/report.md` and its figures (one set per workload); return the report's path."""
    from ..plausibility import check
    from . import plots

    out = Path(out_dir)
    found = check(results)
    out.mkdir(parents=True, exist_ok=True)
    images: dict[tuple, list[tuple[str, str]]] = {}
    for wk, cells in cells_by_workload(results).items():
        slug = _slug(cells[0].cfg)
        figs: list[tuple[str, Callable[[list[Cell], Path], Path], str]] = [
            (
                f"Throughput vs {rank_noun(cells[0].cfg)} count",
                partial(plots.throughput_plot, found=found),
                f"throughput-{slug}.png",
            )
        ]
        if has_device_memory(cells):
            figs.append(("Peak memory per GPU", plots.memory_plot, f"memory-{slug}.png"))
        if any(c.has_trace for c in cells):
            figs.append(
                ("Compute / non-compute / idle breakdown", plots.breakdown_plot, f"breakdown-{slug}.png")
            )
        images[wk] = [(caption, fn(cells, out / name).name) for caption, fn, name in figs]
    path = out / "report.md"
    path.write_text(report_markdown(results, images))
    return path
