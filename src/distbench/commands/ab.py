"""`distbench ab`: the interleaved A/B performance gate of two variants on this machine's GPUs (or CPUs)."""

from __future__ import annotations

import argparse
import math
import os
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import PRECISIONS

if TYPE_CHECKING:
    from rich.console import Console

    from ..config import RunConfig
    from ..gate.ab import ABReport, ConfigOutcome, Pair
    from ..gate.variants import Variant

#: Per-tier defaults: GPUs as seed 004 measures (bf16, sequence 1024) at a device-bound micro-batch, sized to
#: the card when --micro-batch is not given (gate/fit.py); at least three windows a run, so one stalled
#: window costs the run's median nothing (with two, the median is their mean: on synthetic runs with a
#: stalled window in 50, a 2% slowdown was found 54 times in 100 instead of 90+), and on GPUs six of two
#: steps, so that interleaved windows follow the host's speed closely; four steps profiled one by one, of
#: which each kernel's least disturbed run counts (measure/devicetime.py).
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {
        "model": "gpt2-large",
        "precision": "bf16",
        "seq_len": 1024,
        "micro_batch": 16,
        "steps": 12,
        "windows": 6,
        "warmup": 2,
        "device_time_steps": 4,
    },
    "cpu": {
        "model": "gpt2-tiny",
        "precision": "fp32",
        "seq_len": 0,
        "micro_batch": 2,
        "steps": 6,
        "windows": 3,
        "warmup": 1,
        "device_time_steps": 0,
    },
}


#: The numerics' workload on GPUs (numerics_configurations).
NUMERICS: dict[str, Any] = {"model": "gpt2-124m", "micro_batch": 2, "seq_len": 256}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`distbench ab`'s flags: the variants, the comparison's (add_comparison_flags), the numerics', where it
    writes."""
    from ..gate import numerics

    p = sub.add_parser(
        "ab",
        help="A/B gate: alternate two variants run by run on the same GPUs until decided",
        description="Compare HEAD against BASE, each served by its own process with persistent rank pools, "
        "alternating runs (AB, BA, ...) per configuration, adding pairs until each configuration "
        "is decided or --budget runs out. Variants: rev=REV, tree=DIR, path=DIR, python=EXE, "
        "env.NAME=VALUE (comma-separated; empty: this checkout). First, unless --numerics off, base and head "
        "train each configuration's first steps in deterministic mode and their losses and gradient norms "
        "are compared step by step (docs/numerics.md). Exit 0 pass, 1 regression, 2 usage, 3 undecided, "
        "4 numerics diverged.",
    )
    p.add_argument("--base", default="", help="the baseline variant (default: this checkout)")
    p.add_argument(
        "--head", default="", help="the candidate variant (default: this checkout, i.e. an A/A run)"
    )
    add_comparison_flags(p)
    numerics.add_flags(p)
    p.add_argument(
        "--output",
        "-o",
        type=Path,
        default=Path("distbench-ab"),
        help="directory for every run's result (base/, head/) and ab.json, ab.md",
    )
    p.add_argument("--github-summary", action="store_true", help="append the table to $GITHUB_STEP_SUMMARY")
    p.set_defaults(func=run)


def add_comparison_flags(
    p: argparse.ArgumentParser,
    *,
    max_pairs: int | None = None,
    budget: float = 600.0,
    each: str = "comparison",
) -> None:
    """The flags of one interleaved comparison: its configurations and the gate's rule and schedule (`distbench
    ab`'s, and each probe's of `distbench bisect`, whose cap on pairs and seconds, `max_pairs` and `budget`,
    is its own). Long: one add_argument per flag, read best in one place."""
    from ..gate.ab import LOOK_EVERY, MAX_PAIRS, MIN_PAIRS
    from ..metrics import names
    from .run import add_recipe_flags

    max_pairs = max_pairs or MAX_PAIRS
    from ..strategies import default_strategies

    p.add_argument(
        "--strategy",
        "-s",
        action="append",
        help=f"strategies; repeat or comma-separate (default: {','.join(default_strategies('ab'))})",
    )
    p.add_argument(
        "--world-size", "-n", type=int, help="ranks per configuration (default: GPUs here, or 2 on CPU)"
    )
    p.add_argument("--model", "-m", help="model (default: gpt2-large on GPUs, gpt2-tiny on CPU)")
    p.add_argument(
        "--micro-batch",
        type=int,
        help="per-GPU micro-batch (default on GPUs: 16, device-bound, with activation checkpointing or "
        "smaller where two runs would not fit on the card, as the memory model predicts: gate/fit.py)",
    )
    p.add_argument("--seq-len", type=int, help="sequence length (default: 1024 on GPUs, the model's on CPU)")
    p.add_argument("--precision", choices=PRECISIONS)
    p.add_argument("--steps", type=int, help="timed steps per run")
    p.add_argument("--windows", type=int, help="timed windows per run (the run's value is their median)")
    p.add_argument("--warmup", type=int, help="untimed steps per run")
    p.add_argument("--optimizer", choices=["auto", "fused", "foreach", "forloop"], default="auto")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    p.add_argument(
        "--threshold",
        type=float,
        default=0.02,
        help="the regression that must be ruled out to pass, as a fraction (default 0.02)",
    )
    p.add_argument(
        "--min-effect",
        type=float,
        default=0.005,
        help="smallest significant change reported as a regression (default 0.005: the estimate of a 1%% "
        "slowdown falls on either side of 1%%)",
    )
    p.add_argument(
        "--device-metric",
        choices=names(ab="device"),
        help="the device-side metric to gate, fixed before the first pair (default: device_compute_s at one "
        "rank, device_compute_floor_s at two or more); the others are reported beside it",
    )
    p.add_argument("--alpha", type=float, default=0.05, help="family-wise false-alarm rate (default 0.05)")
    p.add_argument(
        "--min-pairs",
        type=int,
        default=MIN_PAIRS,
        help=f"pairs before the first decision (default {MIN_PAIRS})",
    )
    p.add_argument(
        "--max-pairs", type=int, default=max_pairs, help=f"most pairs per configuration (default {max_pairs})"
    )
    p.add_argument(
        "--look-every", type=int, default=LOOK_EVERY, help=f"pairs between decisions (default {LOOK_EVERY})"
    )
    p.add_argument(
        "--interleave",
        choices=["windows", "runs"],
        default="windows",
        help="windows (default): each pair of runs alternates its timed windows, both variants built at "
        "once, so host and clock drift cancel window by window; runs: whole runs alternate (a "
        "configuration that does not fit twice in device memory falls back to this by itself)",
    )
    p.add_argument("--budget", type=float, default=budget, help=f"seconds per {each} (default {budget:.0f})")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before one run counts as hung")
    p.add_argument(
        "--bind-cpus",
        action="store_true",
        help="bind each rank to its own slice of the CPUs; with --interleave windows, both variants' training "
        "threads of a rank on that slice's first CPU",
    )
    add_recipe_flags(p)


def check_flags(args: argparse.Namespace) -> str | None:
    if not 0 < args.alpha < 0.5:
        return f"--alpha must be between 0 and 0.5, got {args.alpha}"
    if not 0 < args.min_effect <= args.threshold < 1:
        return f"need 0 < --min-effect <= --threshold < 1, got {args.min_effect} and {args.threshold}"
    if args.min_pairs < 3 or args.max_pairs < args.min_pairs:
        return f"need 3 <= --min-pairs <= --max-pairs, got {args.min_pairs} and {args.max_pairs}"
    if args.budget <= 0 or args.timeout <= 0:
        return "--budget and --timeout must be positive"
    if getattr(args, "numerics_steps", 1) < 1 or (getattr(args, "numerics_repeats", None) or 0) < 0:
        steps, repeats = args.numerics_steps, args.numerics_repeats
        return f"need --numerics-steps >= 1 and --numerics-repeats >= 0, got {steps} and {repeats}"
    return None


def configurations(args: argparse.Namespace, device: str, n_cuda: int) -> list[RunConfig]:
    """One configuration per strategy at the tier's workload, flags on top (the recipe flags `distbench run`
    takes too), sized to the card where neither micro-batch nor global batch is given (gate/fit.py);
    DistbenchError for one that cannot run here."""
    from ..config import RunConfig
    from ..errors import DistbenchError
    from ..gate import fit
    from ..strategies import default_strategies, get_spec
    from .run import recipe_fields

    d = DEFAULTS[device]
    given = args.strategy or [",".join(default_strategies("ab"))]
    strategies = [s.strip() for v in given for s in v.split(",") if s]
    ws = args.world_size or (n_cuda if device == "cuda" else 2)
    mb = args.micro_batch or d["micro_batch"]
    recipe = recipe_fields(args)
    options = recipe.pop("options", {})
    sized = device == "cuda" and args.micro_batch is None and "global_batch" not in recipe
    card = fit.card_bytes() if sized else None
    precision = args.precision or d["precision"]
    if options and not any(get_spec(s).own_options(options) for s in strategies):
        raise DistbenchError(
            f"--ds-config applies to the zero* strategies only, and none of {strategies} is one"
        )
    configs = []
    for s in strategies:
        spec = get_spec(s)
        reason = spec.unsupported_reason(device, ws, n_cuda if device == "cuda" else None, precision)
        if reason:
            raise DistbenchError(reason)
        cfg = RunConfig(
            strategy=s,
            world_size=ws,
            model=args.model or d["model"],
            precision=precision,
            seq_len=d["seq_len"] if args.seq_len is None else args.seq_len,
            micro_batch=mb,
            steps=args.steps or d["steps"],
            windows=args.windows or d["windows"],
            warmup=d["warmup"] if args.warmup is None else args.warmup,
            optimizer=args.optimizer,
            device_time_steps=d["device_time_steps"],
            deterministic=False,
            **{"global_batch": mb * ws, **recipe},
            options=spec.own_options(options),
        )
        spec.check_config(cfg)  # a malformed or conflicting --ds-config, before any variant starts
        configs.append(fit.choose(cfg, fit.n_params(cfg.model), card) if card else cfg)
    return configs


def numerics_configurations(
    args: argparse.Namespace, configs: list[RunConfig], device: str
) -> list[RunConfig]:
    """What the numerics train of each configuration: on GPUs, the NUMERICS workload where --model,
    --micro-batch, --global-batch and --seq-len leave it to the tier (the code paths a recipe runs are the same
    at any size, and the whole recipe set fits its budget: docs/gate.md); on CPU, the configurations as they are.
    Activation checkpointing only where asked (the card's sizing may have turned it on for speed). None where
    the flags ask for no numerics (a night's flags have no workload flags to read)."""
    from ..gate.numerics import compares

    if not compares(args):
        return []
    if device != "cuda":
        return configs
    out = []
    for c in configs:
        mb = args.micro_batch or NUMERICS["micro_batch"]
        c = c.replace(
            model=args.model or NUMERICS["model"],
            seq_len=NUMERICS["seq_len"] if args.seq_len is None else args.seq_len,
            micro_batch=mb,
            global_batch=args.global_batch or mb * c.world_size,
            activation_checkpointing=args.activation_checkpointing,
        )
        out.append(c)
    return out


def _publish(report: ABReport, args: argparse.Namespace) -> None:
    """The verdict table on the console, ab.md and ab.json under --output, and the job summary if asked."""
    import json

    from rich.console import Console

    from ..report import gate as render

    Console(width=None if Console().is_terminal else 160).print(render.to_rich(report))
    md = render.to_markdown(report)
    (args.output / "ab.md").write_text(md)
    (args.output / "ab.json").write_text(json.dumps(render.to_json(report), indent=1, default=str) + "\n")
    if args.github_summary and os.environ.get("GITHUB_STEP_SUMMARY"):
        with open(os.environ["GITHUB_STEP_SUMMARY"], "a") as f:
            f.write(md)


def run(args: argparse.Namespace) -> int:
    """`distbench ab`: check the flags, build the configurations, alternate the variants, publish the verdict."""
    from rich.console import Console
    from rich.markup import escape

    from ..errors import DistbenchError
    from ..gate.variants import parse_variant
    from ..runtime.pool import cuda_device_count

    console = Console(width=None if Console().is_terminal else 160)
    problem = check_flags(args)
    if problem:
        console.print(f"[red]error:[/] {problem}")
        return 2
    n_cuda = cuda_device_count()
    device = args.device or ("cuda" if n_cuda else "cpu")
    try:
        base_v, head_v = parse_variant("base", args.base), parse_variant("head", args.head)
        configs = configurations(args, device, n_cuda)
    except DistbenchError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    bind_cpus(args)
    args.output.mkdir(parents=True, exist_ok=True)
    if args.numerics == "suite":
        return suite(args, configs, device, (base_v, head_v), console)
    try:
        report = alternate(args, configs, device, (base_v, head_v), console)
    except DistbenchError as e:
        console.print(f"[red]error:[/] {escape(str(e))}")
        return 2
    report.base_desc, report.head_desc = base_v.describe(), head_v.describe()
    _publish(report, args)
    return report.exit_code


def suite(
    args: argparse.Namespace,
    configs: list[RunConfig],
    device: str,
    variants: tuple[Variant, Variant],
    console: Console,
) -> int:
    """--numerics suite: the invariant tests under base, then head (gate/suite_ab.py), over the run's strategies
    up to its world size; the tests failing under head alone, per strategy, in ab.md and ab.json."""
    import json
    import tempfile

    from ..gate import suite_ab
    from ..gate.variants import VariantProcess
    from ..report import suite as render

    strategies = [c.strategy for c in configs]
    found: dict[str, dict[str, str]] = {}
    errors: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="distbench-ab-") as tmp:
        for v in variants:
            proc = VariantProcess(v, Path(tmp), device, args.output)
            console.print(f"distbench ab: the invariant tests under {v.label} ({v.describe()}) ...")
            try:
                got = suite_ab.run_side(proc, args.output, strategies, args.world_size, args.suite_timeout)
            finally:
                proc.remove_checkout()
            if isinstance(got, str):
                errors[v.label] = got
            else:
                found[v.label] = got
    c = (
        suite_ab.compare(found["base"], found["head"], strategies)
        if not errors
        else suite_ab.SuiteComparison()
    )
    c.errors = errors
    base, head = (v.describe() for v in variants)
    md = render.to_markdown(c, base, head)
    (args.output / "ab.md").write_text(md)
    (args.output / "ab.json").write_text(json.dumps(render.to_json(c, base, head), indent=1) + "\n")
    console.print(md, markup=False)
    return c.exit_code


def sizes(configs: list[RunConfig], device: str) -> tuple[str, ...]:
    """What the memory model predicts of each configuration on this machine's card (gate/fit.py), on GPUs."""
    if device != "cuda":
        return ()
    from ..gate import fit

    card = fit.card_bytes()
    return tuple(fit.describe(c, fit.n_params(c.model), card) for c in configs)


def bind_cpus(args: argparse.Namespace) -> None:
    """--bind-cpus: each rank on its own CPUs; windows that take turns share their cores too
    (runtime/affinity.py)."""
    if args.bind_cpus:
        os.environ["DISTBENCH_BIND_CPUS"] = "pinned" if args.interleave == "windows" else "exclusive"


def alternate(
    args: argparse.Namespace,
    configs: list[RunConfig],
    device: str,
    variants: tuple[Variant, Variant],
    console: Console,
    gate: tuple[str, ...] | None = None,
) -> ABReport:
    """Serve each variant from its own process and checkout, alternate them over `configs` (gate/ab.py), save
    every run's result under --output/<variant>; the processes and checkouts are gone when it returns.
    DistbenchError when a variant cannot start (VariantStartError naming it). `gate`: run_ab's. Long: its
    callbacks close over the servers, which live only as long as the temporary directory."""
    import tempfile

    from ..gate.ab import ABReport, label_of, run_ab
    from ..gate.numerics import NO_SPEED, compare_servers
    from ..gate.variants import VariantProcess
    from ..results import save_result

    base_v, head_v = variants
    with tempfile.TemporaryDirectory(prefix="distbench-ab-") as tmp:
        servers = {v.label: VariantProcess(v, Path(tmp), device, args.output) for v in (base_v, head_v)}

        def runner(label: str) -> Callable[[RunConfig], dict[str, Any]]:
            def go(cfg: RunConfig) -> dict[str, Any]:
                result = servers[label].run(cfg.to_dict(), args.timeout) or {
                    "status": "error",
                    "error": f"the {label} variant died or hung (log: {servers[label].log})",
                }
                if "schema" in result:
                    save_result(result, args.output / label)
                return result

            return go

        def recycle_all() -> None:
            for server in servers.values():
                server.recycle()

        class Interleaved:
            """Both servers as gate/ab.py's window interleaving drives them; finished runs are saved."""

            def __init__(self) -> None:
                self.sent: dict[str, bool] = {}

            def post(self, side: str, request: dict[str, Any]) -> None:
                self.sent[side] = servers[side].send({**request, "timeout": args.timeout})

            def reply(self, side: str) -> dict[str, Any]:
                got = servers[side].receive(args.timeout) if self.sent.get(side) else None
                if got is None:
                    return {
                        "status": "error",
                        "error": f"the {side} variant died or hung (log: {servers[side].log})",
                    }
                if "schema" in got:
                    save_result(got, args.output / side)
                return got

        def progress(o: ConfigOutcome, pair: Pair) -> None:
            b, h = pair.base["metrics"]["step_time_s"], pair.head["metrics"]["step_time_s"]
            w = pair.window_log_ratios
            windows = f"; windows {math.expm1(statistics.median(w)):+.2%}" if w else ""
            console.print(
                f"  {o.label} pair {len(o.pairs)} ({pair.order}): base {b * 1000:.2f} ms, "
                f"head {h * 1000:.2f} ms ({h / b - 1:+.2%}{windows})"
                + (f" [whole runs: {o.note}]" if o.note else "")
            )

        try:
            for server in servers.values():
                server.start()
            interleave = args.interleave
            old = [label for label, server in servers.items() if server.protocol < 2]
            if interleave == "windows" and old:
                interleave = "runs"
                console.print(
                    f"note: the {' and '.join(old)} variant's distbench runs whole runs only: runs alternate"
                )
                if os.environ.get("DISTBENCH_BIND_CPUS") == "pinned":  # a mode older servers refuse
                    os.environ["DISTBENCH_BIND_CPUS"] = "exclusive"
                    for server in servers.values():
                        server.close()
                        server.start()
            console.print(
                f"distbench ab: {len(configs)} configuration(s) on {device}; base {base_v.describe()} "
                f"vs head {head_v.describe()}; {interleave} interleaved; budget {args.budget:.0f} s"
            )
            numerics = compare_servers(
                args, numerics_configurations(args, configs, device), servers, console, label_of, device
            )
            if getattr(args, "numerics", "off") in NO_SPEED:
                return ABReport([], args.alpha, args.alpha, args.threshold, args.min_effect, 0.0, False, "", "",
                                numerics=numerics, speed=False)  # fmt: skip
            sizing = sizes(configs, device)
            for line in sizing:
                console.print(f"  {line}")
            report = run_ab(
                configs,
                runner("base"),
                runner("head"),
                alpha=args.alpha,
                threshold=args.threshold,
                min_effect=args.min_effect,
                min_pairs=args.min_pairs,
                max_pairs=args.max_pairs,
                look_every=args.look_every,
                budget_s=args.budget,
                on_pair=progress,
                between_rounds=recycle_all,
                servers=Interleaved() if interleave == "windows" else None,
                gate=gate,
                device=args.device_metric,
                quota=getattr(args, "quota", None),
            )
            report.sizing, report.numerics = sizing, numerics
            return report
        finally:
            for server in servers.values():
                server.close()
                server.remove_checkout()
