"""`distbench recommend`: which strategy to train a model with on N GPUs, measured rather than guessed.

Every strategy that runs here, with activation checkpointing off and on (where the model has the switch),
gets its largest micro-batch found by probes (distbench.recommend.search); each probe is one benchmark of
global batch = micro-batch x N (no accumulation), saved as a result JSON under --output. The ranked table,
the recommendation and recommendation.json come from those results.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from ..config import (
    PRECISIONS,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    Precision,
    parse_list,
)
from ..plausibility import check
from ..recommend import (
    GIB,
    Candidate,
    Headroom,
    Outcome,
    Predicted,
    agreement,
    headroom_bytes,
    peak_bytes,
    predicted_misfit,
    rank,
    rank_predicted,
    rivals,
    search,
    summary,
)
from ..results import load_results
from .run import _arg, _output_dir, _typed

AC_CHOICES = ("both", "off", "on")


def _strategy_names(text: str) -> list[str]:
    from ..strategies import get_spec

    return [get_spec(s).name for s in parse_list(str, text, "strategy list")]


def _model(text: str) -> str:
    from ..workloads.models import check_model_name

    return check_model_name(text.strip())


def _fraction(text: str) -> float:
    value = _typed(NonNegativeFloat)(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"headroom fraction {text!r} must be below 1 (0.1 keeps 10% free)")
    return float(value)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "recommend",
        help="find each strategy's largest micro-batch on N GPUs and rank them",
        description="Measure every strategy that runs here (activation checkpointing off and on) "
        "at its largest micro-batch before out-of-memory, rank them by tokens/s and recommend one.",
    )
    p.add_argument(
        "--model", "-m", required=True, type=_arg(_model), help="model name or module:function factory"
    )
    p.add_argument(
        "--gpus",
        "-n",
        type=_typed(PositiveInt),
        help="world size (default: every GPU of this machine; on CPU, 2 ranks)",
    )
    room = p.add_mutually_exclusive_group()
    room.add_argument(
        "--headroom-gib",
        type=_typed(NonNegativeFloat),
        default=0.0,
        help="device memory a fit must leave free, GiB (default 0); not checked on CPU",
    )
    room.add_argument(
        "--headroom-frac",
        type=_fraction,
        default=0.0,
        help="device memory a fit must leave free, as a fraction of the GPU's (e.g. 0.1)",
    )
    p.add_argument(
        "--strategies",
        "-s",
        type=_arg(_strategy_names),
        help="comma-separated candidates (default: every registered strategy)",
    )
    p.add_argument(
        "--activation-checkpointing",
        choices=AC_CHOICES,
        default="both",
        help="candidates with activation checkpointing off, on, or both (default)",
    )
    p.add_argument("--precision", choices=PRECISIONS, help="default: bf16 on GPUs, fp32 on CPU")
    p.add_argument("--seq-len", type=_typed(PositiveInt), help="default: the model's")
    p.add_argument(
        "--lora-rank",
        type=_typed(NonNegativeInt),
        help="recommend for LoRA fine-tuning at this adapter rank (default 0: every weight trains)",
    )
    p.add_argument("--ds-config", help="DeepSpeed config JSON merged into the zero* candidates' config")
    p.add_argument(
        "--max-micro-batch",
        type=_typed(PositiveInt),
        default=1024,
        help="largest micro-batch tried (default 1024)",
    )
    p.add_argument(
        "--max-probes",
        type=_typed(PositiveInt),
        default=16,
        help="benchmarks per candidate at most; a search cut short reports a lower bound (default 16)",
    )
    p.add_argument("--steps", type=_typed(PositiveInt), default=3, help="timed steps per probe (default 3)")
    p.add_argument(
        "--warmup",
        type=_typed(NonNegativeInt),
        default=3,
        help="untimed steps per probe (default 3: after 1, ZeRO-3 ran GPT-2 Large 3x slower on an H200)",
    )
    p.add_argument(
        "--table",
        type=Path,
        help="results of a `distbench run` (file or directory): say where its order at --gpus GPUs agrees "
        "with this ranking, and why not where it does not",
    )
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when a GPU is present")
    p.add_argument(
        "--predict",
        action="store_true",
        help="predict instead of measuring, for GPUs that need not be here (a cluster): which strategies' "
        "training state (parameters, gradients, optimizer state) fits --gpus GPUs of --gpu-memory-gib each, "
        "by the memory model; nothing runs",
    )
    p.add_argument(
        "--gpu-memory-gib", type=_typed(PositiveFloat), help="with --predict: each GPU's memory, GiB"
    )
    p.add_argument(
        "--gpus-per-node",
        type=_typed(PositiveInt),
        default=8,
        help="with --predict: GPUs a node (default 8); fsdp_hybrid replicates across the nodes",
    )
    p.add_argument(
        "--output",
        "-o",
        default=Path("distbench-recommend"),
        type=_arg(_output_dir),
        help="directory for every probe's result JSON and recommendation.json",
    )
    p.add_argument(
        "--timeout", type=_typed(PositiveFloat), default=1800.0, help="seconds before a hung probe fails"
    )
    p.set_defaults(func=run)


def _usage_error(message: str) -> int:
    print(f"distbench recommend: error: {message}", file=sys.stderr)
    return 2


def _checkpointable(model: str, seed: int) -> bool:
    """Whether the model has transformers' activation checkpointing switch (built on the meta device: free)."""
    from ..workloads import get_model

    built = get_model(model).build(seed, "meta")
    return any(
        hasattr(built, a) for a in ("activation_checkpointing_enable", "gradient_checkpointing_enable")
    )


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from ..config import RunConfig
    from ..errors import DistbenchError
    from ..matrix import Matrix
    from ..runtime.pool import cuda_device_count
    from ..strategies import REGISTRY, get_spec

    console = Console(width=None if Console().is_terminal else 140)
    if args.predict:
        return _predict(args, console)
    n_cuda = cuda_device_count()
    device = args.device or ("cuda" if n_cuda else "cpu")
    if device == "cuda" and not n_cuda:
        return _usage_error("--device cuda but no CUDA device is visible; use --device cpu")
    gpus = args.gpus or (n_cuda if device == "cuda" else 2)
    if device == "cuda" and gpus > n_cuda:
        return _usage_error(
            f"--gpus {gpus} but this machine has {n_cuda} CUDA device(s); use --gpus {n_cuda} or fewer"
        )
    precision: Precision = args.precision or ("bf16" if device == "cuda" else "fp32")
    headroom = Headroom(bytes=int(args.headroom_gib * GIB), fraction=args.headroom_frac)
    outcomes: list[Outcome] = []
    runnable: list[str] = []
    for name in args.strategies or list(REGISTRY):
        reason = get_spec(name).unsupported_reason(
            device, gpus, n_cuda if device == "cuda" else None, precision
        )
        if reason:
            outcomes.append(Outcome(Candidate(name, None), ruled_out=reason))
        else:
            runnable.append(name)
    try:
        table = load_results(args.table) if args.table else None
        base = _base(args)
        if (
            runnable
        ):  # the model loads, the sequence fits its positions, the fields are valid: before any rank
            configs, _ = Matrix(runnable, [gpus], [args.model], [precision], base).configs(
                device, n_cuda or None
            )
            for cfg in configs:  # a strategy's own checks of what the user passed it (a --ds-config)
                get_spec(cfg.strategy).check_config(cfg)
        ac_ok = _checkpointable(args.model, RunConfig().seed)
    except (DistbenchError, ValueError, FileNotFoundError) as e:
        return _usage_error(" ".join(str(e).split()))
    if not runnable:
        return _usage_error(
            "no candidate strategy runs here: " + "; ".join(o.ruled_out or "" for o in outcomes)
        )
    if args.activation_checkpointing == "on" and not ac_ok:
        return _usage_error(
            f"--activation-checkpointing on, but {args.model} has no activation checkpointing "
            "switch (transformers' activation_checkpointing_enable); use --activation-checkpointing off"
        )
    acs = {"off": [False], "on": [True], "both": [False, True] if ac_ok else [False]}[
        args.activation_checkpointing
    ]
    candidates = [Candidate(s, ac) for s in runnable for ac in acs]
    notes = (
        []
        if ac_ok or args.activation_checkpointing == "off"
        else [
            f"activation checkpointing not tried: {args.model} has no switch for it (transformers' "
            "activation_checkpointing_enable)"
        ]
    )
    if device == "cpu" and (headroom.bytes or headroom.fraction):
        notes.append("headroom not checked: on CPU no device memory is measured")
    console.print(
        f"distbench recommend: {args.model} on {gpus} {device} rank(s), {len(candidates)} candidate(s), "
        f"micro-batch up to {args.max_micro_batch}; results -> {args.output}"
    )
    searched = _search_all(candidates, args, base, (gpus, device, precision, n_cuda), headroom, console)
    return _report(outcomes + searched, notes, args, gpus, device, precision, headroom, console, table)


def _base(args: argparse.Namespace) -> dict[str, Any]:
    """RunConfig fields every probe shares. No device-time sample: a probe needs throughput and memory only."""
    base: dict[str, Any] = {
        "steps": args.steps,
        "warmup": args.warmup,
        "deterministic": False,
        "device_time_steps": 0,
    }
    if args.seq_len:
        base["seq_len"] = args.seq_len
    if args.lora_rank:
        base["lora_rank"] = args.lora_rank
    if args.ds_config:
        base["options"] = {"ds_config": args.ds_config}
    return base


def _for_strategy(base: dict[str, Any], strategy: str) -> dict[str, Any]:
    """`base` with only the options `strategy` takes (a --ds-config reaches the zero* candidates alone)."""
    from ..strategies import get_spec

    return {**base, "options": get_spec(strategy).own_options(base.get("options", {}))}


def _search_all(
    candidates: list[Candidate],
    args: argparse.Namespace,
    base: dict[str, Any],
    where: tuple[int, str, Precision, int],
    headroom: Headroom,
    console: Any,
) -> list[Outcome]:
    """Every candidate's search, one rank pool of `gpus` ranks shared by all probes; a line per probe.
    `where`: world size, device type, precision, CUDA devices visible."""
    from ..matrix import Matrix, run_matrix
    from ..runtime.pool import PoolManager

    gpus, device, precision, n_cuda = where
    pools = PoolManager(device)
    out: list[Outcome] = []
    try:
        for cand in candidates:

            def probe(mb: int, cand: Candidate = cand) -> dict[str, Any]:
                cfg = {
                    **_for_strategy(base, cand.strategy),
                    "micro_batch": mb,
                    "global_batch": mb * gpus,
                    "activation_checkpointing": cand.activation_checkpointing,
                }
                matrix = Matrix([cand.strategy], [gpus], [args.model], [precision], cfg)
                (result,) = run_matrix(
                    matrix,
                    out_dir=args.output,
                    pools=pools,
                    timeout=args.timeout,
                    device_count=n_cuda or None,
                )
                tps = result["metrics"].get("tokens_per_s")
                console.print(
                    f"  {cand.label} micro-batch {mb}: {result['status']}"
                    + (f", {tps:,.0f} tokens/s" if tps else ""),
                    highlight=False,
                )
                return result

            # Checkpointing only lowers activation memory: its search starts where the strategy without it fit.
            without = next((o for o in out if o.candidate == Candidate(cand.strategy, False)), None)
            start = (without.micro_batch or 1) if cand.activation_checkpointing and without else 1
            out.append(
                search(
                    cand,
                    probe,
                    max_micro_batch=args.max_micro_batch,
                    max_probes=args.max_probes,
                    headroom=headroom,
                    start=start,
                )
            )
    finally:
        pools.close_all()
    return out


def _report(
    outcomes: list[Outcome],
    notes: list[str],
    args: argparse.Namespace,
    gpus: int,
    device: str,
    precision: str,
    headroom: Headroom,
    console: Any,
    table: list[dict[str, Any]] | None = None,
) -> int:
    """The ranked table, the recommendation with its evidence, recommendation.json (with the agreement with a
    measured `table`, when given); exit 1 when nothing fits."""
    from rich.markup import escape
    from rich.table import Table

    from ..results import write_json_atomic

    ranked = rank(outcomes)
    out = Path(args.output)
    # beside recommendation.json in the same directory: the folder can move (or be committed) whole
    evidence = {r["id"]: f"{r['id']}.json" for o in ranked for _, r in o.probes}

    def gib(x: int | None) -> str:
        return "-" if x is None else f"{x / GIB:.2f}"

    t = Table(
        "#",
        "strategy",
        "AC",
        "micro-batch",
        "tokens/s",
        "peak GiB",
        "headroom GiB",
        "status",
        title=f"{args.model} {precision} on {gpus} {device} rank(s), global batch = micro-batch x {gpus}",
        caption_justify="left",
    )
    for i, o in enumerate(ranked, 1):
        best = o.best or {}
        ac = {None: "-", False: "off", True: "on"}[o.candidate.activation_checkpointing]
        mb = "-" if o.micro_batch is None else f"{o.micro_batch}" + ("+" if o.capped else "")
        if o.best is None:
            status = f"ruled out: {escape(o.ruled_out or '')}"
        elif o.capped:  # the edge lies between this micro-batch and the first miss
            status = f"fits; search cut at {args.max_probes} probes, larger untested"
        else:
            status = "fits" + (" up to --max-micro-batch" if o.micro_batch == args.max_micro_batch else "")
        t.add_row(
            str(i),
            o.candidate.strategy,
            ac,
            mb,
            f"{o.tokens_per_s:,.0f}" if o.tokens_per_s else "-",
            gib(peak_bytes(best) if best else None),
            gib(headroom_bytes(best) if best else None),
            status,
        )
    if notes:
        t.caption = "\n".join(notes)
    console.print(t)
    top = ranked[0] if ranked and ranked[0].best else None
    rows, close = summary(ranked, evidence), rivals(ranked)
    agreed = agreement(ranked, table, gpus, check(table)) if table is not None else None
    path = write_json_atomic(
        out / "recommendation.json",
        {
            "model": args.model,
            "gpus": gpus,
            "device": device,
            "precision": precision,
            "headroom": {"bytes": headroom.bytes, "fraction": headroom.fraction},
            "max_micro_batch": args.max_micro_batch,
            "max_probes": args.max_probes,
            "recommendation": rows[0] if top else None,
            "ranked": rows,
            "within_noise": [
                {
                    "strategy": o.candidate.strategy,
                    "activation_checkpointing": o.candidate.activation_checkpointing,
                }
                for o in close
            ],
            "table_agreement": agreed,
        },
    )
    for line in agreed or []:
        console.print(f"Against {escape(str(args.table))}: {escape(line)}", highlight=False)
    if top is None:
        console.print("[red]No recommendation[/]: no candidate fits (the status column says why)")
        return 1
    best = top.best or {}
    left = headroom_bytes(best)
    mem = "" if peak_bytes(best) is None else f", {gib(peak_bytes(best))} GiB peak ({gib(left)} GiB headroom)"
    console.print(
        f"Recommendation: {top.candidate.label} at micro-batch {top.micro_batch}: "
        f"{top.tokens_per_s or 0:,.0f} tokens/s{mem}",
        highlight=False,
    )
    if close:
        console.print(
            f"[yellow]Step-time ranges (p10-p90) overlap the top's[/]: "
            f"{', '.join(o.candidate.label for o in close)}; their order is noise at this many steps: "
            "rerun with more --steps, or `distbench run --repeats 6` each at its micro-batch and "
            "`distbench compare` them",
            highlight=False,
        )
    console.print(
        f"Evidence: {escape(str(out / evidence[best['id']]))} (every probe's result is under {escape(str(out))}; "
        f"ranked list: {escape(str(path))})",
        highlight=False,
    )
    return 0


def _predict(args: argparse.Namespace, console: Any) -> int:
    """--predict: every candidate's training state per GPU by the memory model, ranked (rank_predicted), and
    recommendation.json; exit 1 when nothing fits."""
    from rich.markup import escape
    from rich.table import Table

    from ..invariants.memory import analytic_bytes
    from ..results import write_json_atomic
    from ..strategies import REGISTRY, get_spec
    from ..workloads import get_model

    if not (args.gpus and args.gpu_memory_gib):
        return _usage_error(
            "--predict needs --gpus and --gpu-memory-gib: the cluster's GPUs and each one's memory"
        )
    if args.lora_rank or args.ds_config:
        return _usage_error(
            "--predict models full training in the harness's configuration: drop --lora-rank and --ds-config"
        )
    gpus, per_node = args.gpus, args.gpus_per_node
    if gpus > per_node and gpus % per_node:
        return _usage_error(f"--gpus {gpus} is not whole nodes of --gpus-per-node {per_node}")
    nodes = max(1, gpus // per_node)
    precision: Precision = args.precision or "bf16"
    gpu_bytes = int(args.gpu_memory_gib * GIB)
    headroom = Headroom(bytes=int(args.headroom_gib * GIB), fraction=args.headroom_frac)
    n_params = get_model(args.model).param_count()
    predicted = []
    for name in args.strategies or list(REGISTRY):
        spec = get_spec(name)
        reason = spec.unsupported_reason("cuda", gpus, precision=precision)
        if reason:
            predicted.append(Predicted(name, ruled_out=reason))
            continue
        state = analytic_bytes(name, n_params, gpus, precision, nodes)
        predicted.append(Predicted(name, state, offload=bool(spec.memory and spec.memory.on_host)))
    ranked = rank_predicted(predicted, gpu_bytes, headroom)
    top = (
        ranked[0]
        if ranked and ranked[0].ruled_out is None and not predicted_misfit(ranked[0], gpu_bytes, headroom)
        else None
    )
    where = f"{gpus} GPUs of {args.gpu_memory_gib:g} GiB ({nodes} node(s) of {min(gpus, per_node)})"
    t = Table(
        "#",
        "strategy",
        "params GiB",
        "grads GiB",
        "optimizer GiB",
        "state GiB",
        "left GiB",
        "status",
        title=f"{args.model} {precision} on {where}: training state per GPU, predicted by the memory model",
        caption="Predicted, not measured: activations and buffers are not in the state; throughput is not "
        "predicted. Measure the fitting candidates on the cluster.",
        caption_justify="left",
    )
    rows = []
    for i, p in enumerate(ranked, 1):
        why = p.ruled_out or predicted_misfit(p, gpu_bytes, headroom)
        status = f"ruled out: {p.ruled_out}" if p.ruled_out else (f"does not fit: {why}" if why else "fits")
        gib = [f"{p.state[k] / GIB:.2f}" if p.state else "-" for k in ("params", "grads", "optimizer")]
        left = gpu_bytes - p.state_bytes
        t.add_row(
            str(i),
            p.strategy,
            *gib,
            f"{p.state_bytes / GIB:.2f}" if p.state else "-",
            f"{left / GIB:.2f}" if p.state else "-",
            escape(status + (" (state on the host)" if p.offload and not why else "")),
        )
        rows.append(
            {
                "strategy": p.strategy,
                "state_bytes": p.state or None,
                "left_bytes": left if p.state else None,
                "fits": why is None,
                "offload": p.offload,
                "ruled_out": why,
            }
        )
    console.print(t)
    path = write_json_atomic(
        Path(args.output) / "recommendation.json",
        {
            "predicted": True,
            "model": args.model,
            "n_params": n_params,
            "gpus": gpus,
            "gpus_per_node": per_node,
            "gpu_memory_bytes": gpu_bytes,
            "precision": precision,
            "headroom": {"bytes": headroom.bytes, "fraction": headroom.fraction},
            "recommendation": rows[0] if top else None,
            "ranked": rows,
        },
    )
    if top is None:
        console.print(
            "[red]No recommendation[/]: no candidate's training state fits (the status column says why)"
        )
        return 1
    why = (
        "its state on the host: nothing that keeps its state on the GPUs fits"
        if top.offload
        else "the most left of those that keep their state on the GPUs"
    )
    console.print(
        f"Recommendation (predicted): {top.strategy}, its state {top.state_bytes / GIB:.2f} GiB a GPU, leaving "
        f"{(gpu_bytes - top.state_bytes) / GIB:.2f} GiB for activations; {why} (ranked list: "
        f"{escape(str(path))})",
        highlight=False,
    )
    return 0
