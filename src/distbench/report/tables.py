"""The pieces every report table is built from (markdown tables, the runs of a configuration as a Cell, a
workload's cells), and the console table `distbench run` prints."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

from ..metrics import names
from ..results import config_key
from ..scaling import baseline_tokens_per_s

#: Peak device memory per GPU: torch allocated, torch reserved, NVML (adds NCCL buffers and the CUDA context).
MEMORY_METRICS = names(unit="bytes")


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub markdown table as lines ('|' in cells escaped)."""

    def cells(xs: Sequence[str]) -> str:
        return "| " + " | ".join(str(x).replace("|", "\\|") for x in xs) + " |"

    return [cells(head), "|" + "---|" * len(head), *(cells(r) for r in rows)]


def workload_key(cfg: dict[str, Any]) -> tuple:
    """What a strategy x world size table holds fixed."""
    return (
        cfg.get("model"),
        cfg.get("precision"),
        cfg.get("seq_len"),
        cfg.get("global_batch"),
        cfg.get("micro_batch"),
        bool(cfg.get("compile")),
    )


def workload_title(cfg: dict[str, Any]) -> str:
    title = (
        f"{cfg.get('model')} · precision {cfg.get('precision')} · seq {cfg.get('seq_len')} · "
        f"global batch {cfg.get('global_batch')} · micro-batch {cfg.get('micro_batch')}"
    )
    return title + (" · torch.compile" if cfg.get("compile") else "")


def _median(values: list[Any]) -> float | None:
    """Median of the finite numbers among `values` (metrics missing from some runs are None)."""
    xs = [x for x in values if isinstance(x, (int, float)) and math.isfinite(x)]
    return statistics.median(xs) if xs else None


class Cell:
    """The runs of one configuration, aggregated by median."""

    def __init__(self, runs: list[dict[str, Any]]) -> None:
        self.runs = runs
        self.cfg = runs[0]["config"]
        self.strategy: str = self.cfg.get("strategy")
        self.world_size: int = int(self.cfg.get("world_size") or 1)

    def metric(self, name: str) -> float | None:
        return _median([(r.get("metrics") or {}).get(name) for r in self.runs])

    def step(self, stat: str) -> float | None:
        return _median([(r.get("step_time_s") or {}).get(stat) for r in self.runs])

    def trace(self, name: str) -> float | None:
        return _median([(r.get("trace") or {}).get(name) for r in self.runs])

    @property
    def has_trace(self) -> bool:
        return any(r.get("trace") for r in self.runs)

    def throttled(self) -> str:
        sampled = [r["nvml"] for r in self.runs if r.get("nvml")]
        if not sampled:
            return "n/a"
        n = sum(bool(s.get("throttled")) for s in sampled)
        return f"**yes** ({n}/{len(sampled)})" if n else "no"


def cells_by_workload(results: list[dict[str, Any]]) -> dict[tuple, list[Cell]]:
    """ok results -> {workload: [Cell per (strategy, world size)]}, `single` first, then by strategy and size."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in results:
        if r.get("status") == "ok":
            groups.setdefault(config_key(r), []).append(r)
    out: dict[tuple, list[Cell]] = {}
    for runs in groups.values():
        cell = Cell(runs)
        out.setdefault(workload_key(cell.cfg), []).append(cell)
    for cells in out.values():
        cells.sort(key=lambda c: (c.strategy != "single", c.strategy, c.world_size))
    return out


def scaling_of(cells: list[Cell], cell: Cell) -> tuple[float | None, float | None]:
    """(speedup vs 1 GPU, scaling efficiency) of a cell's median tokens/s, by the one rule of scaling.py."""
    runs = [r for c in cells for r in c.runs]
    base, tps = baseline_tokens_per_s(runs, cell.runs[0]), cell.metric("tokens_per_s")
    if base and tps:
        return tps / base, tps / base / cell.world_size
    return None, None


def fmt_value(v: float | None, spec: str, suffix: str = "") -> str:
    """`v` formatted by `spec` with `suffix`, or a dash for a missing value."""
    return "—" if v is None else f"{v:{spec}}{suffix}"


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**30:.2f}"


def results_table(results: list[dict[str, Any]]):
    """A seed-004-style console table: throughput, speedup, efficiency, step time, MFU, memory; each
    plausibility warning is a numbered footnote, marked in its row's status ("! 1,2")."""
    from rich.markup import escape
    from rich.table import Table

    workloads = sorted(
        {
            f"{r['config']['model']} {r['config']['precision']} seq {r['config']['seq_len']} "
            f"global batch {r['config']['global_batch']}"
            for r in results
        }
    )
    t = Table(
        "strategy",
        "ws",
        "tok/s",
        "tok/s/GPU",
        "speedup",
        "eff",
        "step s [p10-p90]",
        "MFU",
        "peak GiB alloc/resv/nvml",
        "loss",
        "status",
        title="; ".join(workloads),
        caption_justify="left",
    )
    notes: list[str] = []
    for r in results:
        c, m = r["config"], r["metrics"]
        st = r.get("step_time_s") or {}
        step = f"{st['median']:.3f} [{st['p10']:.3f}-{st['p90']:.3f}]" if st else "-"
        nvml = r.get("nvml") or {}
        status = r["status"] + (" throttled" if nvml.get("throttled") else "")
        marks = []
        for w in r.get("warnings") or []:
            notes.append(f"[yellow]! {len(notes) + 1}[/] {c['strategy']} ws{c['world_size']}: {escape(w)}")
            marks.append(str(len(notes)))
        if marks:
            status += f" [yellow]! {','.join(marks)}[/]"
        losses = r.get("losses") or []
        mem = "/".join(_gib(m.get(k)) for k in MEMORY_METRICS)
        t.add_row(
            c["strategy"],
            str(c["world_size"]),
            f"{m['tokens_per_s']:,.0f}" if "tokens_per_s" in m else "-",
            f"{m['tokens_per_s_per_gpu']:,.0f}" if "tokens_per_s_per_gpu" in m else "-",
            f"{m['speedup']:.2f}x" if "speedup" in m else "-",
            f"{m['scaling_efficiency']:.0%}" if "scaling_efficiency" in m else "-",
            step,
            f"{m['mfu']:.1%}" if "mfu" in m else "-",
            mem,
            f"{losses[-1]:.4f}" if losses else "-",
            status,
        )
    if notes:
        t.caption = "Implausible, not results:\n" + "\n".join(notes)
    return t
