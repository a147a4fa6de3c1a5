"""`distbench nightly`: the nightly grid measured side by side against a frozen reference (gate/relative.py):
per configuration and gated metric the ratio head/reference with its interval, beside both sides' absolute
figures, in night.json (docs/reference-runs.md)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from ..config import RunConfig
    from ..gate.relative import Night, NightRow, Reference
    from ..gate.variants import Variant

#: Window defaults against host-bound drift that interleaving does not cancel (docs/reference-runs.md,
#: "Host-bound rows"): windows of two steps, so that adjacent windows of the two sides meet the host in the
#: same state (an H200 VM's vCPU speed flipped by x1.7 within seconds); a warm-up of five steps, so that
#: FSDP's and ZeRO's first steps (allocations, bucket builds) are out of every window.
WINDOW_STEPS, WARMUP = 2, 5
#: Timed windows per run: a pair's ratio is the trimmed mean of its windows' ratios, and on one H200 a lone
#: host-bound row (fsdp_full, device busy 0.79) with 10 windows a pair spread its pairs' windows -6.7..+8.7%
#: and four A/A nights 0.988-1.024; with 30, pairs within -1.2..+0.6% and four A/A nights 0.993-1.005, in as
#: long a night (112-123 s at 4 pairs against 96-118 s): a pair's cost is its processes' start, not its windows
#: (results/relative-nightly-h200-2026-12-02/windows-30).
NIGHT_WINDOWS = 30


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..config import PRECISIONS
    from ..gate.relative import MAX_PAIRS, PAIRS

    p = sub.add_parser(
        "nightly",
        help="the nightly grid measured side by side against a frozen reference: ratios with intervals",
        description="Run the nightly grid's configurations (the asv grid's workload, history/grid.py), each "
        "interleaved window by window against --reference for a fixed number of pairs (fresh processes per "
        "pair, both sides' training threads on one core), and store per configuration and gated metric the "
        "ratio head/reference with its interval, beside both sides' absolute figures, in OUTPUT/night.json. "
        "The night the reference changes (--previous-reference, or a reference id that differs from the "
        "last night's in --history) also measures the new reference against the old, so the history chains "
        "its series across the switch. Exit 0 every configuration has its ratios, 2 usage or head cannot "
        "run, 3 some ratio is missing (the reference could not run: head's absolute figures are stored).",
    )
    p.add_argument(
        "--reference",
        required=True,
        help="the frozen reference variant (as `distbench ab` takes "
        "them: python=EXE, rev=REV, tree=DIR, env.NAME=VALUE)",
    )
    p.add_argument(
        "--reference-id",
        help="a name for the reference (default: a hash of its commit, "
        "interpreter and environment); the history sees a change of it",
    )
    p.add_argument(
        "--previous-reference",
        metavar="SPEC",
        help="the reference the last night was measured "
        "against, when it changed: measured once against the new one (default: the last night's "
        "in --history, when its id differs)",
    )
    p.add_argument("--head", default="", help="the variant under test (default: this checkout)")
    p.add_argument(
        "--strategy",
        "-s",
        action="append",
        help="strategies; repeat or comma-separate (default: the nightly grid's)",
    )
    p.add_argument(
        "--world-size",
        "-n",
        type=int,
        action="append",
        help="world sizes (default: the grid's, 1, 2, 4, 8 up to the GPUs; 1 and 2 on CPU)",
    )
    p.add_argument("--model", "-m", help="model (default: the grid's)")
    p.add_argument("--micro-batch", type=int, help="per-rank micro-batch (default: the grid's)")
    p.add_argument("--precision", choices=PRECISIONS, help="default: the grid's")
    p.add_argument("--seq-len", type=int, help="sequence length (default: the model's)")
    p.add_argument("--steps", type=int, help=f"timed steps per run (default: {WINDOW_STEPS} per window)")
    p.add_argument("--windows", type=int, help=f"timed windows per run (default {NIGHT_WINDOWS})")
    p.add_argument("--warmup", type=int, help=f"untimed steps per run (default {WARMUP})")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    p.add_argument(
        "--pairs",
        type=int,
        default=PAIRS,
        help=f"the fewest pairs a configuration gets (default {PAIRS}); one whose pairs spread over the earlier "
        "nights gets as many as its ratio needs to land within its regime's bound, up to --max-pairs",
    )
    p.add_argument(
        "--max-pairs",
        type=int,
        default=MAX_PAIRS,
        help=f"the most pairs a configuration gets (default {MAX_PAIRS})",
    )
    p.add_argument(
        "--alpha", type=float, default=0.05, help="each ratio's interval is 1 - alpha (default 0.05)"
    )
    p.add_argument(
        "--budget",
        type=float,
        default=3600.0,
        help="seconds for the night's pairs; a row the budget cuts short says how many it got (default 3600)",
    )
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before one run counts as hung")
    p.add_argument(
        "--no-bind-cpus",
        dest="bind_cpus",
        action="store_false",
        help="leave the ranks unbound (default: both sides' training threads of a rank on one core)",
    )
    p.add_argument("--history", type=Path, help="earlier nights (default: the folder above --output)")
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        required=True,
        help="this night's folder: night.json, "
        "runs/ (every run's result), bridge/ (the old reference against the new)",
    )
    p.set_defaults(func=run)


def configurations(args: argparse.Namespace, device: str, n_cuda: int) -> list[RunConfig]:
    """The grid's configurations (benchmarks/bench_training.py's: its workload, strategies and world sizes),
    narrowed and changed by the flags; DistbenchError for one that cannot run here."""
    from ..config import RunConfig
    from ..errors import DistbenchError
    from ..history.grid import asv_workload
    from ..strategies import default_strategies, get_spec

    gpus = n_cuda if device == "cuda" else 0
    w = asv_workload(gpus)
    given = args.strategy or [",".join(default_strategies("cuda" if gpus else "asv-cpu"))]
    strategies = [s.strip() for v in given for s in v.split(",") if s.strip()]
    sizes = args.world_size or ([n for n in (1, 2, 4, 8) if n <= gpus] if gpus else [1, 2])
    windows = args.windows or NIGHT_WINDOWS
    mb = args.micro_batch or w["micro_batch"]
    precision = args.precision or w["precision"]
    configs = []
    for s in strategies:
        for ws in sizes:
            reason = get_spec(s).unsupported_reason(
                device, ws, n_cuda if device == "cuda" else None, precision
            )
            if reason:
                if args.strategy and args.world_size:  # asked for by name: say why not
                    raise DistbenchError(reason)
                continue  # the grid's unsupported pairs are skipped, as asv skips them
            configs.append(
                RunConfig(
                    strategy=s,
                    world_size=ws,
                    model=args.model or w["model"],
                    precision=precision,
                    seq_len=args.seq_len or 0,
                    micro_batch=mb,
                    global_batch=mb * ws if args.micro_batch else max(w["global_batch"], mb * ws),
                    steps=args.steps or windows * WINDOW_STEPS,
                    windows=windows,
                    warmup=WARMUP if args.warmup is None else args.warmup,
                    deterministic=False,
                )
            )
    if not configs:
        raise DistbenchError("no configuration of the grid runs here with these flags")
    return configs


def check_flags(args: argparse.Namespace) -> str | None:
    from ..gate import stats

    if args.pairs < stats.MIN_RUNS:
        return f"--pairs must be at least {stats.MIN_RUNS} (an interval needs them), got {args.pairs}"
    if args.max_pairs < args.pairs:
        return f"--max-pairs ({args.max_pairs}) must be at least --pairs ({args.pairs})"
    if not 0 < args.alpha < 0.5:
        return f"--alpha must be between 0 and 0.5, got {args.alpha}"
    if args.budget <= 0 or args.timeout <= 0:
        return "--budget and --timeout must be positive"
    return None


def earlier_nights(args: argparse.Namespace) -> list[Night]:
    """The nights in --history (default: the folder above --output), oldest first, this night's own left out."""
    from ..gate.relative import NIGHT_FILE, find_night_files

    where = args.history or args.output.resolve().parent
    own = (args.output / NIGHT_FILE).resolve()
    if not where.is_dir():
        return []
    return [night for f, night in find_night_files([where], none_ok=True) if f.resolve() != own]


def run(args: argparse.Namespace) -> int:
    """`distbench nightly`: the flags, the reference (and the previous one), the night, night.json."""
    from rich.console import Console
    from rich.markup import escape

    from ..errors import DistbenchError
    from ..runtime.pool import cuda_device_count

    console = Console(width=None if Console().is_terminal else 160, highlight=False)
    problem = check_flags(args)
    if problem:
        console.print(f"[red]error:[/] {problem}")
        return 2
    n_cuda = cuda_device_count()
    device = args.device or ("cuda" if n_cuda else "cpu")
    try:
        configs = configurations(args, device, n_cuda)
        head, reference, ref_v, ref_error = _variants(args)
        nights = earlier_nights(args)
        previous = _previous(args, reference, nights, console) if ref_v is not None else None
        args.quota = _allot(args, configs, nights, console)
    except DistbenchError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    if args.bind_cpus:
        os.environ["DISTBENCH_BIND_CPUS"] = "pinned"
    args.output.mkdir(parents=True, exist_ok=True)
    try:
        night = _night(args, configs, device, head, reference, ref_v, ref_error, previous, console)
    except DistbenchError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    from ..gate.relative import save_night

    path = save_night(night, args.output)
    _table(night, console)
    console.print(f"night: {path}")
    if night.reference_error:
        console.print(f"[red]error:[/] {escape(night.reference_error)}; head's absolute figures are stored")
    missing = night.reference_error or any(not r.ratios for r in night.rows)
    return 3 if missing else 0


def _allot(
    args: argparse.Namespace, configs: list[RunConfig], nights: list[Night], console: Console
) -> dict[str, int]:
    """Each configuration's pairs tonight (gate/relative.py's allot over the earlier nights), said where one
    gets more than --pairs."""
    from ..gate.ab import label_of
    from ..gate.relative import ALLOT_NIGHTS, allot

    quota = allot([label_of(c) for c in configs], nights, args.pairs, args.max_pairs)
    more = {k: n for k, n in quota.items() if n > args.pairs}
    if more:
        console.print(
            f"pairs from the spread of each row's pairs over {min(len(nights), ALLOT_NIGHTS)} earlier night(s): "
            + ", ".join(f"{k} {n}" for k, n in more.items())
            + f"; the others {args.pairs}"
        )
    return quota


def _variants(args: argparse.Namespace) -> tuple[Variant, Reference, Variant | None, str | None]:
    """Head, the reference as recorded, the reference's variant (None where it cannot be parsed: a deleted
    interpreter) and why not. Head must parse: without it there is no night."""
    from ..errors import ConfigError
    from ..gate.relative import Reference, reference_id
    from ..gate.variants import parse_variant

    head = parse_variant("head", args.head)
    try:
        ref_v: Variant | None = parse_variant("base", args.reference)
        error = None
    except ConfigError as e:
        ref_v, error = None, f"the reference ({args.reference}) cannot start: {e}"
    rid = args.reference_id or (reference_id(ref_v, args.reference) if ref_v else None)
    ref = Reference(
        spec=args.reference,
        describe=ref_v.describe() if ref_v else args.reference,
        id=rid or "unknown (it did not start)",
    )
    return head, ref, ref_v, error


def _previous(
    args: argparse.Namespace, reference: Reference, nights: list[Night], console: Console
) -> Reference | None:
    """The reference to bridge from: --previous-reference, or the last of the earlier nights' when its id
    differs."""
    from ..gate.relative import Reference, reference_id
    from ..gate.variants import parse_variant

    if args.previous_reference:
        v = parse_variant("base", args.previous_reference)
        return Reference(
            spec=args.previous_reference, describe=v.describe(), id=reference_id(v, args.previous_reference)
        )
    last = nights[-1] if nights else None
    if last is None or last.reference.id == reference.id:
        return None
    console.print(
        f"the reference changed since the last night ({last.created}): {last.reference.id} -> "
        f"{reference.id}; measuring the new one against the old once"
    )
    return last.reference


def _night(
    args: argparse.Namespace,
    configs: list[RunConfig],
    device: str,
    head: Variant,
    reference: Reference,
    ref_v: Variant | None,
    ref_error: str | None,
    previous: Reference | None,
    console: Console,
) -> Night:
    """The night: the grid against the reference, head alone where the reference cannot run, the bridge."""
    import dataclasses
    import datetime
    import time

    from ..errors import DistbenchError
    from ..gate.relative import SCHEMA, Bridge, Night
    from ..gate.variants import VariantStartError, git, parse_variant

    start = time.monotonic()
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    rows: list[NightRow] = []
    if ref_v is not None:
        try:
            rows = _against(args, configs, device, (ref_v, head), args.output / "runs", console)
        except VariantStartError as e:
            if e.label == "head":
                raise
            ref_error = f"the reference ({reference.spec}) cannot start: {e}"
    if ref_error:
        rows = _alone(args, configs, device, head, console)
    elif failed := [i for i, r in enumerate(rows) if r.failed == "reference"]:
        ref_error = f"the reference ({reference.spec}) failed: {rows[failed[0]].error}"
        alone = _alone(args, [configs[i] for i in failed], device, head, console)
        for i, r in zip(failed, alone, strict=True):
            rows[i] = r.model_copy(update={"error": rows[i].error, "failed": "reference"})
    bridge = None
    if previous is not None and not ref_error and ref_v is not None:
        try:
            prev_v = parse_variant("base", previous.spec)
            new_v = dataclasses.replace(ref_v, label="head")  # the new reference plays head against the old
            bridge_rows = _against(args, configs, device, (prev_v, new_v), args.output / "bridge", console)
            bridge = Bridge(previous=previous, rows=bridge_rows)
        except DistbenchError as e:
            console.print(
                f"[yellow]warning:[/] the previous reference ({previous.spec}) could not be "
                f"measured against the new one: {e}; the history starts a new series here"
            )
    try:
        commit: str | None = (
            git("rev-parse", "HEAD", cwd=head.tree)
            if not head.rev
            else git("rev-parse", f"{head.rev}^{{commit}}")
        )
    except DistbenchError:
        commit = None
    return Night.model_validate(
        {
            "schema": SCHEMA,
            "created": created,
            "commit": commit,
            "head": head.describe(),
            "reference": reference,
            "reference_error": ref_error,
            "pairs": args.pairs,
            "alpha": args.alpha,
            "budget_s": args.budget,
            "elapsed_s": time.monotonic() - start,
            "rows": rows,
            "bridge": bridge,
        }
    )


def _ab_args(args: argparse.Namespace, output: Path) -> argparse.Namespace:
    """The flags commands/ab.py's `alternate` reads, for a night's pairs (gate/relative.py's pair_plan)."""
    from ..gate.relative import pair_plan

    return argparse.Namespace(
        timeout=args.timeout,
        output=output,
        interleave="windows",
        numerics="off",
        alpha=args.alpha,
        threshold=0.02,
        min_effect=0.005,
        **pair_plan(args.pairs, args.quota),
        budget=args.budget,
        device_metric=None,
    )


def _against(
    args: argparse.Namespace,
    configs: list[RunConfig],
    device: str,
    variants: tuple[Variant, Variant],
    output: Path,
    console: Console,
) -> list[NightRow]:
    """`configs` of variants (reference, head) interleaved for the night's fixed pairs through `distbench ab`'s
    servers (commands/ab.py's alternate; min_pairs = max_pairs = look_every, so no configuration stops early);
    every run saved under `output`."""
    from ..gate.relative import night_rows
    from .ab import alternate

    output.mkdir(parents=True, exist_ok=True)  # the servers' logs go there from the start
    report = alternate(_ab_args(args, output), configs, device, variants, console)
    return night_rows(report, args.alpha)


def _alone(
    args: argparse.Namespace, configs: list[RunConfig], device: str, head: Variant, console: Console
) -> list[NightRow]:
    """Head's absolute figures alone (the reference could not run): `--pairs` runs of each configuration."""
    import tempfile

    from ..gate.relative import head_alone
    from ..gate.variants import VariantProcess
    from ..results import save_result

    console.print(f"head alone: {len(configs)} configuration(s), {args.pairs} runs each")
    with tempfile.TemporaryDirectory(prefix="distbench-nightly-") as tmp:
        server = VariantProcess(head, Path(tmp), device, args.output)
        try:
            server.start()

            def go(cfg: RunConfig) -> dict[str, Any]:
                r = server.run(cfg.to_dict(), args.timeout) or {
                    "status": "error",
                    "error": "head died or hung",
                }
                if "schema" in r:
                    save_result(r, args.output / "runs" / "head")
                return r

            return head_alone(configs, go, args.pairs, server.recycle)
        finally:
            server.close()
            server.remove_checkout()


def _table(night: Night, console: Console) -> None:
    """The short table last: each row's gated ratios with intervals, and both sides' step times."""
    from rich.table import Table

    t = Table(
        "configuration",
        "pairs",
        "metric",
        "head/reference [interval]",
        "head",
        "reference",
        title=f"night against {night.reference.describe} ({night.reference.id})",
    )
    for r in night.rows:
        shown = [m for m, x in r.ratios.items() if x.gated] or ["step_time_s"]
        for m in shown:
            x = r.ratios.get(m)
            ratio = f"{x.ratio:.4f} [{x.low:.4f}, {x.high:.4f}]" if x else (r.error or "—")[:60]
            h, ref = r.head.get(m), r.reference.get(m)
            t.add_row(r.label, str(r.pairs), m, ratio, f"{h:.5g}" if h else "—", f"{ref:.5g}" if ref else "—")
    console.print(t)
