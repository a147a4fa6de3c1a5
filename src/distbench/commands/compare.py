"""`distbench compare BASE HEAD`: the statistical regression gate over two sets of result files."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..compare import ALPHA, MIN_EFFECT, THRESHOLD
    from ..metrics import COMPARED

    p = subparsers.add_parser(
        "compare",
        help="compare two sets of repeated runs; exit 1 on a significant regression",
        description="Compare HEAD results against BASE per configuration and metric (Welch's t interval on "
        "log values over separate runs, Bonferroni over rows). Exit status: 0 pass, 1 regression, "
        "3 undecided (a regression of --threshold not ruled out, too few runs, or no usable "
        "result on a side). For a change you can run both sides of, `distbench ab` is quieter.",
    )
    p.add_argument("base", type=Path, help="result file or directory (searched recursively) of the baseline")
    p.add_argument("head", type=Path, help="result file or directory (searched recursively) of the candidate")
    p.add_argument(
        "--metric",
        action="append",
        dest="metrics",
        help=f"metric to compare (repeatable; default: {', '.join(COMPARED)}, where present)",
    )
    p.add_argument(
        "--alpha",
        type=float,
        default=ALPHA,
        help=f"family-wise false-alarm rate over every row (default {ALPHA})",
    )
    p.add_argument(
        "--min-effect",
        type=float,
        default=MIN_EFFECT,
        help=f"smallest significant change reported as a regression, as a fraction (default {MIN_EFFECT})",
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=THRESHOLD,
        help=f"the regression a pass must rule out, as a fraction (default {THRESHOLD})",
    )
    p.add_argument("--min-runs", type=int, default=6, help="usable runs needed per side (default 6)")
    p.add_argument(
        "--allow-insufficient",
        action="store_true",
        help="let configurations that lack runs pass (still reported); never undecided rows, "
        "never an empty side",
    )
    p.add_argument("--markdown", type=Path, help="also write the report as markdown to this file")
    p.add_argument(
        "--github-summary", action="store_true", help="append the markdown report to $GITHUB_STEP_SUMMARY"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..compare import compare
    from ..results import load_results

    try:
        report = compare(
            load_results(args.base),
            load_results(args.head),
            metrics=args.metrics,
            alpha=args.alpha,
            min_effect=args.min_effect,
            threshold=args.threshold,
            min_runs=args.min_runs,
            allow_insufficient=args.allow_insufficient,
        )
    except (FileNotFoundError, ValueError) as e:  # missing paths, bad JSON, ConfigError (unknown metric)
        print(f"distbench compare: {e}", file=sys.stderr)
        return 2
    Console().print(report)
    md = report.to_markdown()
    if args.markdown:
        args.markdown.parent.mkdir(parents=True, exist_ok=True)
        args.markdown.write_text(md)
    if args.github_summary and os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(md)
    return report.exit_code
