"""`distbench launch -- RUN-ARGS`: the entry point every process of a torchrun (or srun + torchrun) job runs.

Rank 0 runs `distbench run RUN-ARGS` (with --parity, after the loss/parameter/gradient parity checks) with
the launched world as its pool; every other rank follows the jobs it is sent (see runtime.cluster) and
exits with rank 0's status, so every node's torchrun agent (and srun) reports the launch's outcome. One
launch does both because starting a torchrun job costs far more than a tiny configuration.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..runtime.cluster import Launch
    from ..runtime.jobspec import Admission


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "launch",
        help="run in every process of a torchrun job: the matrix across nodes",
        description="Run under torchrun --nnodes N --nproc-per-node G --rdzv-backend c10d "
        "--rdzv-endpoint HOST:PORT -m distbench.cli launch -- RUN-ARGS. Rank 0 runs "
        "`distbench run RUN-ARGS` on the launched world (each world size on its first ranks) "
        "and writes the results; the other ranks follow.",
    )
    p.add_argument(
        "--parity",
        action="store_true",
        help="first check each strategy x world size x model against "
        "the single-process reference (losses, final parameters, last gradients; fp32, "
        "deterministic) and write parity.json to --output, then benchmark",
    )
    p.add_argument("run_args", nargs=argparse.REMAINDER, help="`distbench run` flags, after --")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import torch

    from ..errors import DistbenchError, JobSpecError
    from ..jobs.registry import LAUNCH_JOBS
    from ..runtime.cluster import Cluster, Launch, connect_store, follow, local_device
    from . import run as run_command
    from .parser import build_parser

    rest = args.run_args[1:] if args.run_args[:1] == ["--"] else args.run_args
    run_args = build_parser([run_command]).parse_args(["run", *rest])
    device_type = run_args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        launch = Launch.from_env()
        allowed = admission(run_args, launch, device_type)
    except DistbenchError as e:
        print(f"distbench launch: {e}", file=sys.stderr)
        return 2
    try:
        store = connect_store(launch, run_args.timeout)
    except DistbenchError as e:
        print(f"distbench launch: {e}", file=sys.stderr, flush=True)
        return 1
    device = local_device(launch, device_type)
    if launch.rank != 0:
        return follow(launch, store, device, LAUNCH_JOBS, allowed)
    cluster = Cluster(launch, store, device, LAUNCH_JOBS, allowed)
    status = 1
    try:
        failed = parity(cluster, run_args) if args.parity else 0
        status = (
            run_args.func(
                run_args, pools=cluster, device_count=launch.world_size if device_type == "cuda" else 0
            )
            or failed
        )
    except JobSpecError as e:
        cluster.refused = cluster.refused or str(e)
        status = 1
    finally:
        if cluster.refused:  # raised, or recorded by a step that keeps going (a trace's analysis)
            print(f"distbench launch: {cluster.refused}; the launch stops", file=sys.stderr, flush=True)
            status = 1
        cluster.release(status)
    return status


def admission(run_args: argparse.Namespace, launch: Launch, device_type: str) -> Admission:
    """What jobs from torchrun's store may name on this rank: what its own command line names (every rank
    of a launch runs the same one): the matrix's models and strategy options, --output, --timeout."""
    from ..runtime.jobspec import Admission
    from ..workloads.models import ALIASES, MODELS
    from .run import build_matrix

    matrix = build_matrix(run_args, device_type, launch.world_size if device_type == "cuda" else 0)
    return Admission(
        models=frozenset([*MODELS, *ALIASES, *matrix.models]),
        options=dict(matrix.base.get("options", {})),
        output=str(run_args.output),
        world_size=launch.world_size,
        timeout=run_args.timeout,
    )


def parity(cluster: Any, run_args: argparse.Namespace) -> int:
    """Each strategy x world size x model of the run's matrix (skips as `distbench run` skips them) against
    the reference, in the tier's parity workload; then, for each strategy whose checkpoints reshard and that
    runs at two world sizes or more, a checkpoint saved at the largest continued at the smallest, against the
    reference too. A line each, parity.json; 1 when any fails. Checkpoints and shared runs live under
    --output (every rank writes and reads them: across hosts, a shared filesystem) and go when it is done."""
    import shutil

    from ..invariants.checks import (
        SINGLE_PROCESS_REFERENCE,
        assert_losses_match,
        assert_params_and_grads_match,
    )
    from ..results import write_json_atomic
    from ..runtime.pool import JobError
    from ..runtime.shelf import Shelf
    from ..strategies import get_spec
    from ..testsuite.suite import Suite
    from .run import build_matrix

    n_dev = cluster.launch.world_size if cluster.device_type == "cuda" else 0
    configs, _ = build_matrix(run_args, cluster.device_type, n_dev).configs(
        cluster.device_type, n_dev or None
    )
    cases = list(dict.fromkeys((c.model, c.strategy, c.world_size) for c in configs))
    shelf = Shelf(Path(run_args.output) / "parity-runs")
    suite = Suite(
        cluster.device_type, pools=cluster, timeout=run_args.timeout, steps=run_args.steps or 4, shelf=shelf
    )

    def config(strategy: str, ws: int, model: str) -> Any:
        """The tier's parity workload at the run's --seq-len when given, as the benchmark half runs."""
        return suite.config(
            strategy, ws, model, **({"seq_len": run_args.seq_len} if run_args.seq_len else {})
        )

    def where(ws: int) -> str:
        return f"ws{ws} ({cluster.launch.job_nodes(ws)} node(s))"

    rows = []

    def check(what: str, cfg: Any, body: Any) -> None:
        try:
            losses = body()
            row = {"config": cfg.to_dict(), "status": "ok", "losses": losses, "error": None}
        except (AssertionError, JobError) as e:
            row = {"config": cfg.to_dict(), "status": "error", "losses": None, "error": str(e)}
        print(f"parity {what}: {row['status']}" + (f"\n{row['error']}" if row["error"] else ""), flush=True)
        rows.append({"check": what, **row})

    def trained(cfg: Any, what: str) -> list[float]:
        out = suite.train(cfg, return_params=True, return_grads=True)[0]
        ref = suite.reference(cfg)
        assert_losses_match(out["losses"], ref["losses"], what, against=SINGLE_PROCESS_REFERENCE)
        assert_params_and_grads_match(out, ref, cfg.lr, what)
        return list(out["losses"])

    def resumed(cfg: Any, loaded_ws: int, what: str) -> list[float]:
        run = suite.checkpointed_run(cfg)
        out = suite.train(cfg.resized(loaded_ws), resume_from=run["checkpoint"], reshard=True)[0]
        assert_losses_match(
            out["losses"],
            suite.reference(cfg)["losses"][run["save_at"] :],
            what,
            against=SINGLE_PROCESS_REFERENCE,
        )
        return list(out["losses"])

    try:
        for model, strategy, ws in cases:
            cfg = config(strategy, ws, model)
            what = f"{strategy} ws{ws} {model} ({cluster.launch.job_nodes(ws)} node(s))"
            check(what, cfg, lambda cfg=cfg, what=what: trained(cfg, what))
        for model, strategy in dict.fromkeys((m, s) for m, s, _ in cases):
            sizes = sorted(ws for m, s, ws in cases if (m, s) == (model, strategy))
            fmt = get_spec(strategy).checkpoint
            if len(sizes) < 2 or fmt is None or not fmt.reshards:
                continue
            cfg = config(strategy, sizes[-1], model)
            what = f"{strategy} {model} saved at {where(sizes[-1])}, resumed at {where(sizes[0])}"
            check(what, cfg, lambda cfg=cfg, ws=sizes[0], what=what: resumed(cfg, ws, what))
    finally:
        suite.close()  # the cluster's processes are the launch's to close
        shutil.rmtree(shelf.root, ignore_errors=True)
    write_json_atomic(Path(run_args.output) / "parity.json", rows)
    return 0 if all(r["status"] == "ok" for r in rows) else 1
