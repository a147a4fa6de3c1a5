"""Training and collective metrics per strategy x world size, tracked by asv.

What is tracked, under which benchmark name and unit, comes from the metric registry (distbench/metrics.py,
each metric's `asv`): the training tracks are built from it. Direction: asv 0.6 reads an increase of any
benchmark as a regression and has no attribute to say that higher is better (airspeed-velocity/asv#1617
asks for one and is open). So every track is kept in a lower-is-better form: step time and peak memory as
measured, and MFU, scaling efficiency and bus bandwidth as their inverses (x the time at peak FLOP/s, x the
ideal linear-scaling time, ms per GB of bus traffic). A drop in MFU then shows in asv as a rise, flagged
like any slowdown. Each track has an explicit asv `version`, so refactoring this file keeps the history.

Grid: with CUDA GPUs, the model in DISTBENCH_ASV_MODEL (default gpt2-large) in bf16, micro-batch 8, at
world sizes 1, 2, 4, 8 up to the GPU count; without, gpt2-tiny in fp32 on gloo at world sizes 1 and 2, small
enough for `asv run --quick` on a laptop. The workloads are distbench/history/grid.py's, which `distbench
history` reads to name an asv series' configuration. The strategies are the registry's "cuda" or "asv-cpu" default grid
(strategies/spec.py); DISTBENCH_ASV_STRATEGIES (comma-separated) overrides them.

Every configuration is measured once, in the module-level `setup_cache`: asv runs it in one process and
hands its pickled results to every benchmark. `_train` and `_busbw` are cached per process as well, so a
configuration runs once however often the grid asks for it; speedup and scaling efficiency then come from
distbench.scaling over the whole grid, as for `distbench run`.
Unsupported strategy x world size pairs are skipped (n/a); a run that fails or runs out of memory is a
failed benchmark, which `asv continuous` reports as a regression.

Every configuration is stored every night, with its spread. A track of a figure that derives from the step
time (step time, 1 / MFU, 1 / scaling efficiency) returns the figure at each timed window (WORKLOAD's
`windows`) as asv's samples, so asv computes its own statistics over real measurements (the median, which is
the result's figure, its 99% interval, the quartiles: stats_ci_99_a/b, stats_q_25/75 in the results JSON)
and `asv compare` and asv's step detection weigh each point by them. asv's runner reads any benchmark's
{"samples": [...], "number": 1} this way; tests/test_asv.py holds it to asv's own code. A result the
plausibility checks flag (`judge` applies them as `distbench run` does) is stored too, never dropped: its
interval is widened to +-FLAGGED_HALF_WIDTH of its median, so that it barely moves asv's step detection,
its reason is on asv's log (`asv run --show-stderr`: "asv: flagged: ..."), and Plausibility.track_warnings
counts its warnings on the dashboard. (Until 2026-11 a flagged run stored no time figure at all, and about
half the nightly grid was n/a: a cold 1-rank run once put a 405% scaling efficiency into the history.)

On the dashboard each benchmark has the registry's title (asv's pretty_name), unit and description (its
tooltip); those with data on GPU runs only say so in their names. docs/asv-history.md describes the dashboard.
"""

from __future__ import annotations

import functools as _functools
import os as _os
import statistics as _statistics
import sys as _sys
from typing import Any

from distbench.history.grid import asv_workload as _asv_workload
from distbench.metrics import METRICS as _METRICS
from distbench.runtime.pool import cuda_device_count as _cuda_device_count
from distbench.strategies import default_strategies as _default_strategies
from distbench.strategies import get_spec as _get_spec

GPUS = _cuda_device_count()
DEVICE = "cuda" if GPUS else "cpu"
_DEFAULT_STRATEGIES = ",".join(_default_strategies("cuda" if GPUS else "asv-cpu"))
WORLD_SIZES = [n for n in (1, 2, 4, 8) if n <= GPUS] if GPUS else [1, 2]
WORKLOAD: dict[str, Any] = _asv_workload(GPUS)
STRATEGIES = [
    _get_spec(s.strip()).name
    for s in _os.environ.get("DISTBENCH_ASV_STRATEGIES", _DEFAULT_STRATEGIES).split(",")
    if s.strip()
]
OPS = ["all_reduce", "all_gather", "reduce_scatter"]
_BUSBW = _METRICS["busbw_gbps"]


@_functools.cache
def _pools() -> Any:
    from distbench.runtime.pool import PoolManager

    return PoolManager(device_type=DEVICE)


@_functools.cache
def _train(strategy: str, world_size: int) -> dict[str, Any]:
    """One benchmark result, or {"skip": why} for a pair the strategy does not support."""
    from distbench.config import RunConfig
    from distbench.matrix import run_benchmark

    why = _get_spec(strategy).unsupported_reason(DEVICE, world_size, GPUS)
    if why:
        return {"skip": why}
    cfg = RunConfig(strategy=strategy, world_size=world_size, deterministic=False, **WORKLOAD)
    try:
        return run_benchmark(_pools().pool_for(world_size), cfg)
    except Exception as e:  # one broken configuration must not take the whole grid down
        return {"status": "error", "error": f"{type(e).__name__}: {e}"}


@_functools.cache
def _busbw(world_size: int) -> dict[str, Any]:
    """Rank 0's table of collective_bandwidth (every rank returns the same one)."""
    try:
        from distbench.jobs.bench import collective_bandwidth

        return _pools().pool_for(world_size).run(collective_bandwidth, {}, 900)[0]
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def judge(train: dict[str, dict[str, Any]]) -> None:
    """Speedups and plausibility warnings on the grid's results, as `distbench run` writes them (matrix.py)."""
    from distbench import plausibility, scaling

    results = [r for r in train.values() if "config" in r]
    scaling.annotate(results)
    plausibility.annotate(results)


def setup_cache() -> dict[str, Any]:
    """Everything, once: training results per strategy/world size, collective tables per world size > 1."""
    train = {f"{s}/{ws}": _train(s, ws) for s in STRATEGIES for ws in WORLD_SIZES}
    judge(train)
    busbw = {ws: _busbw(ws) for ws in WORLD_SIZES if ws > 1}
    return {"train": train, "busbw": busbw}


setup_cache.timeout = 4 * 3600 if GPUS else 1800  # the whole grid runs inside it


#: How far either side of its median a flagged result's interval reaches: the checks say the figure is not a
#: measurement (a 4x superlinear speedup was one), so its interval says "anywhere near here", not its windows'
#: spread.
FLAGGED_HALF_WIDTH = 0.5


def _per_window(metric: Any) -> bool:
    """Whether the metric moves with the step time, so that each timed window gives a sample of it: step time,
    throughput and what derives from them (MFU, scaling efficiency, at a fixed reference). Device memory is a
    peak, one figure a run."""
    return bool(metric.time or metric.source == "scaling")


def _samples(result: dict[str, Any], value: float) -> list[float]:
    """`value` (a figure proportional to the result's step time) at each timed window: value x window step
    time / step time. The step time is the median over windows (results.summarize_bench), so the samples'
    median is `value`. Without windows, the per-step times; without those, `value` alone."""
    st = result.get("step_time_s") or {}
    times = st.get("windows") or st.get("steps") or []
    step_time = result["metrics"]["step_time_s"]
    return [value * t / step_time for t in times] or [value]


def _widened(xs: list[float]) -> list[float]:
    """A flagged result's samples: its own, and the two ends of +-FLAGGED_HALF_WIDTH around their median
    (asv computes its interval from samples alone, so the widening is carried as two samples; the median
    stays the result's figure)."""
    mid = _statistics.median(xs)
    return [*xs, mid * (1 - FLAGGED_HALF_WIDTH), mid * (1 + FLAGGED_HALF_WIDTH)]


class _Training:
    """Common setup: pick the configuration's result, skip it where the metric cannot exist."""

    params = (STRATEGIES, WORLD_SIZES)
    param_names = ("strategy", "world_size")
    needs: tuple[str, ...] = ("step_time_s",)

    def setup(self, cache: dict[str, Any], strategy: str, world_size: int) -> None:
        r = cache["train"][f"{strategy}/{world_size}"]
        if "skip" in r:
            raise NotImplementedError(r["skip"])
        missing = [k for k in self.needs if r["status"] == "ok" and r["metrics"].get(k) is None]
        if missing:
            raise NotImplementedError(
                f"no {missing[0]} in this result (not measured on {DEVICE}, "
                "or no 1-GPU baseline of its workload ran)"
            )
        self.result = r

    def metric(self, name: str) -> float:
        if self.result["status"] != "ok":
            raise RuntimeError(f"run {self.result['status']}: {self.result.get('error')}")
        return float(self.result["metrics"][name])

    def recorded(self, metric: Any) -> float | dict[str, Any]:
        """What asv records of a registry metric: its lower-is-better value, as per-window samples where the
        metric moves with the step time (asv's statistics then come from them), widened where flagged."""
        value = metric.asv_value(self.metric(metric.name))
        if not _per_window(metric):
            return value
        xs = _samples(self.result, value)
        if self.result.get("warnings"):
            _say_flagged(self.result, f"{metric.name} stored with a +-{FLAGGED_HALF_WIDTH:.0%} interval")
            xs = _widened(xs)
        return {"samples": xs, "number": 1}


def _say_flagged(result: dict[str, Any], what: str) -> None:
    """The flag's reason on the benchmark's stderr, which asv prints under `asv run --show-stderr`."""
    print(f"asv: flagged: {what}, not a measurement: " + "; ".join(result["warnings"]), file=_sys.stderr)


def _on_dashboard(track: Any, metric: Any) -> Any:
    """`track` with what asv records and shows of a registry metric: its unit, a version that survives
    refactors of this file, its title (pretty_name, with the runs that have data where not all do) and a
    description, which is also the dashboard's tooltip (pretty_source; the method's own source is generic)."""
    a = metric.asv
    doc = " ".join(
        filter(
            None,
            [
                metric.description.rstrip(".") + ".",
                track.__doc__,
                "" if metric.better == "lower" else f"Tracked as {a.scale:g} / value: lower is better.",
                f"Data: {a.where}." if a.where else "",
                "Per-window samples: asv's interval is the windows' spread, +-50% where the plausibility "
                "checks flag the result (Plausibility warnings counts them; asv's log says why)."
                if _per_window(metric)
                else "",
            ],
        )
    )
    track.__doc__ = track.pretty_source = doc
    track.__name__ = a.benchmark.split(".")[1]
    track.__qualname__ = a.benchmark  # the tooltip names the class it is in, not _track.<locals>
    track.unit = a.unit
    track.version = f"{metric.name}:{a.unit}:{a.version}"
    track.pretty_name = a.pretty_name
    return track


def _track(metric: Any) -> Any:
    """The asv track method of one registry metric (distbench/metrics.py): its value in asv's lower-is-better
    form."""

    def track(
        self: _Training, cache: dict[str, Any], strategy: str, world_size: int
    ) -> float | dict[str, Any]:
        return self.recorded(metric)

    return _on_dashboard(track, metric)


def _training_classes() -> dict[str, type]:
    """One class per asv benchmark class the registry names (StepTime, Memory, ...), each with the tracks of
    its metrics; a class skips a configuration without all of them (`needs`)."""
    groups: dict[str, list[Any]] = {}
    for m in _METRICS.values():
        if m.asv is not None and m.source in ("bench", "scaling"):
            groups.setdefault(m.asv.benchmark.split(".")[0], []).append(m)
    return {
        cls: type(
            cls,
            (_Training,),
            {
                "needs": tuple(m.name for m in ms),
                "__module__": __name__,
                **{m.asv.benchmark.split(".")[1]: _track(m) for m in ms},
            },
        )
        for cls, ms in groups.items()
    }


globals().update(_training_classes())  # StepTime, Memory, DeviceMemory, Mfu, Scaling


class Plausibility(_Training):
    needs = ()

    def track_warnings(self, cache: dict[str, Any], strategy: str, world_size: int) -> int:
        """How many plausibility warnings the configuration's result has: 0 for a measurement, more where
        its time figures are stored with a widened interval. asv's log (`asv run --show-stderr`) and
        `distbench run` on the configuration say why."""
        if self.result["status"] != "ok":
            raise RuntimeError(f"run {self.result['status']}: {self.result.get('error')}")
        if self.result.get("warnings"):
            _say_flagged(self.result, "its time figures")
        return len(self.result.get("warnings") or [])

    track_warnings.unit = "warnings"  # type: ignore[attr-defined]
    track_warnings.version = "1"  # type: ignore[attr-defined]
    track_warnings.pretty_name = "Plausibility warnings"  # type: ignore[attr-defined]


class BusBandwidth:
    params = (OPS, WORLD_SIZES)
    param_names = ("op", "world_size")

    def setup(self, cache: dict[str, Any], op: str, world_size: int) -> None:
        if world_size == 1:
            raise NotImplementedError("collectives need world size > 1")
        table = cache["busbw"][world_size]
        if "error" in table:
            raise RuntimeError(table["error"])
        rows = [r for r in table["results"] if r["op"] == op]
        if not rows:
            raise NotImplementedError(f"{table['backend']} did not run {op}")
        self.row = max(rows, key=lambda r: r["size_bytes"])

    @_functools.partial(_on_dashboard, metric=_BUSBW)
    def track_ms_per_bus_gb(self, cache: dict[str, Any], op: str, world_size: int) -> float:
        """At the largest message size."""
        return _BUSBW.asv_value(self.row[_BUSBW.name])
