"""`distbench bisect`: the first revision (or environment) that made a configuration slower, or that fails a
pytest node; every step decided by the A/B gate (gate/bisect.py), candidates from gate/history.py."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from ..gate.ab import ABReport
    from ..gate.bisect import Bisection, Comparator, Setup, Step, Verdict
    from ..gate.history import Checkouts, History


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..gate.bisect import BUDGET_S, MAX_PAIRS
    from .ab import add_comparison_flags

    p = sub.add_parser(
        "bisect",
        help="find the revision (or environment) that made a configuration slower, or that fails a test",
        description="Bisect git revisions of --repo between --good and --bad (or the environments of "
        "--variants FILE, in order) for the first one whose performance matches the bad end rather than the "
        "good one: each probe is an interleaved A/B comparison against the good end, decided by the gate's "
        "rule, with more rounds up to --max-pairs. With --test NODEID, for the first one where that pytest "
        "node fails. Resumes from the state file in --output. Every bisect command first removes the "
        "worktrees a killed bisect left in the repository. Exit 0 good and bad do not differ, 1 found, "
        "2 usage (or an end that does not run), 3 undecided.",
    )
    p.add_argument("--good", help="the last revision known good (not with --variants)")
    p.add_argument("--bad", help="the revision known bad (default HEAD; not with --variants)")
    p.add_argument("--repo", type=Path, help="the git repository to bisect (default: the one around here)")
    p.add_argument(
        "--variants",
        type=Path,
        help="bisect these environments instead: one `distbench ab` variant per line, good first, bad last",
    )
    p.add_argument(
        "--test", metavar="NODEID", help="bisect for the first candidate where this pytest node fails"
    )
    p.add_argument(
        "--build",
        metavar="CMD",
        help="a command run in each revision's checkout before its probes (e.g. 'pip install -e .'); "
        "a revision whose build fails is skipped",
    )
    add_comparison_flags(p, max_pairs=MAX_PAIRS, budget=BUDGET_S, each="probe")
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        default=Path("distbench-bisect"),
        help="directory for the state file, every probe's runs (probes/) and bisect.md, bisect.json",
    )
    p.add_argument("--github-summary", action="store_true", help="append the report to $GITHUB_STEP_SUMMARY")
    p.add_argument(
        "--cleanup",
        action="store_true",
        help="only remove the worktrees that killed bisects left in the repository (--repo, or the one "
        "around here), and exit",
    )
    p.set_defaults(func=run)


def _history(args: argparse.Namespace) -> History:
    """The candidates the flags name; ConfigError for flags that do not go together."""
    from ..errors import ConfigError
    from ..gate import history

    if args.variants:
        if args.good or args.bad or args.repo or args.build:
            raise ConfigError(
                "--variants replaces --good, --bad, --repo and --build: the file's lines are the candidates"
            )
        return history.from_file(args.variants)
    if not args.good:
        raise ConfigError("give --good REV (and --bad REV, default HEAD), or --variants FILE")
    return history.from_git(args.repo or Path.cwd(), args.good, args.bad or "HEAD")


def _setup(args: argparse.Namespace, hist: History, config: dict[str, Any] | None) -> Setup:
    from ..gate.bisect import Rule, Setup

    common: dict[str, Any] = {"source": hist.source, "candidates": hist.candidates}
    if args.test:
        return Setup(mode="test", nodeid=args.test, **common)
    rule = Rule(
        alpha=args.alpha,
        threshold=args.threshold,
        min_effect=args.min_effect,
        min_pairs=args.min_pairs,
        max_pairs=args.max_pairs,
        look_every=args.look_every,
        interleave=args.interleave,
    )
    return Setup(mode="perf", config=config, rule=rule, **common)


def run(args: argparse.Namespace) -> int:
    """`distbench bisect`: check the flags, list the candidates, resume or start, probe, report."""
    import json
    import shlex

    from rich.console import Console
    from rich.markup import escape

    from ..errors import DistbenchError
    from ..gate.bisect import STATE_FILE, resume
    from ..runtime.pool import cuda_device_count
    from .ab import bind_cpus, check_flags, configurations

    console = Console(width=None if Console().is_terminal else 160, highlight=False)
    _remove_abandoned(args, console)
    if args.cleanup:
        return 0
    problem = check_flags(args)
    if problem:
        console.print(f"[red]error:[/] {problem}")
        return 2
    n_cuda = cuda_device_count()
    device = args.device or ("cuda" if n_cuda else "cpu")
    try:
        hist = _history(args)
        config = None
        if not args.test:
            if not args.strategy:
                args.strategy = ["ddp"]
            configs = configurations(args, device, n_cuda)
            if len(configs) != 1:
                raise DistbenchError("bisect follows one configuration: give one strategy (-s)")
            config = json.loads(json.dumps(configs[0].to_dict()))
        b = resume(args.output / STATE_FILE, _setup(args, hist, config))
        build = shlex.split(args.build) if args.build else []
    except (DistbenchError, ValueError) as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    bind_cpus(args)
    args.output.mkdir(parents=True, exist_ok=True)
    if b.probes:
        console.print(f"resuming {args.output / STATE_FILE}: {len(b.probes)} probe(s) kept")
    what = f"the first to fail {args.test}" if args.test else "the first to match the bad end's performance"
    console.print(
        f"distbench bisect: {hist.source}, {b.n} candidates after the good end; {what}; "
        f"at most {b.planned} probes without skips"
    )
    try:
        verdict = _probe_all(args, b, hist, build, device, console)
    except DistbenchError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    _publish(args, b, verdict, console)
    return verdict.exit_code


def _remove_abandoned(args: argparse.Namespace, console: Console) -> None:
    """Remove the worktrees of killed bisects in the repository this command names (--repo, or the one around
    the working directory), saying which; nothing outside a git repository."""
    from rich.markup import escape

    from ..errors import ConfigError
    from ..gate.history import remove_abandoned
    from ..gate.variants import git

    try:
        top = Path(git("rev-parse", "--show-toplevel", cwd=args.repo or Path.cwd()))
    except (ConfigError, OSError):
        return  # no repository, so no worktrees
    try:
        removed = remove_abandoned(top)
    except ConfigError as e:
        console.print(f"[yellow]warning:[/] {escape(str(e))}")
        return
    if removed:
        console.print(
            f"removed {len(removed)} worktree(s) that killed bisects left: {escape(', '.join(removed))}"
        )


def _probe_all(
    args: argparse.Namespace, b: Bisection, hist: History, build: list[str], device: str, console: Console
) -> Verdict:
    """Run the bisect's probes in the candidates' checkouts, under --output/checkouts (emptied first, and gone
    when it returns); its Verdict."""
    import shutil

    from ..gate import bisect
    from ..gate.history import Checkouts, run_test
    from ..gate.variants import VariantStartError
    from ..report.bisect import probe_line

    workdir = args.output / "checkouts"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    checkouts = Checkouts(hist, workdir.resolve(), args.output / "logs", build, args.timeout)
    try:
        if args.test:

            def test(index: int) -> tuple[bisect.Outcome, str]:
                try:
                    variant = checkouts.variant(index, "test")
                except VariantStartError as e:
                    return "skip", str(e)
                return run_test(variant, args.test, args.timeout, args.output / "logs" / f"test-{index}.log")

            def probe(step: Step) -> bisect.ProbeRecord:
                return bisect.test_probe(step, test)
        else:
            compare = _comparator(args, b, checkouts, device, console)

            def probe(step: Step) -> bisect.ProbeRecord:
                return bisect.compare_probe(b, step, compare)

        return bisect.run(
            b,
            probe,
            state_path=args.output / bisect.STATE_FILE,
            on_probe=lambda r: console.print(probe_line(b, r)),
        )
    finally:
        checkouts.close()
        shutil.rmtree(workdir, ignore_errors=True)


def _comparator(
    args: argparse.Namespace, b: Bisection, checkouts: Checkouts, device: str, console: Console
) -> Comparator:
    """Comparisons through `distbench ab`'s machinery, each probe's runs and ab.json under
    --output/probes/NN-kind-index (emptied first: a probe cut short by a kill starts again)."""
    import json
    import shutil

    from ..config import RunConfig
    from ..report import gate as render
    from .ab import alternate

    assert b.setup.config is not None
    configs = [RunConfig.from_dict(b.setup.config)]

    def compare(step: Step, *, gate: tuple[str, ...] | None, alpha: float, threshold: float) -> ABReport:
        assert step.base is not None
        out = args.output / "probes" / f"{len(b.probes) + 1:02d}-{step.kind}-{step.head}"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        variants = (checkouts.variant(step.base, "base"), checkouts.variant(step.head, "head"))
        ns = argparse.Namespace(**{**vars(args), "output": out, "alpha": alpha, "threshold": threshold})
        console.print(
            f"probe {len(b.probes) + 1} ({step.kind}): {b.name(step.head)} against {b.name(step.base)}"
        )
        report = alternate(ns, configs, device, variants, console, gate=gate)
        report.base_desc, report.head_desc = b.name(step.base), b.name(step.head)
        (out / "ab.md").write_text(render.to_markdown(report))
        (out / "ab.json").write_text(json.dumps(render.to_json(report), indent=1, default=str) + "\n")
        return report

    return compare


def _publish(args: argparse.Namespace, b: Bisection, verdict: Verdict, console: Console) -> None:
    """bisect.md and bisect.json under --output, the outcome on the console, the job summary if asked."""
    from ..report import bisect as render
    from ..results import write_json_atomic

    md = render.to_markdown(b, verdict)
    (args.output / "bisect.md").write_text(md)
    write_json_atomic(args.output / "bisect.json", render.to_json(b, verdict))
    style = {0: "bold green", 1: "bold red"}.get(verdict.exit_code, "bold yellow")
    console.print(
        f"[{style}]{verdict.message}[/] (exit {verdict.exit_code}); report: {args.output / 'bisect.md'}"
    )
    if args.github_summary and os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(md)
