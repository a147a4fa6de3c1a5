"""One result schema for every run, written atomically so a crashed run never leaves half a file.

A result is a plain JSON object:

    {
      "schema": "distbench.result/1",
      "id": "ddp-ws2-gpt2-large-bf16-mb8-<time>",
      "created": "2026-11-22T10:00:00+00:00",
      "status": "ok" | "oom" | "error",
      "error": null | "message",
      "config": {strategy, world_size, model, seq_len, global_batch, micro_batch, precision, steps, warmup, device, ...},
      "metrics": {<name>: float, ...},          # flat, directions in METRIC_DIRECTIONS
      "step_time_s": {"median", "p10", "p90", "mean", "std", "cv", "n", "steps": [s, ...]},
      "losses": [float, ...],
      "nvml": {... , "throttled": bool} | null,
      "trace": {...} | null,
      "gc": {"collector_on", "collections": [gen0, gen1, gen2], "seconds", "step_seconds": [...]} | null,
      "env": {fingerprint}
    }

Everything that compares results (the compare gate, asv, reports) reads metric directions from here.
"""

from __future__ import annotations

import json
import os
import tempfile
import uuid
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

SCHEMA = "distbench.result/1"

#: +1: higher is better, -1: lower is better.
METRIC_DIRECTIONS: dict[str, int] = {
    "tokens_per_s": +1,
    "tokens_per_s_per_gpu": +1,
    "samples_per_s": +1,
    "samples_per_s_per_gpu": +1,
    "mfu": +1,
    "tflops_per_gpu": +1,
    "scaling_efficiency": +1,
    "speedup": +1,
    "busbw_gbps": +1,
    "algbw_gbps": +1,
    "step_time_s": -1,
    "step_gcycles": -1,
    "host_cpu_s": -1,
    "device_compute_s": -1,
    "device_comm_s": -1,
    "device_busy_s": -1,
    "busy_ratio": +1,
    "config_overhead_s": -1,
    "mem_allocated_peak_bytes": -1,
    "mem_reserved_peak_bytes": -1,
    "nvml_mem_used_peak_bytes": -1,
    "compute_pct": +1,
    "idle_pct": -1,
    "non_compute_pct": -1,
    "overlap_pct": +1,
}


def direction(metric: str) -> int:
    """+1 if a larger value of `metric` is better, -1 if smaller is; KeyError for unknown metrics."""
    return METRIC_DIRECTIONS[metric]


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


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> Path:
    """Write JSON to `path` via a temporary file in the same directory and an atomic rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True, default=_jsonable)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
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
    """Load results from files and/or directories (recursively, *.json), skipping non-result JSON."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    out: list[dict[str, Any]] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no results at {p}")
        files = sorted(p.rglob("*.json")) if p.is_dir() else [p]
        for f in files:
            try:
                obj = json.loads(f.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{f} is not valid JSON: {e}") from e
            if isinstance(obj, dict) and obj.get("schema") == SCHEMA:
                out.append(obj)
            elif isinstance(obj, list):
                out.extend(o for o in obj if isinstance(o, dict) and o.get("schema") == SCHEMA)
    return out


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
