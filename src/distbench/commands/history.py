"""`distbench history`: the change points of every tracked metric over the stored history (asv's results,
distbench's result JSON or both; distbench/history/), each with its commit range, its size with an interval,
and the `distbench bisect` command that would name the commit; `--bisect` runs those commands."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

    from ..history.report import Found
    from ..history.series import Series


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..compare import MIN_EFFECT

    p = sub.add_parser(
        "history",
        help="find the change points of every tracked metric over the stored history, and bisect them",
        description="Read the stored history (asv's results directory with --asv, distbench result files "
        "or directories as arguments, `distbench nightly`'s ratio series with --nights; any of them together) "
        "and find where each tracked metric of each configuration changed level: a change-point search (ruptures) whose every change is confirmed by a "
        "permutation test, as E-divisive means confirms them. For each change: the last good and first bad "
        "commit, the medians either side, the change in percent with its confidence interval, and the "
        "`distbench bisect` command that would name the commit of a regression. Exit 0 no regression, 1 a "
        "regression found (with --bisect: a bisect named a commit), 2 usage (or a bisect that could not run).",
    )
    p.add_argument("results", nargs="*", type=Path, help="distbench result files or directories")
    p.add_argument("--asv", type=Path, metavar="DIR", help="asv's results directory (e.g. .asv/results)")
    p.add_argument(
        "--nights",
        type=Path,
        action="append",
        metavar="PATH",
        help="`distbench nightly` nights (night.json files, or folders searched for them): their ratio series "
        "head/reference, chained across a change of reference, and head's absolute figures (repeatable)",
    )
    p.add_argument("--machine", help="only this asv machine's results")
    p.add_argument("--metric", action="append", help="only this registry metric (repeatable)")
    p.add_argument(
        "--alpha",
        type=float,
        default=0.01,
        help="false-alarm rate of a series' tests together (default 0.01)",
    )
    p.add_argument(
        "--min-effect",
        type=float,
        default=MIN_EFFECT,
        help="a change whose whole interval lies within this fraction either way is reported as negligible: no "
        f"bisect, no failure (default {MIN_EFFECT}, as `distbench compare`)",
    )
    p.add_argument(
        "--include-flagged",
        action="store_true",
        help="use the points the plausibility checks flagged too (left out by default: not measurements)",
    )
    p.add_argument("--repo", help="the git repository the commits are of, for the bisect commands")
    p.add_argument(
        "--bisect-flags",
        default="",
        metavar="FLAGS",
        help="more `distbench bisect` flags for every proposed command (e.g. '--max-pairs 6 --bind-cpus')",
    )
    p.add_argument("--bisect", action="store_true", help="run the proposed bisect of every regression")
    p.add_argument(
        "--reach",
        type=int,
        metavar="N",
        help="also say what each series can find: the smallest step found at its point from N more points, "
        "80%% of the time at the series' own noise (reach.json; a few seconds per series length)",
    )
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        default=Path("distbench-history"),
        help="directory for history.json and the bisects' outputs (bisect-N/)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Load, detect, print every change and its bisect command, run the bisects if asked."""
    from rich.console import Console
    from rich.markup import escape

    from ..errors import DistbenchError
    from ..history import report
    from ..history.series import from_asv, from_nights, from_results
    from ..results import write_json_atomic

    console = Console(width=None if Console().is_terminal else 200, highlight=False)
    if not args.asv and not args.results and not args.nights:
        console.print("[red]error:[/] give distbench result files or directories, --asv DIR or --nights PATH")
        return 2
    if not 0 < args.alpha < 1:
        console.print(f"[red]error:[/] --alpha must lie between 0 and 1, got {args.alpha}")
        return 2
    if args.reach is not None and args.reach < 2:
        console.print(f"[red]error:[/] --reach must be at least 2 points (a level is two), got {args.reach}")
        return 2
    if not 0 <= args.min_effect < 1:
        console.print(f"[red]error:[/] --min-effect must lie in [0, 1), got {args.min_effect}")
        return 2
    try:
        series = (
            (from_asv(args.asv, args.machine) if args.asv else [])
            + (from_results(args.results) if args.results else [])
            + (from_nights(args.nights) if args.nights else [])
        )
        extra = shlex.split(args.bisect_flags)
    except (DistbenchError, ValueError, OSError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    if args.metric:
        unknown = sorted(set(args.metric) - {s.metric for s in series})
        if unknown:
            console.print(f"[red]error:[/] --metric {', '.join(unknown)}: no series of it in this history")
            return 2
        series = [s for s in series if s.metric in args.metric]
    found = report.analyse(series, args.alpha, args.include_flagged, min_effect=args.min_effect)
    commands = [
        report.bisect_argv(f, args.repo, str(args.output / f"bisect-{i}"), extra)
        for i, f in enumerate(found, 1)
    ]
    args.output.mkdir(parents=True, exist_ok=True)
    write_json_atomic(args.output / "history.json", report.to_json(found, commands))
    longest = max((len(s.points) for s in series), default=0)
    console.print(
        f"distbench history: {len(series)} series, up to {longest} points; {len(found)} change point(s) "
        f"at alpha {args.alpha}"
    )
    for f, argv in zip(found, commands, strict=True):
        console.print(f"[bold]{escape(f.series.label)}[/]: {escape(report.describe(f))}")
        if argv:
            console.print(f"  bisect: {escape(report.command_text(argv))}", soft_wrap=True)
    _plots(found, args.output, console)
    codes = _run_bisects(commands, console) if args.bisect else []
    if args.reach:
        _reach(series, found, args, console)
    _table(found, console)
    if 2 in codes:
        return 2
    return 1 if 1 in codes or (not args.bisect and any(f.actionable for f in found)) else 0


def _plots(found: list[Found], output: Path, console: Console) -> None:
    """series-N.png under --output for each series that changed: its points, intervals and changes."""
    from ..history.plot import series_plot

    changed: dict[int, list[Found]] = {}
    for f in found:
        changed.setdefault(id(f.series), []).append(f)
    for i, fs in enumerate(changed.values(), 1):
        path = series_plot(fs[0].series, fs, output / f"series-{i}.png")
        console.print(f"  plot: {path} ({fs[0].series.label})", soft_wrap=True)


def _run_bisects(commands: list[list[str] | None], console: Console) -> list[int]:
    """Each proposed bisect through the `distbench bisect` command itself (its own parser reads the proposed
    line); their exit statuses (1: it named a commit, 2: it could not run, 3: undecided)."""
    from . import bisect
    from .parser import build_parser

    codes = []
    for argv in commands:
        if argv:
            console.print(f"running: {shlex.join(argv)}", soft_wrap=True)
            args = build_parser([bisect]).parse_args(argv[1:])
            codes.append(int(args.func(args) or 0))
    return codes


def _reach(series: list[Series], found: list[Found], args: argparse.Namespace, console: Console) -> None:
    """What each series can find with --reach more points, from the points since its last change: a table and
    reach.json under --output."""
    from rich.table import Table

    from ..history.reach import POWER, reach
    from ..history.report import usable_points
    from ..results import write_json_atomic

    t = Table("series", "points", "noise", f"finds from {args.reach} more", title="what each series can find")
    rows = []
    for s in series:
        points = usable_points(s, args.include_flagged)
        if points is None:
            continue
        since = max((f.change.index for f in found if f.series is s), default=0)
        r = reach([p.value for p in points], since, args.reach, args.alpha)
        step = "out of reach: too few points" if r.step is None else f"a {r.step * 100:.2f}% step"
        t.add_row(s.label, str(r.points), f"{r.noise * 100:.2f}%", step)
        rows.append({"series": s.label, "points": r.points, "noise": r.noise, "step": r.step})
    write_json_atomic(
        args.output / "reach.json", {"after": args.reach, "power": POWER, "alpha": args.alpha, "series": rows}
    )
    console.print(t)


def _table(found: list[Found], console: Console) -> None:
    """The short table last: one row per change."""
    from rich.table import Table

    t = Table("series", "last good", "first bad", "change", "interval", "p", "kind", title="change points")
    for f in found:
        c = f.change
        t.add_row(
            f.series.label,
            f.last_good.commit[:10],
            f.first_bad.commit[:10],
            f"{c.percent:+.2f}%",
            f"[{(c.low - 1) * 100:+.2f}%, {(c.high - 1) * 100:+.2f}%]",
            f"{c.p_value:.3f}",
            "negligible" if f.negligible else "regression" if f.worse else "improvement",
        )
    console.print(t if found else "change points: none")
