"""The pieces every report table is built from (markdown tables, the runs of a configuration as a Cell, a
workload's cells), and the console table `distbench run` prints."""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from ..metrics import GIB, names
from ..plausibility import host_bound
from ..results import config_key
from ..scaling import baseline_tokens_per_s, paired_speedup

#: Peak device memory per GPU: torch allocated, torch reserved, NVML (adds NCCL buffers and the CUDA context).
MEMORY_METRICS = names(unit="bytes")


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A GitHub markdown table as lines: '|' in cells escaped, line breaks folded (a row is one line)."""

    def cells(xs: Sequence[str]) -> str:
        return "| " + " | ".join(str(x).replace("\n", " ").replace("|", "\\|") for x in xs) + " |"

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


def has_device_memory(cells: list[Cell]) -> bool:
    """Whether any cell measured device memory (CPU runs measure none: no memory table or figure for them)."""
    return any(c.metric(m) for c in cells for m in MEMORY_METRICS)


def scaling_of(cells: list[Cell], cell: Cell) -> tuple[float | None, float | None]:
    """(speedup vs 1 GPU, scaling efficiency) of a cell, by the one rule of scaling.py: the median of its
    runs' paired speedups where every run was measured side by side with the baseline, else its median
    tokens/s over the baseline's."""
    runs = [r for c in cells for r in c.runs]
    base, tps = baseline_tokens_per_s(runs, cell.runs[0]), cell.metric("tokens_per_s")
    paired = [paired_speedup(r) for r in cell.runs]
    if base and tps:
        s = statistics.median(p for p in paired if p) if all(paired) else tps / base
        return s, s / cell.world_size
    return None, None


def fmt_value(v: float | None, spec: str, suffix: str = "") -> str:
    """`v` formatted by `spec` with `suffix`, or a dash for a missing value."""
    return "—" if v is None else f"{v:{spec}}{suffix}"


def rank_noun(cfg: dict[str, Any]) -> str:
    """What one rank of a run is, for labels: "GPU", or "CPU rank" for a run on CPU (gloo)."""
    return "CPU rank" if cfg.get("device") == "cpu" else "GPU"


#: `distbench run` prints at this width when its output is not a terminal; its table fits in it
CONSOLE_WIDTH = 100


def fmt_ms(seconds: float) -> str:
    """Seconds as milliseconds to 3 significant digits (12.3, 123, 1.23)."""
    ms = seconds * 1000
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}"


def _step_ms(r: dict[str, Any]) -> str:
    st = r.get("step_time_s") or {}
    return f"{fmt_ms(st['median'])} [{fmt_ms(st['p10'])}-{fmt_ms(st['p90'])}]" if st else "—"


def _median_ms(r: dict[str, Any]) -> str:
    step = (r.get("metrics") or {}).get("step_time_s")
    return fmt_ms(step) if step else "—"


def _peak_gib(r: dict[str, Any]) -> str:
    peaks = [(r.get("metrics") or {}).get(k) for k in MEMORY_METRICS]
    if all(v is None for v in peaks):
        return "—"
    return "/".join(fmt_value(None if v is None else v / GIB, ".1f") for v in peaks)


def _metric(name: str, spec: str, suffix: str = "") -> Callable[[dict[str, Any]], str]:
    return lambda r: fmt_value((r.get("metrics") or {}).get(name), spec, suffix)


def _pm(low: float, high: float) -> str:
    """An interval's larger half-width, as a fraction of its estimate 1: "±2%"."""
    half = max(1 - low, high - 1)
    return f"±{half:.1%}" if half < 0.01 else f"±{half:.0%}"


def _speedup(r: dict[str, Any]) -> str:
    """The speedup, with the half-width of its 95% interval where it was measured side by side."""
    s = (r.get("metrics") or {}).get("speedup")
    vs = (r.get("side_by_side") or {}).get("vs_reference")
    if s is None or not vs:
        return fmt_value(s, ".2f", "x")
    est = 1 + vs["estimate"]
    return f"{s:.2f}x{_pm((1 + vs['low']) / est, (1 + vs['high']) / est)}"


def _tokens(r: dict[str, Any]) -> str:
    """tokens/s, with the half-width of its own 95% interval (from its windows) where it has one."""
    m = r.get("metrics") or {}
    tps, step, interval = (
        m.get("tokens_per_s"),
        m.get("step_time_s"),
        (r.get("step_time_s") or {}).get("interval"),
    )
    if tps is None or not step or not interval:
        return fmt_value(tps, ",.0f")
    return f"{tps:,.0f}{_pm(step / interval[1], step / interval[0])}"


def _loss(r: dict[str, Any]) -> str:
    """The loss at the result's fixed step (results.loss_at_step); a result from before it: its last loss."""
    if r.get("loss"):
        return fmt_value(r["loss"]["value"], ".4f")
    return f"{r['losses'][-1]:.4f}" if r.get("losses") else "—"


def loss_header(results: list[dict[str, Any]]) -> str:
    """The loss column's header: the step its losses were taken at, when every row took it at one step."""
    steps = {r["loss"]["step"] for r in results if r.get("loss")}
    return f"loss @\nstep {steps.pop()}" if len(steps) == 1 else "loss"


#: The console table's columns but the status: header (rich markup) and a result's cell, "—" for no value.
#: A column with no value in any row is left out (MFU and device memory on CPU).
CONSOLE_COLUMNS: tuple[tuple[str, Callable[[dict[str, Any]], str]], ...] = (
    ("strategy", lambda r: r["config"]["strategy"]),
    ("ws", lambda r: str(r["config"]["world_size"])),
    ("tok/s", _tokens),
    ("speedup", _speedup),
    ("eff", _metric("scaling_efficiency", ".0%")),
    ("step ms\n\\[p10-p90]", _step_ms),
    ("MFU", _metric("mfu", ".1%")),
    ("peak GiB\nalloc/resv/nvml", _peak_gib),
    ("loss", _loss),
)


def _paired(results: list[dict[str, Any]]) -> bool:
    """Whether any row's speedup was measured side by side, with an interval."""
    return any((r.get("side_by_side") or {}).get("vs_reference") for r in results)


def console_columns(results: list[dict[str, Any]]) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    """CONSOLE_COLUMNS for these results: measured side by side, the step time without its per-step p10-p90
    (the intervals beside tok/s and speedup say how far the figures may move, in the same width), and the
    loss column headed by its step."""
    out = []
    for name, cell in CONSOLE_COLUMNS:
        if cell is _step_ms and _paired(results):
            name, cell = "step\nms", _median_ms
        elif cell is _loss:
            name = loss_header(results)
        out.append((name, cell))
    return out


def measured_how(results: list[dict[str, Any]]) -> str:
    """One line on how the table's comparisons were measured (sidebyside.py), from its results' sections."""
    sections = [r.get("side_by_side") for r in results if r.get("status") == "ok"]
    modes = {s["mode"] for s in sections if s}
    if not modes - {"alone"}:  # none was measured beside another
        why = next((s["why"] for s in sections if s and s.get("why")), None)
        return (
            "Measured one at a time" + (f" ({why}; nor in pairs)" if why else "") + ": each speedup is a "
            "ratio of separate runs, with no interval, and moves with the host's speed between them"
        )
    rounds = next((s["rounds"] for s in sections if s and s.get("rounds")), None)
    how = (
        f"Measured side by side: {rounds} rounds of windows taking turns in rotation; each speedup is the "
        "paired windows' ratio, ± its 95% interval"
    )
    if "pairs" in modes:
        how += "; in pairs with the reference, as " + next(
            s["why"] for s in sections if s and s["mode"] == "pairs"
        )
    elif "alone" in modes:
        how += "; rows with no ± ran alone"
    return how


def results_table(results: list[dict[str, Any]]):
    """`distbench run`'s table, within CONSOLE_WIDTH: throughput and speedup (each ± its 95% interval where it
    has one), efficiency, step time, MFU, memory, the loss at one fixed step, and status. Its title says how
    the comparisons were measured; its caption, when the rows are host-bound (plausibility.host_bound). Each
    plausibility warning is a numbered footnote marked in its row's status ("! 1,2"), and so is each note on
    a figure a repeat may not reproduce ("* 3": plausibility.notes)."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    workloads = sorted(
        {
            f"{r['config']['model']} {r['config']['precision']} seq {r['config']['seq_len']} "
            f"global batch {r['config']['global_batch']}"
            for r in results
        }
    )
    columns = console_columns(results)
    cells = [[cell(r) for _, cell in columns] for r in results]
    shown = [i for i in range(len(columns)) if any(row[i] != "—" for row in cells)]
    t = Table(
        *(columns[i][0] for i in shown),
        "status",
        title="; ".join(workloads) + "\n" + measured_how(results),
        caption_justify="left",
        box=box.SIMPLE_HEAD,
        collapse_padding=True,
        pad_edge=False,
        show_edge=False,
    )
    t.columns[0].no_wrap = True  # a terminal narrower than the table wraps the figures, never a strategy name
    flags: list[str] = []
    notes: list[str] = []
    for r, row in zip(results, cells, strict=True):
        c = r["config"]
        throttled = r["status"] == "ok" and (r.get("nvml") or {}).get("throttled")
        status = "throttled" if throttled else r["status"]
        marks = []
        for w in r.get("warnings") or []:
            flags.append(f"[yellow]! {len(flags) + 1}[/] {c['strategy']} ws{c['world_size']}: {escape(w)}")
            marks.append(str(len(flags)))
        if marks:
            status += f" [yellow]! {','.join(marks)}[/]"
        if r.get("notes"):  # one footnote a row: its notes in one paragraph
            notes.append(
                f"* {len(notes) + 1} {c['strategy']} ws{c['world_size']}: {escape('; '.join(r['notes']))}"
            )
            status += f" * {len(notes)}"
        t.add_row(*(row[i] for i in shown), status)
    empty = [columns[i][0].split("\n")[0] for i in range(len(columns)) if i not in shown]
    bound = host_bound(results)
    caption = [f"{bound}."] if bound else []
    caption += [f"No values in these runs: {', '.join(empty)}."] if empty else []
    if flags:
        caption += ["Implausible, not results:", *flags]
    if notes:
        caption += ["Notes on figures a repeat may not reproduce:", *notes]
    t.caption = "\n".join(caption) or None
    return t
