"""`distbench run`: benchmark a matrix of configurations, write results, print a seed-style table."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import (
    OPTIMIZERS,
    PRECISIONS,
    TIMINGS,
    DropoutRate,
    LoraTarget,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    parse_list,
    parse_value,
)
from ..errors import ConfigError, first_line


def _arg(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a validator that raises ConfigError: its message becomes the usage error."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ConfigError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert


def _strategies(text: str) -> list[str]:
    """Strategy names, or `all`: every registry entry (those that cannot run here are skipped, with why)."""
    from ..strategies import REGISTRY, get_spec

    if text.strip() == "all":
        return list(REGISTRY)
    return [get_spec(s).name for s in parse_list(str, text, "strategy list")]


def _models(text: str) -> list[str]:
    from ..workloads.models import check_model_name

    names = parse_list(str, text, "model list")
    for name in names:
        check_model_name(name)
    return names


def _output_dir(text: str) -> Path:
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{text} exists and is not a directory; name a directory for the results")
    return path


def _typed(annotation: Any) -> Callable[[str], Any]:
    """An argparse type for one value of `annotation` (see config.py), e.g. a positive int."""
    return _arg(lambda text: parse_value(annotation, text, "value"))


def add_recipe_flags(p: argparse.ArgumentParser) -> None:
    """The flags of how a configuration trains (batch, clipping, recomputation, dropout, LoRA, the user's
    DeepSpeed config), which `distbench run` and `distbench ab` share (recipe_fields reads them)."""
    p.add_argument(
        "--global-batch", type=_typed(PositiveInt), help="samples per optimizer step, over all ranks"
    )
    p.add_argument(
        "--clip-grad-norm",
        type=_typed(NonNegativeFloat),
        help="clip gradients to this global norm "
        "before each step, as each strategy's users do (default 0: off)",
    )
    p.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="recompute each transformer block's "
        "activations in backward (transformers' activation_checkpointing_enable)",
    )
    p.add_argument(
        "--dropout",
        type=_typed(DropoutRate),
        help="the model's dropout rate, each sample's masks from its own random stream (default 0: off)",
    )
    p.add_argument(
        "--lora-rank",
        type=_typed(NonNegativeInt),
        help="fine-tune LoRA adapters of this rank "
        "through peft, the base weights frozen (default 0: train every weight)",
    )
    p.add_argument(
        "--lora-alpha", type=_typed(PositiveInt), help="scale the adapters by alpha / rank (default 16)"
    )
    p.add_argument(
        "--lora-targets",
        type=_arg(lambda text: tuple(parse_list(LoraTarget, text, "LoRA target"))),
        help="comma-separated module names to adapt (default: GPT-2's c_attn,c_proj; Llama's "
        "q_proj,k_proj,v_proj,o_proj)",
    )
    p.add_argument("--ds-config", help="DeepSpeed config JSON merged into the zero* strategies' config")


#: RunConfig fields add_recipe_flags sets from a value given (an absent flag leaves the field to the defaults).
RECIPE_FIELDS = ("global_batch", "clip_grad_norm", "dropout", "lora_rank", "lora_alpha", "lora_targets")


def recipe_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The RunConfig fields add_recipe_flags' flags give, the user's DeepSpeed config under options."""
    out: dict[str, Any] = {k: getattr(args, k) for k in RECIPE_FIELDS if getattr(args, k) is not None}
    if args.activation_checkpointing:
        out["activation_checkpointing"] = True
    if args.ds_config:
        out["options"] = {"ds_config": args.ds_config}
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    """`distbench run`'s flags: long, one add_argument per flag, read best in one place."""
    p = sub.add_parser(
        "run",
        help="benchmark strategies x world sizes on this machine and write results",
        description="Without flags: GPUs when present (bf16, gpt2-124m, every power-of-two GPU "
        "count), otherwise gloo on CPU with a tiny model.",
    )
    p.add_argument(
        "--config",
        help="matrix YAML (strategies, world_sizes, models, precisions, repeats, "
        "and RunConfig fields); flags given too override it",
    )
    p.add_argument(
        "--strategy",
        "-s",
        action="append",
        type=_arg(_strategies),
        help="strategy name, or `all` (every strategy; those that cannot run here are skipped); "
        "repeat or comma-separate",
    )
    p.add_argument(
        "--world-size",
        "-n",
        action="append",
        help="world size; repeat or comma-separate",
        type=_arg(lambda text: parse_list(PositiveInt, text, "world size")),
    )
    p.add_argument(
        "--model", "-m", action="append", type=_arg(_models), help="model name or module:function factory"
    )
    p.add_argument(
        "--precision",
        action="append",
        choices=PRECISIONS,
        help="fp16 trains with dynamic loss scaling (GradScaler; DeepSpeed's fp16 section)",
    )
    p.add_argument("--steps", type=_typed(PositiveInt), help="timed steps")
    p.add_argument("--warmup", type=_typed(NonNegativeInt), help="untimed warm-up steps")
    p.add_argument(
        "--micro-batch",
        type=_typed(PositiveInt),
        help="samples per forward/backward on a rank (the rest of a rank's share is accumulated)",
    )
    p.add_argument("--seq-len", type=_typed(PositiveInt), help="default: the model's")
    p.add_argument(
        "--repeats",
        type=_typed(PositiveInt),
        help="separate runs of each configuration (the compare gate wants >= 6)",
    )
    p.add_argument(
        "--windows",
        type=_typed(PositiveInt),
        help="timed windows the steps are split into "
        "(each between two syncs; the step time is their median; default 1)",
    )
    p.add_argument(
        "--until-ci",
        type=_typed(NonNegativeFloat),
        help="time more windows until the 95%% interval of the median window is within +/- this fraction of "
        "it (e.g. 0.01), a slow start moved to the warm-up; 0: exactly --windows windows",
    )
    p.add_argument(
        "--max-windows", type=_typed(PositiveInt), help="the most windows --until-ci times (default 12)"
    )
    p.add_argument(
        "--side-by-side",
        action=argparse.BooleanOptionalAction,
        help="run configurations at the same time on disjoint GPUs (faster; they share the host, which moves "
        "host-bound figures, and each is timed alone on its GPUs, as --one-at-a-time); default: off, or the "
        "--config file's `side_by_side`",
    )
    p.add_argument(
        "--one-at-a-time",
        action=argparse.BooleanOptionalAction,
        help="time each configuration alone, one after the other (speedups then move with the host's speed "
        "between runs); default: the strategies of a world size resident at once, their timed windows "
        "taking turns, so speedups come from paired windows with an interval (or the --config file's "
        "`one_at_a_time`)",
    )
    add_recipe_flags(p)
    p.add_argument(
        "--optimizer", choices=OPTIMIZERS, help="AdamW implementation (default auto: fused on CUDA)"
    )
    p.add_argument(
        "--timing",
        choices=TIMINGS,
        help="events (default): no sync inside timed windows; sync: a device sync around every step",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each transformer block")
    p.add_argument(
        "--bind-cpus",
        action=argparse.BooleanOptionalAction,
        help="bind each rank to its own equal slice of this process's CPUs, its GPU's share where "
        "configurations run side by side; where their windows take turns (the default), the training threads "
        "on the slice's first CPU as well, so that every row's host work runs on the same vCPU "
        "(DISTBENCH_BIND_CPUS=pinned; exclusive with --one-at-a-time or --side-by-side; a mode the variable "
        "already names stays; recorded in each result's env); default: on GPUs",
    )
    p.add_argument(
        "--gc-during-steps",
        action="store_true",
        help="leave Python's garbage collector on "
        "during timed steps (default: one full collection before them, off while they run)",
    )
    p.add_argument(
        "--trace",
        action=argparse.BooleanOptionalAction,
        help="also profile each configuration (GPU) and record HolisticTraceAnalysis's compute/non-compute/"
        "idle and overlap breakdown; --no-trace: none, whatever the --config file's `trace` says",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    p.add_argument(
        "--output",
        "-o",
        default=Path("distbench-results"),
        type=_arg(_output_dir),
        help="directory for result JSON files",
    )
    p.add_argument(
        "--timeout",
        type=_typed(PositiveFloat),
        default=1800.0,
        help="seconds before a hung configuration fails",
    )
    p.add_argument(
        "--prometheus",
        metavar="[ADDR:]PORT",
        help="serve live GPU (DCGM field names) and step "
        "metrics for Prometheus on this port (all interfaces unless ADDR is given)",
    )
    p.add_argument(
        "--textfile",
        metavar="DIR",
        help="also keep DIR/distbench.prom current for node_exporter's textfile collector",
    )
    p.set_defaults(func=run)


def _flat(values: list[list[Any]] | None) -> list[Any] | None:
    return [x for v in values for x in v] if values else None


def build_matrix(args: argparse.Namespace, device_type: str, device_count: int):
    """The YAML's (or the machine's default) matrix with the flags given on top, validated as one."""
    from ..matrix import Matrix, default_matrix, load_matrix

    m = load_matrix(args.config) if args.config else default_matrix(device_type, device_count)
    base = dict(m.base)
    for key in (
        "steps",
        "warmup",
        "micro_batch",
        "seq_len",
        "optimizer",
        "timing",
        "windows",
        "until_ci",
        "max_windows",
    ):
        if getattr(args, key) is not None:
            base[key] = getattr(args, key)
    given = recipe_fields(args)
    base.update({k: v for k, v in given.items() if k != "options"})
    if "options" in given:
        base["options"] = {**base.get("options", {}), **given["options"]}
    if args.steps is not None and args.windows is None and base.get("windows", 1) > args.steps:
        # the grid's windows of two steps cannot split fewer steps than they are: a window a step instead
        # (`--steps 3` on a GPU stopped every run at "windows must be at most steps")
        base["windows"] = args.steps
    if args.compile:
        base["compile"] = True
    if args.gc_during_steps:
        base["gc_during_steps"] = True
    return Matrix(
        strategies=_flat(args.strategy) or m.strategies,
        world_sizes=_flat(args.world_size) or m.world_sizes,
        models=_flat(args.model) or m.models,
        precisions=args.precision or m.precisions,
        base=base,
        repeats=args.repeats or m.repeats,
        trace=m.trace if args.trace is None else args.trace,
        reference=m.reference,
        side_by_side=m.side_by_side if args.side_by_side is None else args.side_by_side,
        one_at_a_time=m.one_at_a_time if args.one_at_a_time is None else args.one_at_a_time,
    )


def fit_world_sizes(world_sizes: list[int], gpus: int, *, asked: bool) -> tuple[list[int], list[str]]:
    """The world sizes to run on `gpus` GPUs, and a skip note for each left out. Sizes a config file lists
    beyond the machine are left out, so one config serves a 2- and a 4-GPU runner; sizes asked for on the
    command line are all kept (the pool refuses what cannot run, naming the GPUs it has), as is every size
    when none would fit."""
    fits = [ws for ws in world_sizes if ws <= gpus]
    if asked or not fits:
        return list(world_sizes), []
    notes = [
        f"world size {ws}: the config lists it, this machine has {gpus} GPU(s)"
        for ws in world_sizes
        if ws > gpus
    ]
    return fits, notes


def binding_mode(matrix: Any) -> str:
    """The CPU binding `--bind-cpus` means for this matrix: pinned where its rows' windows take turns (the
    default), so that each row's host work runs on the same vCPU and the paired windows' ratios cancel the
    vCPU's speed (on one H200 VM the same launch work took 2.9-4.6 ms on different vCPUs at once, and unpinned
    speedups moved up to 28% between two runs, pinned at most 2%: results/table-pinned-h200-2026-12-02);
    exclusive where rows run alone (--one-at-a-time) or at once on disjoint GPUs (--side-by-side), where one
    shared CPU would be a bottleneck, not a control."""
    return "exclusive" if matrix.one_at_a_time or matrix.side_by_side else "pinned"


def _usage_error(message: str) -> int:
    """A refused run: one line on stderr, exit 2 (the same shape as argparse's own usage errors)."""
    print(f"distbench run: error: {message}", file=sys.stderr)
    return 2


def run(args: argparse.Namespace, pools: Any = None, device_count: int | None = None) -> int:
    """`distbench run`; `distbench launch` passes its Cluster as `pools` and the launched world as
    `device_count` (default: rank pools on this machine's GPUs)."""
    from rich.console import Console

    from ..errors import DistbenchError
    from ..measure.telemetry import parse_listen
    from ..report.tables import CONSOLE_WIDTH, results_table
    from ..runtime import affinity
    from ..runtime.pool import PoolManager, cuda_device_count
    from ..strategies import get_spec
    from ..strategies.lora import check_lora

    console = Console(width=None if Console().is_terminal else CONSOLE_WIDTH)
    n_cuda = cuda_device_count() if device_count is None else device_count
    device_type = args.device or ("cuda" if n_cuda else "cpu")
    if device_type == "cuda" and not n_cuda:
        return _usage_error("--device cuda but no CUDA device is visible; use --device cpu")
    try:
        matrix = build_matrix(args, device_type, n_cuda)
        bind = device_type == "cuda" if args.bind_cpus is None else args.bind_cpus
        if bind:  # a mode the caller set stays: `--bind-cpus` asks for binding, not for its kind
            os.environ[affinity.ENV] = os.environ.get(affinity.ENV) or binding_mode(matrix)
        elif args.bind_cpus is False:
            os.environ.pop(affinity.ENV, None)
        affinity.rank_cpus(0, max(matrix.world_sizes))  # a bad setting or too few CPUs: say so now
        listen = parse_listen(args.prometheus) if args.prometheus else None
        pools = pools or PoolManager(device_type)
        fitted: list[str] = []
        if device_type == "cuda":
            kept, fitted = fit_world_sizes(matrix.world_sizes, n_cuda, asked=bool(_flat(args.world_size)))
            matrix = dataclasses.replace(matrix, world_sizes=kept)
            for ws in matrix.world_sizes:
                pools.check_world_size(ws)
        configs, skipped = matrix.configs(device_type, n_cuda if device_type == "cuda" else None)
        skipped = fitted + skipped
        for cfg in configs:
            if cfg.options:  # what a user passes to a strategy is checked by the strategy before ranks start
                get_spec(cfg.strategy).check_config(cfg)
        for cfg in {(c.model, c.lora_targets): c for c in configs if c.lora_rank}.values():
            check_lora(cfg)  # targets the model lacks: refused here, one meta build per model and targets
    except (DistbenchError, ValueError) as e:
        return _usage_error(" ".join(str(e).split()))
    for note in skipped:
        console.print(f"[yellow]skip[/] {note}")
    if not configs:
        return _usage_error("nothing to run: every configuration was skipped (see the skip lines above)")
    n_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    if device_type == "cpu" and max(matrix.world_sizes) > n_cpus:
        console.print(
            f"[yellow]warning[/] world size {max(matrix.world_sizes)} on {n_cpus} CPU(s): ranks share "
            "cores, so times measure contention; use world sizes up to the CPU count"
        )
    console.print(
        f"distbench run: {len(configs)} configuration(s) x {matrix.repeats} on {device_type}; "
        f"results -> {args.output}"
    )
    started = time.time()
    try:
        results = _run_with_progress(matrix, len(configs), args, pools, n_cuda, listen, console)
    except KeyboardInterrupt:
        saved = [p for p in Path(args.output).glob("*.json") if p.stat().st_mtime >= started]
        console.print(
            f"[red]stopped[/]: {len(saved)} of {len(configs) * matrix.repeats} result(s) finished and are kept in "
            f"{args.output} (`distbench report {args.output}` reads them); the rest did not run"
        )
        raise
    console.print(results_table(results))
    return _print_failures(results, args, console)


def _run_with_progress(
    matrix: Any, n_configs: int, args: argparse.Namespace, pools: Any, n_cuda: int, listen: Any, console: Any
) -> list[dict[str, Any]]:
    """run_matrix under a progress bar, feeding telemetry when asked; the pools are closed when it returns."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..matrix import run_matrix
    from ..measure.telemetry import Telemetry

    telemetry = (
        Telemetry(listen=listen, textfile_dir=args.textfile).start() if listen or args.textfile else None
    )
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task("running", total=n_configs * matrix.repeats)

        def advance(cfg, result):
            if telemetry is not None:
                telemetry.record(result)
            progress.update(
                task, advance=1, description=f"{cfg.strategy} ws{cfg.world_size} {result['status']}"
            )

        try:
            return run_matrix(
                matrix,
                out_dir=args.output,
                pools=pools,
                on_result=advance,
                timeout=args.timeout,
                device_count=n_cuda,
            )
        finally:
            pools.close_all()
            if telemetry is not None:
                telemetry.close()


def _print_failures(results: list[dict[str, Any]], args: argparse.Namespace, console: Any) -> int:
    """One line per failed configuration and per missing trace breakdown; the exit status of the run."""
    from rich.markup import escape

    # Out of memory is a failed configuration too (exit 1): a run has no OOM edge to find, so CI must not read
    # a matrix whose configurations did not fit as a success.
    failed = [r for r in results if r["status"] != "ok"]
    for r in failed:
        c = r["config"]
        first = (r.get("error") or "").splitlines()[:1]
        what = "out of memory" if r["status"] == "oom" else "failed"
        console.print(
            f"[red]{what}[/] {c['strategy']} ws{c['world_size']} {c['model']}: "
            f"{escape(first[0] if first else '')} (every rank's traceback is in the result JSON under "
            f"{escape(str(args.output))})"
        )
    for r in results:
        err = (r.get("trace") or {}).get("error")
        if err:
            c = r["config"]
            console.print(
                f"[yellow]no trace breakdown[/] {c['strategy']} ws{c['world_size']} {c['model']}: "
                f"{escape(first_line(err))}"
            )
    return 1 if failed else 0
