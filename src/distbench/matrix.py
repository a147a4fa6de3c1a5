"""A benchmark matrix (strategies x world sizes x models x precisions), from flags or YAML, and running it:
one configuration in a pool (run_benchmark, run_trace: the `bench` and `trace` jobs of jobs/bench.py), or all.

Configurations run smallest world size first, the strategies of one world size side by side (sidebyside.py:
resident at once, their timed windows taking turns) unless the matrix asks for one at a time; once the
matrix has run, every result gets its plausibility
warnings (plausibility.py), then its speedup and scaling efficiency against the workload's 1-GPU baseline
(scaling.py). A matrix may carry a published reference (a seed's figures): each result it covers gets the
figure beside its own. `trace` profiles every configuration, or, given world sizes, only those more than 5%
below DDP or their reference there, with DDP beside them (gaps.py explains them).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field

from . import scaling
from .config import (
    Name,
    PositiveFloat,
    PositiveInt,
    Precision,
    RunConfig,
    check_field,
    check_fields,
    check_keys,
    from_json,
)
from .errors import ConfigError
from .jobs.bench import bench, bench_finish, bench_setup, bench_window, trace
from .metrics import names
from .plausibility import annotate
from .results import failure_result, is_oom, save_result, summarize_bench
from .runtime.fingerprint import environment_fingerprint
from .runtime.pool import JobError, PoolManager, RankPool, cuda_device_count
from .sidebyside import groups, measure
from .strategies import REGISTRY, default_strategies, get_spec
from .workloads import get_model

MATRIX_KEYS = (
    "strategies",
    "world_sizes",
    "models",
    "precisions",
    "repeats",
    "trace",
    "reference",
    "side_by_side",
    "one_at_a_time",
)


@dataclass
class Reference:
    """Published figures the matrix is compared with: `tokens_per_s[strategy][world size]`, under `title` (the
    source and its setup, e.g. "seed 004: 2x H100 SXM5, GPT-2 Large, FSDP1")."""

    title: Annotated[str, Field(min_length=1)]
    tokens_per_s: dict[Name, dict[PositiveInt, PositiveFloat]]

    def __post_init__(self) -> None:
        check_fields(self)

    def figure(self, cfg: RunConfig) -> dict[str, Any] | None:
        """What a result of `cfg` carries as its `reference`: the title and the figure, where there is one."""
        tps = self.tokens_per_s.get(cfg.strategy, {}).get(cfg.world_size)
        return None if tps is None else {"title": self.title, "tokens_per_s": tps}


@dataclass
class Matrix:
    """Validated on construction: types and bounds, known strategies, user options some strategy takes."""

    strategies: Annotated[list[Name], Field(min_length=1)]
    world_sizes: Annotated[list[PositiveInt], Field(min_length=1)]
    models: Annotated[list[Name], Field(min_length=1)]
    precisions: Annotated[list[Precision], Field(min_length=1)]
    base: dict[str, Any] = field(default_factory=dict)  # other RunConfig fields
    repeats: PositiveInt = 1
    #: True: profile each configuration and attach HTA's breakdown; world sizes: only the shortfalls there
    trace: bool | list[PositiveInt] = False
    reference: Reference | None = None
    #: False: one configuration at a time. True: side by side on disjoint GPUs (Placement), faster, but the
    #: runs then share the host, and a host-bound step moves with its neighbour's host work
    side_by_side: bool = False
    #: False: the configurations of one world size resident at once in pools of their own, their timed
    #: windows taking turns (sidebyside.py). True: one configuration at a time, each timed alone
    one_at_a_time: bool = False

    def __post_init__(self) -> None:
        check_fields(self)
        check_keys(self.base)
        self.base = from_json(self.base)
        given_twice = sorted(set(self.base) & {"strategy", "world_size", "model", "precision"})
        if given_twice:
            raise ConfigError(
                f"{given_twice[0]!r} is a matrix axis: list it under {given_twice[0]}s, not base"
            )
        for key, value in self.base.items():
            check_field(key, value)
        specs = [get_spec(s) for s in self.strategies]
        for key in self.base.get("options", {}):
            if not any(spec.takes(key) for spec in specs):
                takers = [s.name for s in REGISTRY.values() if s.takes(key)]
                raise ConfigError(
                    f"option {key!r} applies to {', '.join(takers) or 'no strategy'} only, and none "
                    f"of the selected strategies ({', '.join(self.strategies)}) takes it; add one "
                    "of them or drop the option"
                )

    def configs(self, device_type: str, device_count: int | None = None) -> tuple[list[RunConfig], list[str]]:
        """The runnable configurations, and a note for each one skipped and why; ConfigError for a model that
        cannot load or a sequence longer than its positions, before anything runs.

        User options go only to the strategies that take them (a --ds-config reaches zero*, not ddp)."""
        for model in self.models:
            mspec = get_model(model)
            seq = self.base.get("seq_len") or mspec.seq_len
            if mspec.max_positions is not None and seq > mspec.max_positions:
                raise ConfigError(
                    f"seq_len {seq} exceeds model {model}'s {mspec.max_positions} positions; use "
                    f"--seq-len {mspec.max_positions} or less, or a larger model"
                )
        out, skipped = [], []
        for model, precision, ws, strategy in itertools.product(
            self.models, self.precisions, sorted(self.world_sizes), self.strategies
        ):
            spec = get_spec(strategy)
            reason = spec.unsupported_reason(device_type, ws, device_count, precision)
            if reason:
                skipped.append(f"{strategy} ws{ws}: {reason}")
                continue
            base = dict(self.base)
            base["options"] = spec.own_options(base.get("options", {}))
            if not base.get("global_batch"):
                base["global_batch"] = base.get("micro_batch", 2) * max(self.world_sizes)
            out.append(RunConfig(strategy=strategy, world_size=ws, model=model, precision=precision, **base))
        return out, skipped


def default_matrix(device_type: str, device_count: int) -> Matrix:
    """`distbench run` without flags: a seed-004-style sweep sized for the machine at hand, over the strategies
    whose registry entry puts them in the device's default grid."""
    if device_type == "cpu":
        return Matrix(
            default_strategies("cpu"),
            [1, 2],
            ["gpt2-tiny"],
            ["fp32"],
            {"micro_batch": 2, "steps": 8, "warmup": 2, "deterministic": False},
        )
    sizes = [n for n in (1, 2, 4, 8) if n <= device_count]
    return Matrix(
        default_strategies("cuda"),
        sizes,
        ["gpt2-124m"],
        ["bf16-amp"],
        # six windows of two steps, a slow start moved to warm-up, each row's interval kept (docs/measurement.md)
        {
            "micro_batch": 8,
            "seq_len": 1024,
            "steps": 12,
            "windows": 6,
            "until_ci": 0.01,
            "max_windows": 6,
            "warmup": 5,
            "deterministic": False,
        },
    )


def load_matrix(path: str | Path) -> Matrix:
    """Read a matrix YAML: lists under strategies/world_sizes/models/precisions (or one value under the singular
    key), repeats, trace, reference (title and tokens_per_s); every other key is a RunConfig field. ConfigError
    naming the file on anything wrong."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        first = " ".join(str(e).split())
        raise ConfigError(f"cannot read matrix file {path}: {first}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"matrix file {path} must hold a mapping, not {type(data).__name__}")
    for key, single in (
        ("strategies", "strategy"),
        ("world_sizes", "world_size"),
        ("models", "model"),
        ("precisions", "precision"),
    ):
        if single in data:
            if key in data:
                raise ConfigError(f"matrix file {path} has both {key!r} and {single!r}; keep one")
            data[key] = [data.pop(single)]
    if "strategies" not in data or "world_sizes" not in data:
        raise ConfigError(f"matrix file {path} needs `strategies` and `world_sizes`")
    data.setdefault("models", ["gpt2-tiny"])
    data.setdefault("precisions", ["bf16-amp"])
    try:
        check_keys({k: v for k, v in data.items() if k not in MATRIX_KEYS}, extra=MATRIX_KEYS)
        if isinstance(data.get("reference"), dict):
            data["reference"] = Reference(**data["reference"])
        return Matrix(**{k: data.pop(k) for k in MATRIX_KEYS if k in data}, base=data)
    except TypeError as e:  # a reference with keys other than title and tokens_per_s
        raise ConfigError(f"matrix file {path}: reference: {e}") from None
    except ConfigError as e:
        raise ConfigError(f"matrix file {path}: {e}") from None


def _failed(pool: Any, cfg: RunConfig, e: JobError, env: dict[str, Any] | None = None) -> dict[str, Any]:
    """A failed configuration's result. After an out-of-memory at world size > 1 the pool is closed (RankPool.run
    restarts it): ranks may have stopped at different collectives, leaving work queued that would desynchronise
    the next job."""
    if is_oom(e) and cfg.world_size > 1:
        pool.close()
    device_type = getattr(pool, "device_type", None)
    return failure_result(cfg, device_type, e, env or environment_fingerprint(device_type))


def run_benchmark(
    pool: Any,
    cfg: RunConfig,
    *,
    timeout: float = 1800,
    nvml: bool = True,
    job: Callable[..., Any] = bench,
) -> dict[str, Any]:
    """Run `bench` (or a `job` that stands for it, taking its arguments) on every rank of `pool` (a RankPool
    of cfg.world_size) and return one result.

    Out of memory on any rank gives a result with status "oom" (see _failed); other failures raise JobError.
    """
    env = environment_fingerprint(getattr(pool, "device_type", None))
    t0 = time.perf_counter()
    try:
        replies = pool.run(job, {"cfg": cfg, "nvml": nvml}, timeout)
    except JobError as e:
        if not is_oom(e):
            raise
        return _failed(pool, cfg, e, env)
    wall = time.perf_counter() - t0
    result = summarize_bench(cfg, replies, env=env)
    # What a configuration costs beyond its training steps in a warm pool: build, wrap, teardown, IPC.
    steps_s = max(
        sum(r["step_times_s"])
        + sum(r.get("warmup_step_times_s", []))
        + (r["device_time"]["wall_s"] * r["device_time"]["steps"] if r.get("device_time") else 0.0)
        for r in replies
    )
    result["wall_s"] = wall
    result["metrics"]["config_overhead_s"] = wall - steps_s
    return result


@dataclass
class SteppedRun:
    """One benchmark run in pieces, for the A/B gate's window interleaving: `setup` builds and warms up,
    each `window` times some steps and gives their wall clock per step (the slowest rank's), `finish` makes
    the run's result of every window so far, as run_benchmark's. A piece that fails gives the failure
    result (status "oom" or "error"); the pool has then freed the trainer."""

    pool: Any
    cfg: RunConfig
    timeout: float = 1800

    def setup(self) -> dict[str, Any] | None:
        try:
            self.pool.run(bench_setup, {"cfg": self.cfg}, self.timeout)
        except JobError as e:
            return _failed(self.pool, self.cfg, e)
        return None

    def window(self, steps: int) -> float | dict[str, Any]:
        try:
            replies = self.pool.run(bench_window, {"steps": steps}, self.timeout)
        except JobError as e:
            return _failed(self.pool, self.cfg, e)
        return max(r["wall_s"] for r in replies) / steps

    def finish(self) -> dict[str, Any]:
        try:
            replies = self.pool.run(bench_finish, {}, self.timeout)
        except JobError as e:
            return _failed(self.pool, self.cfg, e)
        return summarize_bench(
            self.cfg, replies, env=environment_fingerprint(getattr(self.pool, "device_type", None))
        )

    def close(self) -> None:
        """End the pool's ranks: a run measured side by side has a pool of its own (sidebyside.py)."""
        self.pool.close()


def sweep_micro_batch(pool: Any, cfg: RunConfig, sizes: list[int], **kwargs: Any) -> list[dict[str, Any]]:
    """Benchmark increasing micro-batch sizes (global batch = micro * world_size * cfg's accumulation)
    up to and including the first that runs out of memory; kwargs go to run_benchmark."""
    results = []
    for mb in sorted(set(sizes)):
        c = cfg.replace(micro_batch=mb, global_batch=mb * cfg.world_size * cfg.accum_steps)
        results.append(run_benchmark(pool, c, **kwargs))
        if results[-1]["status"] == "oom":
            break
    return results


def run_trace(
    pool: Any, cfg: RunConfig, out_dir: str, *, steps: int = 3, timeout: float = 1800
) -> dict[str, Any]:
    """Trace mode: profile every rank and return HolisticTraceAnalysis's breakdown per step."""
    from .measure.trace import analyze_traces

    pool.run(trace, {"cfg": cfg, "out_dir": out_dir, "steps": steps}, timeout)
    return analyze_traces(out_dir, steps=steps)


class Placement:
    """Configurations side by side on disjoint GPUs: each on an aligned block of world-size GPUs (ranks 0-1 of
    a ws2 run on GPUs 0-1 or 2-3, never 1-2), started in the order given as soon as its block is free, so that
    on 4 GPUs two 1-GPU runs and a 2-GPU run go at once, as the pytest lanes place them. No two runs share a
    GPU; under DISTBENCH_BIND_CPUS each GPU's ranks get its own equal share of this process's CPUs too.

    Pools are made and their ranks spawned in the calling thread (a rank dies with the thread that spawned
    it); the jobs run in worker threads."""

    def __init__(self, pools: PoolManager, n_gpus: int) -> None:
        self.pools, self.n_gpus = pools, n_gpus
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        per_gpu = len(cpus) // n_gpus
        self.shares = [cpus[g * per_gpu : (g + 1) * per_gpu] for g in range(n_gpus)]

    @staticmethod
    def applies(pools: Any, n_gpus: int | None, sizes: list[int]) -> bool:
        """Whether runs of these world sizes can go side by side in `pools`: this machine's CUDA pools, and
        GPUs for two of the smallest at once."""
        return (
            isinstance(pools, PoolManager)
            and pools.device_type == "cuda"
            and len(sizes) > 1
            and bool(n_gpus)
            and 2 * min(sizes) <= (n_gpus or 0)
        )

    def blocks(self, world_size: int) -> list[tuple[int, ...]]:
        return [tuple(range(b, b + world_size)) for b in range(0, self.n_gpus - world_size + 1, world_size)]

    def run(self, items: list[tuple[int, Any]], work: Callable[[Any, Any], None]) -> None:
        """`work(pool, item)` for every (world size, item), each in a pool on its own free block."""
        free, pending = set(range(self.n_gpus)), list(items)
        running: dict[Future[None], tuple[int, ...]] = {}
        with ThreadPoolExecutor(max_workers=self.n_gpus) as ex:
            while pending or running:
                for ws, item in list(pending):
                    block = next((b for b in self.blocks(ws) if free.issuperset(b)), None)
                    if block is None:
                        continue
                    cpus = [c for g in block for c in self.shares[g]] or None
                    pool = self.pools.pool_on(block, cpus)
                    pool.spawn()  # here, in the thread that outlives the pool
                    running[ex.submit(work, pool, item)] = block
                    free -= set(block)
                    pending.remove((ws, item))
                if not running:
                    raise ValueError(f"world size {pending[0][0]} does not fit {self.n_gpus} GPU(s)")
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    free |= set(running.pop(fut))
                    fut.result()  # a failure of the harness itself (JobErrors are results) stops the matrix


def run_matrix(
    matrix: Matrix,
    *,
    device_type: str | None = None,
    out_dir: str | Path | None = None,
    pools: PoolManager | None = None,
    on_result: Callable[[RunConfig, dict[str, Any]], None] | None = None,
    timeout: float = 1800.0,
    device_count: int | None = None,
) -> list[dict[str, Any]]:
    """Run every configuration `repeats` times in the rank pools (one at a time, or side by side on disjoint
    GPUs where they fit when the matrix asks: Placement); save each result as it lands. Results come back in the matrix's order.

    `device_count`: GPUs the pools can place ranks on (default: this machine's; a multi-node launch has more).

    A configuration that fails (an exception, a hang, a crashed rank) becomes a result with status "error"
    carrying every rank's traceback, and the matrix goes on. At the end every result gets its plausibility
    `warnings`, its speedup and scaling efficiency (scaling.py), and the traces `matrix.trace` asks for at
    the shortfalls (gaps.py), and is saved again.
    """
    pools = pools or PoolManager(device_type)
    n_dev = (device_count or cuda_device_count()) if pools.device_type == "cuda" else None
    configs, _ = matrix.configs(pools.device_type, n_dev)
    jobs = [(i, cfg) for i, cfg in enumerate(c for c in configs for _ in range(matrix.repeats))]
    placed = (
        Placement(pools, n_dev or 1)
        if matrix.side_by_side and Placement.applies(pools, n_dev, [c.world_size for _, c in jobs])
        else None
    )
    lock = threading.Lock()
    done: dict[int, tuple[RunConfig, dict[str, Any]]] = {}

    def land(pool: Any, i: int, cfg: RunConfig, result: dict[str, Any]) -> None:
        figure = matrix.reference.figure(cfg) if matrix.reference else None
        if figure:
            result["reference"] = figure
        if matrix.trace is True and result["status"] == "ok" and out_dir is not None:
            _attach_trace(pool, cfg, result, out_dir, timeout)
        with lock:
            done[i] = (cfg, result)
            if out_dir is not None:
                save_result(result, out_dir)
            if on_result:
                on_result(cfg, result)

    def one(pool: Any, job: tuple[int, RunConfig]) -> None:
        i, cfg = job
        land(pool, i, cfg, _run_alone(pool, cfg, timeout))

    if placed is None and not matrix.one_at_a_time and isinstance(pools, PoolManager):
        _interleaved(configs, matrix.repeats, pools, timeout, land)
    else:
        _each(placed, pools, [(cfg.world_size, (i, cfg)) for i, cfg in jobs], one)
    results = [done[i][1] for i in sorted(done)]
    annotate(results)  # judged on the whole matrix: a speedup needs its reference, a run its repeats
    scaling.annotate(results)  # one rule for speedup and efficiency (scaling.py), from unflagged baselines
    if isinstance(matrix.trace, list) and out_dir is not None:
        _trace_shortfalls(matrix.trace, [done[i] for i in sorted(done)], placed, pools, out_dir, timeout)
    if out_dir is not None:
        for result in results:
            save_result(result, out_dir)
    return results


def _run_alone(pool: Any, cfg: RunConfig, timeout: float) -> dict[str, Any]:
    """run_benchmark, a failure of the configuration recorded as its result so that the matrix goes on: one
    broken strategy is one red row."""
    try:
        return run_benchmark(pool, cfg, timeout=timeout)
    except JobError as e:
        return failure_result(cfg, pool.device_type, e)


def _interleaved(
    configs: list[RunConfig],
    repeats: int,
    pools: PoolManager,
    timeout: float,
    land: Callable[[Any, int, RunConfig, dict[str, Any]], None],
) -> None:
    """Each side-by-side group of the matrix (sidebyside.groups) `repeats` times, each run in a pool of its
    own; `land(pool, index, cfg, result)` for each of the group's rows, indexed as run_matrix's jobs."""

    def start(cfg: RunConfig) -> SteppedRun:
        pool = RankPool(cfg.world_size, pools.device_type, gpus=None, cpus=None, **pools.pool_options)
        pool.spawn()  # every resident's ranks start importing at once
        return SteppedRun(pool, cfg, timeout)

    def alone(cfg: RunConfig) -> dict[str, Any]:
        return _run_alone(pools.pool_for(cfg.world_size), cfg, timeout)

    for group, rows in groups(configs):
        for r in range(repeats):
            if len(group.residents) == 1:
                measured = [alone(group.residents[0])]
            else:
                pools.close_all()  # the device's memory for the residents
                fit = _fit_all(group.residents, pools.device_type)
                measured = [
                    m.result for m in measure(group.residents, group.references, start, alone, fit_all=fit)
                ]
                pools.close_all()
            for k, i in enumerate(rows):
                cfg = configs[i]
                land(pools.pool_for(cfg.world_size), i * repeats + r, cfg, measured[k])


def _fit_all(residents: list[RunConfig], device_type: str) -> bool | None:
    """Whether every resident's rank on the first GPU fits in its memory at once, by the memory model
    (gate/fit.py, HEADROOM left free); None where it cannot say (no card, or a model it has no footprint
    of): then the device decides."""
    if device_type != "cuda":
        return None
    from .gate import fit

    card = fit.card_bytes()
    peaks = [fit.predicted_peak(c, fit.n_params(c.model)) for c in residents]
    if card is None or any(p is None for p in peaks):
        return None
    return fit.fits(sum(p or 0.0 for p in peaks), card, 1)


def _each(
    placed: Placement | None, pools: Any, items: list[tuple[int, Any]], work: Callable[[Any, Any], None]
) -> None:
    """`work(pool, item)` for every (world size, item): side by side where placed, else one at a time."""
    if placed is not None:
        placed.run(items, work)
        return
    for ws, item in items:
        work(pools.pool_for(ws), item)


def _attach_trace(
    pool: Any, cfg: RunConfig, result: dict[str, Any], out_dir: str | Path, timeout: float
) -> None:
    """Profile `cfg` into out_dir/traces/<id> and put HTA's breakdown into the result (and its trace metrics)."""
    tdir = Path(out_dir) / "traces" / result["id"]
    try:
        result["trace"] = run_trace(pool, cfg, str(tdir), timeout=timeout)
    except Exception as e:  # a trace HTA cannot analyse costs its breakdown, not the matrix
        result["trace"] = {"error": f"{type(e).__name__}: {e}", "trace_dir": str(tdir)}
    result["metrics"].update(
        {k: result["trace"][k] for k in names(source="trace") if result["trace"].get(k) is not None}
    )


def _trace_shortfalls(
    world_sizes: list[int],
    ran: list[tuple[RunConfig, dict[str, Any]]],
    placed: Placement | None,
    pools: Any,
    out_dir: str | Path,
    timeout: float,
) -> None:
    """Trace one run of each configuration more than gaps.GAP short of DDP or its reference at `world_sizes`,
    and DDP's there, so that the report can split the gap (gaps.explain)."""
    from .gaps import ddp_runs, shortfalls

    results = [r for _, r in ran]
    wanted: dict[int, dict[str, Any]] = {}
    for short in shortfalls(results, world_sizes):
        for r in (short.runs[0], *ddp_runs(results, short)[:1]):
            wanted[id(r)] = r
    cfg_of = {id(r): cfg for cfg, r in ran}
    items = [(r["config"]["world_size"], r) for r in wanted.values()]
    _each(placed, pools, items, lambda pool, r: _attach_trace(pool, cfg_of[id(r)], r, out_dir, timeout))
