"""A benchmark matrix (strategies x world sizes x models x precisions), from flags or YAML, and running it:
one configuration in a pool (run_benchmark, run_trace: the `bench` and `trace` jobs of jobs/bench.py), or all.

Configurations run smallest world size first; once the matrix has run, every result gets its speedup and
scaling efficiency against the workload's 1-GPU baseline (scaling.py).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import yaml
from pydantic import Field

from . import scaling
from .config import Name, PositiveInt, Precision, RunConfig, check_field, check_fields, check_keys, from_json
from .errors import ConfigError
from .jobs.bench import bench, bench_finish, bench_setup, bench_window, trace
from .metrics import names
from .plausibility import annotate
from .results import failure_result, is_oom, save_result, summarize_bench
from .runtime.fingerprint import environment_fingerprint
from .runtime.pool import JobError, PoolManager, cuda_device_count
from .strategies import REGISTRY, default_strategies, get_spec
from .workloads import get_model

MATRIX_KEYS = ("strategies", "world_sizes", "models", "precisions", "repeats", "trace")


@dataclass
class Matrix:
    """Validated on construction: types and bounds, known strategies, user options some strategy takes."""

    strategies: Annotated[list[Name], Field(min_length=1)]
    world_sizes: Annotated[list[PositiveInt], Field(min_length=1)]
    models: Annotated[list[Name], Field(min_length=1)]
    precisions: Annotated[list[Precision], Field(min_length=1)]
    base: dict[str, Any] = field(default_factory=dict)  # other RunConfig fields
    repeats: PositiveInt = 1
    trace: bool = False  # also profile each configuration, attach HTA's breakdown

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
        ["bf16"],
        {"micro_batch": 8, "seq_len": 1024, "steps": 15, "warmup": 5, "deterministic": False},
    )


def load_matrix(path: str | Path) -> Matrix:
    """Read a matrix YAML: lists under strategies/world_sizes/models/precisions (or one value under the singular
    key), repeats, trace; every other key is a RunConfig field. ConfigError naming the file on anything wrong."""
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
    data.setdefault("precisions", ["bf16"])
    try:
        check_keys({k: v for k, v in data.items() if k not in MATRIX_KEYS}, extra=MATRIX_KEYS)
        return Matrix(**{k: data.pop(k) for k in MATRIX_KEYS if k in data}, base=data)
    except ConfigError as e:
        raise ConfigError(f"matrix file {path}: {e}") from None


def _failed(pool: Any, cfg: RunConfig, e: JobError, env: dict[str, Any] | None = None) -> dict[str, Any]:
    """A failed configuration's result. After an out-of-memory at world size > 1 the pool is closed (RankPool.run
    restarts it): ranks may have stopped at different collectives, leaving work queued that would desynchronise
    the next job."""
    if is_oom(e) and cfg.world_size > 1:
        pool.close()
    return failure_result(cfg, getattr(pool, "device_type", None), e, env or environment_fingerprint())


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
    env = environment_fingerprint()
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
        return summarize_bench(self.cfg, replies, env=environment_fingerprint())


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
    """Run every configuration `repeats` times in the rank pools; save each result as it lands.

    `device_count`: GPUs the pools can place ranks on (default: this machine's; a multi-node launch has more).

    A configuration that fails (an exception, a hang, a crashed rank) becomes a result with status "error"
    carrying every rank's traceback, and the matrix goes on. At the end every result gets its speedup and
    scaling efficiency (scaling.py) and its plausibility `warnings`, and is saved again.
    """
    pools = pools or PoolManager(device_type)
    n_dev = (device_count or cuda_device_count()) if pools.device_type == "cuda" else None
    configs, _ = matrix.configs(pools.device_type, n_dev)
    results: list[dict[str, Any]] = []
    for cfg in configs:
        for _ in range(matrix.repeats):
            try:
                result = run_benchmark(pools.pool_for(cfg.world_size), cfg, timeout=timeout)
            except JobError as e:  # recorded, and the matrix goes on: one broken strategy is one red row
                result = failure_result(cfg, pools.device_type, e)
            if matrix.trace and result["status"] == "ok" and out_dir is not None:
                tdir = Path(out_dir) / "traces" / result["id"]
                try:
                    result["trace"] = run_trace(
                        pools.pool_for(cfg.world_size), cfg, str(tdir), timeout=timeout
                    )
                except Exception as e:  # a trace HTA cannot analyse costs its breakdown, not the matrix
                    result["trace"] = {"error": f"{type(e).__name__}: {e}", "trace_dir": str(tdir)}
                result["metrics"].update(
                    {
                        k: result["trace"][k]
                        for k in names(source="trace")
                        if result["trace"].get(k) is not None
                    }
                )
            results.append(result)
            if out_dir is not None:
                save_result(result, out_dir)
            if on_result:
                on_result(cfg, result)
    annotate(results)  # judged on the whole matrix: a speedup needs its reference, a run its repeats
    scaling.annotate(results)  # one rule for speedup and efficiency (scaling.py), from unflagged baselines
    if out_dir is not None:
        for result in results:
            save_result(result, out_dir)
    return results
