"""One result schema for every run, written atomically so a crashed run never leaves half a file.

A result is a plain JSON object:

    {
      "schema": "distbench.result/1",
      "id": "ddp-ws2-gpt2-large-bf16-mb8-<time>",
      "created": "2026-11-22T10:00:00+00:00",
      "status": "ok" | "oom" | "error",
      "error": null | "message",
      "config": {strategy, world_size, model, seq_len, global_batch, micro_batch, precision, steps, warmup, device, ...},
      "metrics": {<name>: float, ...},          # flat, each described in distbench.metrics
      "step_time_s": {"median", "p10", "p90", "mean", "std", "cv", "n", "steps": [s, ...]},
      "losses": [float, ...],
      "loss": {"step": N, "value": float | null},   # the loss the table shows (loss_at_step)
      "nvml": {... , "throttled": bool} | null,
      "trace": {...} | null,
      "gc": {"collector_on", "collections": [gen0, gen1, gen2], "seconds", "step_seconds": [...]} | null,
      "env": {fingerprint}
    }

This module builds every result: make_result assembles one, summarize_bench makes one from the replies of
the `bench` job (jobs/bench.py), failure_result one from a configuration that failed.

Everything that compares results (the compare gate, asv, reports) reads a metric's direction, unit and
format from the metric registry, distbench/metrics.py.
Results are read through the pydantic model `Result` (its JSON Schema: schemas/distbench.result-1.json):
known fields are typed strictly (a string where a number belongs is refused), and sections and metrics
this version does not know pass through, so newer writers stay readable.
"""

from __future__ import annotations

import json
import os
import statistics
import uuid
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .config import RunConfig
from .errors import DistbenchError
from .measure.adaptive import median_interval
from .measure.devicetime import DEVICE_BOUND_RATIO, regime
from .measure.timing import per_step_max, step_stats, throughput
from .workloads.models import get_model

if TYPE_CHECKING:
    from .runtime.pool import JobError

SCHEMA = "distbench.result/1"


class ResultFileError(DistbenchError, ValueError):
    """A result file that cannot be read (not UTF-8, not JSON, not a valid result); the message names it."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)


class ResultConfig(_Section):
    """The configuration a result measured; the fields that identify it are required."""

    strategy: Annotated[str, Field(min_length=1)]
    world_size: Annotated[int, Field(ge=1)]
    model: Annotated[str, Field(min_length=1)]
    precision: str
    seq_len: Annotated[int, Field(ge=0)]
    global_batch: Annotated[int, Field(ge=1)]
    micro_batch: Annotated[int, Field(ge=1)]
    compile: bool = False
    steps: Annotated[int, Field(ge=1)] | None = None
    warmup: Annotated[int, Field(ge=0)] | None = None
    device: str | None = None


class StepTimes(_Section):
    median: float
    p10: float
    p90: float
    n: Annotated[int, Field(ge=0)] | None = None
    steps: list[float] | None = None


class Nvml(_Section):
    throttled: bool = False


class Result(_Section):
    """One result as stored: `schema` names the version this model reads."""

    schema_: Literal["distbench.result/1"] = Field(alias="schema")
    id: Annotated[str, Field(min_length=1)]
    created: str
    status: Literal["ok", "oom", "error"]
    error: str | None = None
    config: ResultConfig
    metrics: dict[str, float]
    env: dict[str, Any] = Field(default_factory=dict)
    step_time_s: StepTimes | None = None
    losses: list[float] | None = None
    nvml: Nvml | None = None
    trace: dict[str, Any] | None = None


def json_schema() -> dict[str, Any]:
    """The JSON Schema of a stored result, generated from `Result` (committed as schemas/distbench.result-1.json)."""
    return Result.model_json_schema(by_alias=True)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def make_result(
    config: dict[str, Any],
    *,
    metrics: dict[str, float] | None = None,
    status: str = "ok",
    error: str | None = None,
    env: dict[str, Any] | None = None,
    **sections: Any,
) -> dict[str, Any]:
    """Assemble a result dict; extra sections (step_time_s, losses, nvml, trace, per_rank) pass through."""
    if status not in ("ok", "oom", "error"):
        raise ValueError(f"status must be ok, oom or error, not {status!r}")
    created = now_iso()
    rid = "-".join(
        str(x)
        for x in (
            config.get("strategy"),
            f"ws{config.get('world_size')}",
            config.get("model"),
            config.get("precision"),
            f"mb{config.get('micro_batch')}",
            created.replace(":", "").replace("+0000", "Z"),
            uuid.uuid4().hex[:6],  # repeats of one configuration saved within a second stay distinct
        )
    )
    return {
        "schema": SCHEMA,
        "id": rid,
        "created": created,
        "status": status,
        "error": error,
        "config": dict(config),
        "metrics": dict(metrics or {}),
        "env": dict(env or {}),
        **sections,
    }


def result_config(cfg: RunConfig, device_type: str | None) -> dict[str, Any]:
    """The config section of a result: the RunConfig with seq_len resolved, plus device and accumulation."""
    return {
        **cfg.to_dict(),
        "seq_len": cfg.seq_len or get_model(cfg.model).seq_len,
        "accum_steps": cfg.accum_steps,
        "device": device_type,
    }


def is_oom(e: JobError) -> bool:
    """True when a rank ran out of device memory (torch's OutOfMemoryError, or NCCL failing to allocate)."""
    return any(
        o.exc_type == "OutOfMemoryError"
        or "CUDA out of memory" in o.text
        or "CUDA error: out of memory" in o.text
        for o in e.outcomes
    )


def _oom_message(e: JobError) -> str:
    ranks = [o.rank for o in e.outcomes if o.exc_type == "OutOfMemoryError" or "out of memory" in o.text]
    first = next((o.text for o in e.outcomes if "out of memory" in o.text), "")
    line = next((ln for ln in first.splitlines() if "out of memory" in ln), "out of memory")
    return f"out of device memory on rank(s) {','.join(map(str, ranks))}: {line.strip()[:300]}"


def failure_result(
    cfg: RunConfig, device_type: str | None, e: JobError, env: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A result recording a configuration that failed: status "oom" or "error", and every rank's outcome."""
    from .runtime.fingerprint import environment_fingerprint  # torch: the read-only commands load this module

    oom = is_oom(e)
    per_rank = [{"rank": o.rank, "status": o.status, "exc_type": o.exc_type} for o in e.outcomes]
    return make_result(
        result_config(cfg, device_type),
        status="oom" if oom else "error",
        error=_oom_message(e) if oom else str(e),
        env=env or environment_fingerprint(device_type),
        per_rank=per_rank,
    )


def _aggregate_nvml(summaries: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    got = [s for s in summaries if s]
    if not got:
        return None

    def across(field_: str, stat: str, how) -> float | None:
        xs = [s[field_][stat] for s in got if s.get(field_)]
        return how(xs) if xs else None

    return {
        "throttled": any(s["throttled"] for s in got),
        "throttle_reasons": sorted({r for s in got for r in s["throttle_reasons"]}),
        "power_capped": any(s["power_capped"] for s in got),
        "gpu_util_pct_mean": across("gpu_util_pct", "mean", statistics.fmean),
        "sm_clock_mhz_median": across("sm_clock_mhz", "median", statistics.median),
        "power_w_mean": across("power_w", "mean", statistics.fmean),
        "temp_c_max": across("temp_c", "max", max),
        "per_rank": summaries,
    }


def _window_step_times(replies: list[dict[str, Any]]) -> list[float]:
    """Wall seconds per step of each timed window (the slowest rank's window), or [] without windows."""
    per_rank = [r.get("windows") or [] for r in replies]
    if not per_rank[0]:
        return []
    return [max(w[i]["wall_s"] for w in per_rank) / per_rank[0][i]["steps"] for i in range(len(per_rank[0]))]


def _device_time(replies: list[dict[str, Any]], step_time_s: float) -> dict[str, Any] | None:
    """The device-time sample across ranks: the busiest rank's figures and compute's mean over ranks, regime
    judged against the wall."""
    got = [r["device_time"] for r in replies if r.get("device_time")]
    if not got:
        return None
    out = {k: max(d[k] for d in got) for k in ("compute_s", "comm_s", "busy_s", "wall_s", "processing_s")}
    out["compute_mean_s"] = statistics.fmean(d["compute_s"] for d in got)
    for later in ("floor_s", "exposed_comm_s"):  # a distbench from before them has none
        if all(later in d for d in got):
            out[later] = max(d[later] for d in got)
    out["busy_ratio"] = min(1.0, out["busy_s"] / step_time_s)
    out["regime"] = regime(out["busy_ratio"])
    out["steps"] = got[0]["steps"]
    out["per_rank"] = got
    return out


def loss_step(cfg: RunConfig) -> int:
    """The step (1-based, warm-up included) whose loss a result shows: the last of warmup + steps, which every
    run of `cfg` reaches however its timing stops (more windows under until_ci, rounds side by side), so
    two runs of one configuration show the loss of the same step, the same in deterministic mode."""
    return cfg.warmup + cfg.steps


def loss_at_step(cfg: RunConfig, losses: list[float]) -> dict[str, Any]:
    """{"step": loss_step(cfg), "value": the global-batch loss of that step, None where the run stopped short}."""
    n = loss_step(cfg)
    return {"step": n, "value": losses[n - 1] if len(losses) >= n else None}


def summarize_bench(
    cfg: RunConfig,
    replies: list[dict[str, Any]],
    *,
    env: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A result from the per-rank replies of `bench` (or `bench_finish`); speedup and scaling efficiency need
    the other results of the matrix and come from `distbench.scaling.annotate`.

    step_time_s is the median over timed windows of the window's wall clock per step (throughput follows
    from it); the step_time_s section holds the per-step times (device events, or host time in sync mode).
    """
    r0 = replies[0]
    config = {**result_config(cfg, r0["device_type"]), "optimizer_impl": r0.get("optimizer_impl")}
    steps = per_step_max([r["step_times_s"] for r in replies])
    windows = _window_step_times(replies)
    # The steps themselves too: a 5-11% step-time CV on 4x H200 (FSDP2, ZeRO) needs them to find its pattern.
    stats = {**step_stats(steps), "steps": steps, "windows": windows}
    step_time = statistics.median(windows) if windows else stats["median"]
    # The figure's own 95% interval (None under 6 windows), and how the timing stopped when it measured
    # until the figure repeats (measure/adaptive.py): what a history stores beside the figure.
    interval = median_interval(windows) if windows else None
    stats["interval"] = list(interval) if interval else None
    if r0.get("adaptive"):
        stats["adaptive"] = r0["adaptive"]
    metrics: dict[str, float] = {
        **throughput(cfg.global_batch, r0["seq_len"], cfg.world_size, step_time),
        "step_time_s": step_time,
    }
    device = _device_time(replies, step_time)
    host = _host_section(replies)
    metrics.update(_host_and_device_metrics(host, device))
    efficiency, peak = _efficiency_and_memory(replies, metrics["tokens_per_s_per_gpu"])
    metrics.update(efficiency)
    nvml = _aggregate_nvml([r["nvml"] for r in replies])
    if nvml and nvml.get("sm_clock_mhz_median"):
        # Cycles per step: a clock that drifted between runs (1665-1875 MHz seen under load) cancels out.
        metrics["step_gcycles"] = step_time * nvml["sm_clock_mhz_median"] * 1e-3
    flops = {
        **r0["flops"],
        "n_params": r0["n_params"],
        "device_name": r0["device_name"],
        "peak_dtype": r0["peak_dtype"],
        "peak_flops": peak,
    }
    per_rank = [
        {"rank": r["rank"], "step_time_s": step_stats(r["step_times_s"]), **r["memory"]} for r in replies
    ]
    return make_result(
        config,
        metrics=metrics,
        env=env,
        step_time_s=stats,
        losses=r0["losses"],
        loss=loss_at_step(cfg, r0["losses"]),
        nvml=nvml,
        flops=flops,
        per_rank=per_rank,
        gc=_aggregate_gc([r.get("gc") for r in replies]),
        device_time=device,
        regime=_regime_section(device),
        host=host,
    )


#: per-step host figures of a window (jobs/bench.py) -> the metric of their median over steps
_HOST_METRICS = {"cpu_s": "host_cpu_s", "instructions": "host_instructions", "cycles": "host_cycles"}


def _host_section(replies: list[dict[str, Any]]) -> dict[str, Any] | None:
    """What issuing each timed step cost the host, the slowest rank's per step: the training thread's wall
    clock (`host_s`) and CPU time while it issued the step, and its user-mode instructions and cycles where
    the CPU's counters could be read (measure/hostcount.py; `counters_missing` says why not)."""
    ranks = [r for r in replies if r.get("windows")]
    if not ranks:
        return None

    def steps(get: Any) -> list[float] | None:
        per_rank = [[x for w in r["windows"] for x in (get(w) or [])] for r in ranks]
        return per_step_max(per_rank) if all(per_rank) else None

    out: dict[str, Any] = {
        "cpu_s": steps(lambda w: w["host_cpu_s"]),
        "host_s": steps(lambda w: w.get("host_s")),
    }
    for name in ("instructions", "cycles"):
        out[name] = steps(lambda w, n=name: (w.get("counts") or {}).get(n))
    counters = [r.get("counters") or {} for r in ranks]
    out["counters_missing"] = next((c["missing"] for c in counters if c.get("missing")), None)
    out["multiplexed"] = any(c.get("multiplexed") for c in counters)
    # per rank, per window: the host's speed around it (measure/hostspeed.py)
    out["speed"] = [[w.get("host_speed") for w in r["windows"]] for r in ranks]
    return out


def _host_and_device_metrics(host: dict[str, Any] | None, device: dict[str, Any] | None) -> dict[str, float]:
    """The host figures per step (median over steps of the slowest rank's) and the device-time sample's."""
    metrics: dict[str, float] = {}
    for key, metric in _HOST_METRICS.items():
        if host and host.get(key):
            metrics[metric] = float(statistics.median(host[key]))
    if device:
        metrics.update(
            device_compute_s=device["compute_s"],
            device_compute_mean_s=device["compute_mean_s"],
            device_comm_s=device["comm_s"],
            device_busy_s=device["busy_s"],
            busy_ratio=device["busy_ratio"],
        )
        if "floor_s" in device:
            metrics["device_compute_floor_s"] = device["floor_s"]
    return metrics


def _efficiency_and_memory(
    replies: list[dict[str, Any]], tokens_per_s_per_gpu: float
) -> tuple[dict[str, float], float | None]:
    """TFLOP/s per GPU, MFU where the device's peak is known, and each memory peak of the rank that peaked
    highest; and that peak FLOP/s."""
    from .measure.mfu import mfu, peak_flops, tflops_per_gpu  # torch: the read-only commands load this module

    r0 = replies[0]
    fpt = r0["flops"]["flops_per_token"]
    peak = peak_flops(r0["device_name"], r0["peak_dtype"])
    metrics = {"tflops_per_gpu": tflops_per_gpu(tokens_per_s_per_gpu, fpt)}
    util = mfu(tokens_per_s_per_gpu, fpt, peak)
    if util is not None:
        metrics["mfu"] = util
    for key in ("mem_allocated_peak_bytes", "mem_reserved_peak_bytes", "nvml_mem_used_peak_bytes"):
        vals = [r["memory"][key] for r in replies if r["memory"][key] is not None]
        if vals:
            metrics[key] = max(vals)
    return metrics, peak


def _regime_section(device: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the gate needs to know about the configuration: which side bounds its step, and by what ratio."""
    if device is None:
        return None
    return {
        "regime": device["regime"],
        "busy_ratio": device["busy_ratio"],
        "rule": f"device-bound when device busy time / wall step time >= {DEVICE_BOUND_RATIO}",
    }


def _aggregate_gc(per_rank: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Python collections in the timed window, worst rank per step (a step waits for its slowest rank)."""
    got = [g for g in per_rank if g]
    if not got:
        return None
    return {
        "collector_on": got[0]["collector_on"],
        "collections": [max(g["collections"][gen] for g in got) for gen in range(3)],
        "seconds": max(g["seconds"] for g in got),
        "step_seconds": per_step_max([g["step_seconds"] for g in got]),
    }


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write JSON to `path` via a temporary file in the same directory and an atomic rename, durably: the file
    is fsynced before the rename and the directory after it. The file's mode follows the umask."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{uuid.uuid4().hex}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # 0o666 & ~umask, as open() would
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=_jsonable)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a crash only once the directory is on disk
    finally:
        os.close(dir_fd)
    return path


def _jsonable(x: Any) -> Any:
    if hasattr(x, "item"):
        return x.item()
    if isinstance(x, (set, tuple)):
        return list(x)
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"not JSON serializable: {type(x).__name__}")


def save_result(result: dict[str, Any], out_dir: str | os.PathLike[str]) -> Path:
    """Save one result as `<out_dir>/<id>.json`."""
    if result.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} result")
    return write_json_atomic(Path(out_dir) / f"{result['id']}.json", result)


def load_results(paths: Iterable[str | os.PathLike[str]] | str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Load results from files and/or directories (recursively, *.json), skipping JSON that is not a result
    (another `schema`, or none); ResultFileError naming the file for one that cannot be read or is a damaged
    result."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no results at {p}")
        for f in sorted(p.rglob("*.json")) if p.is_dir() else [p]:
            obj = _read_json(f)
            for i, item in enumerate(obj if isinstance(obj, list) else [obj]):
                if isinstance(item, dict) and item.get("schema") == SCHEMA:
                    out.append(_checked(item, f"{f}" + (f" (item {i})" if isinstance(obj, list) else "")))
    return out


def _read_json(f: Path) -> Any:
    try:
        return json.loads(f.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise ResultFileError(
            f"{f} is not UTF-8 text (byte {e.start}); remove it or restore it from the run"
        ) from None
    except json.JSONDecodeError as e:
        raise ResultFileError(f"{f} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    except OSError as e:
        raise ResultFileError(f"cannot read {f}: {e.strerror}") from None


def _checked(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """`obj` as stored, once it validates as a Result."""
    try:
        Result.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        got = "" if err["type"] == "missing" else f" (got {err['input']!r:.60})"
        raise ResultFileError(
            f"{where} is a damaged {SCHEMA} result: {loc}: {err['msg'].lower()}{got}; "
            "remove it or restore it from the run"
        ) from None
    return obj


def config_key(result: dict[str, Any]) -> tuple:
    """The identity of a configuration: results with the same key are repeats of one another."""
    c = result["config"]
    return (
        c.get("strategy"),
        c.get("world_size"),
        c.get("model"),
        c.get("precision"),
        c.get("seq_len"),
        c.get("global_batch"),
        c.get("micro_batch"),
        c.get("compile", False),
    )
