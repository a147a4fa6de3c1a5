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
      "nvml": {... , "throttled": bool} | null,
      "trace": {...} | null,
      "gc": {"collector_on", "collections": [gen0, gen1, gen2], "seconds", "step_seconds": [...]} | null,
      "env": {fingerprint}
    }

Everything that compares results (the compare gate, asv, reports) reads a metric's direction, unit and
format from the metric registry, distbench/metrics.py.
Results are read through the pydantic model `Result` (its JSON Schema: schemas/distbench.result-1.json):
known fields are typed strictly (a string where a number belongs is refused), and sections and metrics
this version does not know pass through, so newer writers stay readable.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .errors import DistbenchError

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
        raise ResultFileError(f"{f} is not UTF-8 text (byte {e.start}); remove it or restore it from the run") from None
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
        raise ResultFileError(f"{where} is a damaged {SCHEMA} result: {loc}: {err['msg'].lower()}{got}; "
                              "remove it or restore it from the run") from None
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
