"""`distbench compare BASE HEAD`: the statistical regression gate over two sets of result files."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    from ..compare import MIN_EFFECT, NOISE_K

    p = subparsers.add_parser(
        "compare",
        help="compare two sets of repeated runs; exit 1 on a significant regression",
        description="Compare HEAD results against BASE per configuration and metric (Mann-Whitney U over "
                    "separate runs, noise-aware threshold). Exit status: 0 pass, 1 significant regression, "
                    "3 undecided (fewer than --min-runs usable runs on a side; --allow-insufficient makes "
                    "that 0).",
    )
    p.add_argument("base", type=Path, help="result file or directory (searched recursively) of the baseline")
    p.add_argument("head", type=Path, help="result file or directory (searched recursively) of the candidate")
    p.add_argument("--metric", action="append", dest="metrics", help="metric to compare (repeatable; "
                   "default: tokens_per_s, step_time_s, mfu, memory peaks, busbw_gbps where present)")
    p.add_argument("--alpha", type=float, default=0.01, help="significance level (default 0.01)")
    p.add_argument("--min-effect", type=float, default=MIN_EFFECT,
                   help=f"smallest relative change that counts, as a fraction (default {MIN_EFFECT})")
    p.add_argument("--noise-k", type=float, default=NOISE_K,
                   help=f"a change must also exceed K standard errors of the log ratio, from the pooled "
                        f"run-to-run CV and the run counts (default {NOISE_K:g})")
    p.add_argument("--min-runs", type=int, default=6, help="usable runs needed per side (default 6)")
    p.add_argument("--allow-insufficient", action="store_true",
                   help="exit 0 instead of 3 when some configurations lack runs (still reported)")
    p.add_argument("--markdown", type=Path, help="also write the report as markdown to this file")
    p.add_argument("--github-summary", action="store_true",
                   help="append the markdown report to $GITHUB_STEP_SUMMARY")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..compare import compare
    from ..results import load_results

    try:
        report = compare(load_results(args.base), load_results(args.head), metrics=args.metrics,
                         alpha=args.alpha, min_effect=args.min_effect, noise_k=args.noise_k,
                         min_runs=args.min_runs, allow_insufficient=args.allow_insufficient)
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
