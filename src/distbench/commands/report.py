"""`distbench report RESULTS... --out DIR`: report.md with tables and figures, optionally a job summary."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="write report.md and figures from result files",
        description="Tables (strategy x world size: throughput, scaling, step time, "
        "MFU, memory, trace breakdown) and PNG figures from results.",
    )
    p.add_argument("results", nargs="+", type=Path, help="result files or directories (searched recursively)")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("distbench-results/report"),
        help="directory for report.md and the PNGs (default distbench-results/report)",
    )
    p.add_argument(
        "--github-summary",
        action="store_true",
        help="append a compact summary to $GITHUB_STEP_SUMMARY (stdout when unset)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..plausibility import check
    from ..report import job_summary_markdown, write_report
    from ..results import load_results

    try:
        results = load_results(args.results)
    except (FileNotFoundError, ValueError) as e:
        print(f"distbench report: {e}", file=sys.stderr)
        return 2
    if not results:
        print(f"no distbench results under {', '.join(map(str, args.results))}", file=sys.stderr)
        return 1
    path = write_report(results, args.out)
    print(f"wrote {path} ({len(results)} results)")
    warned = check(results)
    if warned:
        print(
            f"{sum(map(len, warned.values()))} plausibility warning(s) on {len(warned)} result(s): "
            f"see 'Implausible figures' in {path}"
        )
    if args.github_summary:
        summary = job_summary_markdown(results)
        target = os.environ.get("GITHUB_STEP_SUMMARY")
        if target:
            with open(target, "a") as f:
                f.write(summary)
        else:
            print(summary)
    return 0
